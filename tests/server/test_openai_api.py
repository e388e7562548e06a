"""`cellbatch serve` through the official `openai` client: completions and chat,
streaming and not, n, stop, logprobs, echo, seeds, penalties, keys and errors."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
import torch

from cellbatch.generation_config import GenConfig
from cellbatch.server.protocol import ASKS_NOTHING
from served import API_KEY, CONTEXT, MODEL_NAME
from tiny_models import reference_model

PROMPT = "Write a short story about a lighthouse keeper."


def greedy_tokens(live, prompt_tokens: list[int], count: int) -> list[int]:
    (result,) = live.engine.generate([prompt_tokens], GenConfig(max_new_tokens=count))
    return result.tokens


def test_the_model_is_listed(live) -> None:
    models = live.client().models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]


def test_greedy_completion_equals_engine_generate(live) -> None:
    prompt_tokens = live.engine.tokenizer.encode(PROMPT)
    completion = live.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0
    )
    expected = greedy_tokens(live, prompt_tokens, 12)
    (choice,) = completion.choices
    assert choice.text == live.engine.decode(expected)
    assert completion.usage.prompt_tokens == len(prompt_tokens)
    assert completion.usage.completion_tokens == len(expected)
    assert choice.finish_reason in ("length", "stop")


def test_chat_streamed_and_not_give_the_same_text(live) -> None:
    client = live.client()
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0
    )
    expected_tokens = greedy_tokens(live, live.engine.chat_tokens(messages), 16)
    assert whole.choices[0].message.content == live.engine.decode(expected_tokens)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected_tokens)


def test_n_choices_with_a_seed_are_reproducible(live) -> None:
    client = live.client()
    ask = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0.9, n=3, seed=7)
    first = client.completions.create(**ask)
    second = client.completions.create(**ask)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # each choice draws its own tokens


def test_a_stop_string_cuts_the_text_before_it(live) -> None:
    client = live.client()
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[6:9]
    assert stop.strip() and stop in text
    stopped = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\u2603"]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    pieces = [chunk.choices[0].text for chunk in streamed if chunk.choices]
    assert "".join(pieces) == text[: text.index(stop)]
    assert all(stop not in piece for piece in pieces)


def test_chat_logprobs_are_sorted_and_hold_the_greedy_token(live) -> None:
    answer = live.client().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])  # greedy picks the most likely
        assert entry.top_logprobs[0].token == entry.token


def test_echo_with_max_tokens_0_scores_the_prompt_like_a_direct_forward(
    live, tiny_chat_model
) -> None:
    prompt_tokens = live.engine.tokenizer.encode(PROMPT)
    scored = live.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2
    )
    (choice,) = scored.choices
    assert choice.text == live.engine.decode(prompt_tokens)
    assert scored.usage.completion_tokens == 0
    logprobs = choice.logprobs.token_logprobs
    assert len(logprobs) == len(prompt_tokens) and logprobs[0] is None
    reference = reference_model(tiny_chat_model)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt_tokens])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    for position in range(1, len(prompt_tokens)):
        want = expected[position - 1, prompt_tokens[position]].item()
        assert logprobs[position] == pytest.approx(want, abs=1e-4)


def test_presence_penalty_leaves_fewer_repeats(live) -> None:
    client = live.client()
    ask = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0, logprobs=0)
    plain = client.completions.create(**ask)
    penalised = client.completions.create(**ask, presence_penalty=2.0, frequency_penalty=2.0)
    plain_tokens = plain.choices[0].logprobs.tokens
    penalised_tokens = penalised.choices[0].logprobs.tokens
    assert plain_tokens != penalised_tokens
    assert len(set(penalised_tokens)) >= len(set(plain_tokens))


def test_a_missing_or_wrong_key_is_401_and_health_needs_none(live) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        live.client(api_key="wrong").models.list()
    assert refused.value.status_code == 401
    body = httpx.get(live.base_url + "/v1/models").json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(live.base_url + "/health").status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{not json", 400, None, None),
        (json.dumps({"prompt": "hi", "max_tokens": "many"}).encode(), 400, "max_tokens", None),
        (json.dumps({"prompt": "hi", "n": 1000}).encode(), 400, "n", None),
        (json.dumps({"prompt": "hi", "logprobs": 21}).encode(), 400, "logprobs", None),
        (
            json.dumps({"prompt": "hi " * CONTEXT, "max_tokens": 4}).encode(),
            400,
            "prompt",
            "context_length_exceeded",
        ),
        (
            json.dumps({"prompt": "hi", "max_tokens": CONTEXT}).encode(),
            400,
            "max_tokens",
            "context_length_exceeded",
        ),
        (json.dumps({"prompt": "x" * 70_000}).encode(), 413, None, None),
        (json.dumps({"prompt": "hi", "stop": [""]}).encode(), 400, "stop.0", None),
        (json.dumps({"prompt": "hi", "stop": ""}).encode(), 400, "stop", None),
        (json.dumps({"prompt": "hi", "n": 0}).encode(), 400, "n", None),
        (json.dumps({"prompt": "hi", "max_tokens": -1}).encode(), 400, "max_tokens", None),
        (json.dumps({"prompt": "hi", "model": "gpt-9"}).encode(), 404, "model", "model_not_found"),
        (
            json.dumps({"prompt": "hi", "response_format": {"type": "yaml"}}).encode(),
            400,
            "response_format.type",
            None,
        ),
        (
            json.dumps({"prompt": "hi", "guided_regex": "a+", "guided_choice": ["a"]}).encode(),
            400,
            "response_format",
            "invalid_constraint",
        ),
        (
            json.dumps({"prompt": "hi", "tools": [{"type": "function"}]}).encode(),
            400,
            "tools",
            None,
        ),
        (
            json.dumps({"prompt": "hi", "logit_bias": {"5": 101}}).encode(),
            400,
            "logit_bias.5",
            None,
        ),
        (json.dumps({"prompt": "hi", "best_of": 2}).encode(), 400, "best_of", None),
        (json.dumps({"prompt": "hi", "suffix": "end"}).encode(), 400, "suffix", None),
    ],
)
def test_bad_requests_get_openai_errors_and_harm_no_one(live, body, status, param, code) -> None:
    answer = httpx.post(
        live.base_url + "/v1/completions",
        content=body,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["code"] == code
    ok = live.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert ok.choices[0].text is not None


def test_chat_top_logprobs_over_20_is_refused(live) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        live.client().chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            logprobs=True,
            top_logprobs=21,
        )
    assert refused.value.status_code == 400


def test_a_model_not_served_is_404_model_not_found(live) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        live.client().chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert refused.value.code == "model_not_found"
    assert MODEL_NAME in refused.value.message


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/nothing", 404), ("POST", "/v1/models", 405), ("GET", "/v1/completions", 405)],
)
def test_unknown_routes_and_methods_answer_in_openai_shape(live, method, path, status) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    answer = httpx.request(method, live.base_url + path, headers=headers)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert path in error["message"] and error["type"] == "invalid_request_error"


def test_fields_that_ask_for_nothing_pass(live) -> None:
    answer = live.client().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        response_format={"type": "text"},
        tool_choice="none",
        extra_body={"logit_bias": None, "ignore_eos": False, "best_of": 1},
    )
    assert answer.choices[0].message.content is not None


def test_an_unknown_field_is_logged_once_per_name(live, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="cellbatch.server.app")
    for _ in range(3):
        live.client().completions.create(
            model=MODEL_NAME,
            prompt="hi",
            max_tokens=1,
            extra_body={"frobnicate": 1, "ignore_eos": False},
        )
    said = [r.getMessage() for r in caplog.records if "frobnicate" in r.getMessage()]
    assert len(said) == 1 and "unknown request field" in said[0]
    assert not any("ignore_eos" in r.getMessage() for r in caplog.records)  # known, asks nothing


def test_openapi_documents_the_request_bodies(live) -> None:
    schema = httpx.get(live.base_url + "/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model}"}
    chat = components["ChatCompletionRequest"]
    assert {"messages", "max_tokens", "temperature", "stop", "stream"} <= set(chat["properties"])
    assert {"response_format", "structured_outputs", "grammar"} <= set(chat["properties"])
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat["properties"])
    completion = components["CompletionRequest"]
    # Refused there when they ask for something: only the values that ask for nothing.
    assert completion["properties"]["tools"] == ASKS_NOTHING
    assert "ChatMessage" in components and "ErrorResponse" in components
