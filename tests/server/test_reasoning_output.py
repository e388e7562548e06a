"""Reasoning output through the official clients: a model whose template thinks (a
scripted tiny model that answers `<think>…</think>` then text) has its reasoning split
off in every API, streamed and not; a model whose template does not think, or a server
started with `--reasoning-parser none`, leaves the text as it is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from cellbatch.reasoning import reasoning_for_template
from served import API_KEY, MODEL_NAME, LiveServer, start_live_server
from tiny_models import make_scripted_thinking_checkpoint

REASONING = "Counting sheep."
ANSWER = "Hello there!"
SCRIPT = f"<think>{REASONING}</think>{ANSWER}"
ASK = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scripted_thinking_checkpoint(tmp_path_factory.mktemp("thinker") / "m", SCRIPT)


@pytest.fixture(scope="module")
def thinking(thinker: Path) -> Iterator[LiveServer]:
    server = start_live_server(thinker, max_sessions=4)
    yield server
    server.stop()


def test_chat_splits_the_reasoning_off_streamed_and_not(thinking: LiveServer) -> None:
    client = thinking.client()
    whole = client.chat.completions.create(model=MODEL_NAME, messages=ASK, temperature=0)
    message = whole.choices[0].message
    assert message.content == ANSWER
    assert message.reasoning_content == REASONING  # type: ignore[attr-defined]
    reasoning, content = "", ""
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, temperature=0, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert not (delta.get("reasoning_content") and delta.get("content"))
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert (reasoning, content) == (REASONING, ANSWER)


def test_the_responses_api_gives_a_reasoning_item(thinking: LiveServer) -> None:
    client = thinking.client()
    response = client.responses.create(model=MODEL_NAME, input="Say hello.", temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning"
    assert [part.text for part in reasoning.content] == [REASONING]
    assert message.type == "message" and response.output_text == ANSWER
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    events = list(
        client.responses.create(model=MODEL_NAME, input="Say hello.", temperature=0, stream=True)
    )
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, said) == (REASONING, ANSWER)
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == ANSWER


def test_the_messages_api_gives_a_thinking_block(thinking: LiveServer) -> None:
    client = thinking.anthropic()
    # This SDK no longer names temperature (Claude's newest models take none); older
    # clients send it, and the server reads it.
    greedy = {"extra_body": {"temperature": 0}}
    message = client.messages.create(model=MODEL_NAME, max_tokens=32, messages=ASK, **greedy)
    thinking, text = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", REASONING)
    assert (text.type, text.text) == ("text", ANSWER)
    assert message.stop_reason == "end_turn"
    with client.messages.stream(model=MODEL_NAME, max_tokens=32, messages=ASK, **greedy) as stream:
        streamed = stream.get_final_message()
    assert [block.model_dump() for block in streamed.content] == [
        block.model_dump() for block in message.content
    ]


def test_reasoning_parser_none_leaves_the_text_whole(thinker: Path) -> None:
    server = start_live_server(thinker, max_sessions=2, reasoning_parser="none")
    try:
        whole = server.client().chat.completions.create(
            model=MODEL_NAME, messages=ASK, temperature=0
        )
    finally:
        server.stop()
    message = whole.choices[0].message
    assert message.content == SCRIPT
    assert message.reasoning_content is None  # type: ignore[attr-defined]


def test_a_template_that_does_not_think_splits_nothing(live: LiveServer) -> None:
    # The shared server's model (the default model's ChatML template) never thinks.
    assert reasoning_for_template(live.engine.tokenizer.chat_template_text) is None
    whole = live.client().chat.completions.create(
        model=MODEL_NAME, messages=ASK, temperature=0, max_tokens=8
    )
    assert whole.choices[0].message.reasoning_content is None  # type: ignore[attr-defined]


def test_chat_template_kwargs_reach_the_template(thinking: LiveServer) -> None:
    # vLLM's chat_template_kwargs: Qwen3's enable_thinking=False closes an empty
    # <think></think> in the prompt, so the answer starts after it, all content.
    client = thinking.client()
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, temperature=0, extra_body=off
    )
    assert whole.choices[0].message.reasoning_content is None  # type: ignore[attr-defined]
    assert whole.usage is not None
    plain = client.chat.completions.create(model=MODEL_NAME, messages=ASK, temperature=0)
    assert plain.usage is not None and whole.usage.prompt_tokens > plain.usage.prompt_tokens
    counted = httpx.post(
        f"{thinking.base_url}/tokenize",
        json={"messages": ASK, **off},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert counted.json()["count"] == whole.usage.prompt_tokens, counted.text
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, extra_body={"chat_template_kwargs": {"tools": []}}
        )
    assert refused.value.body["param"] == "chat_template_kwargs"


def test_anthropic_thinking_disabled_reaches_the_template(thinking: LiveServer) -> None:
    client = thinking.anthropic()
    greedy = {"extra_body": {"temperature": 0}}
    off = client.messages.create(
        model=MODEL_NAME, max_tokens=32, messages=ASK, thinking={"type": "disabled"}, **greedy
    )
    assert [block.type for block in off.content] == ["text"]
    counted = [
        client.messages.count_tokens(model=MODEL_NAME, messages=ASK, **extra).input_tokens
        for extra in ({}, {"thinking": {"type": "disabled"}})
    ]
    # The disabled template closes an empty <think></think> in the prompt.
    assert counted[1] > counted[0] and off.usage.input_tokens == counted[1]
