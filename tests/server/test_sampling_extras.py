"""The sampling extras clients and benchmark tools send, through the official client
(`extra_body` for vLLM's), and vLLM's `/tokenize` and `/detokenize`."""

from __future__ import annotations

import httpx
import openai
import pytest

from served import API_KEY, MODEL_NAME

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def tokenize(live, **body: object) -> list[int]:
    answer = httpx.post(live.base_url + "/tokenize", json=body, headers=HEADERS)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["tokens"])


STANDARD = ("max_tokens", "logit_bias", "temperature", "seed", "stop")


def complete(live, **options: object):  # -> openai Completion
    """A completion of one prompt, greedy unless told; vLLM's fields go in extra_body."""
    extra = {k: options.pop(k) for k in list(options) if k not in STANDARD}
    options.setdefault("temperature", 0.0)
    return live.client().completions.create(
        model=MODEL_NAME, prompt="Once upon a time", extra_body=extra, **options
    )


def test_tokenize_and_detokenize_round_trip(live) -> None:
    tokens = tokenize(live, prompt="Once upon a time", add_special_tokens=False)
    assert tokens == live.engine.tokenizer.encode("Once upon a time", False)
    back = httpx.post(live.base_url + "/detokenize", json={"tokens": tokens}, headers=HEADERS)
    assert back.json() == {"prompt": "Once upon a time"}
    chat = tokenize(live, messages=[{"role": "user", "content": "hi"}])
    assert chat == live.engine.chat_tokens("hi")
    answer = httpx.post(live.base_url + "/tokenize", json={"prompt": "x"}, headers=HEADERS)
    assert answer.json()["max_model_len"] > 0 and answer.json()["count"] == 1
    for route, body, param in (
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),
        ("/tokenize", {"prompt": "x", "model": "gpt-9"}, "model"),
    ):
        refused = httpx.post(live.base_url + route, json=body, headers=HEADERS)
        assert refused.status_code in (400, 404) and refused.json()["error"]["param"] == param


def test_logit_bias_and_allowed_token_ids(live) -> None:
    token = tokenize(live, prompt=" castle", add_special_tokens=False)[-1]
    forced = complete(live, max_tokens=4, logit_bias={str(token): 100})
    assert forced.choices[0].text == " castle" * 4
    allowed = tokenize(live, prompt=" red green blue", add_special_tokens=False)
    picked = complete(live, max_tokens=6, allowed_token_ids=allowed, temperature=1.0, seed=3)
    assert set(tokenize(live, prompt=picked.choices[0].text, add_special_tokens=False)) <= set(
        allowed
    )
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        complete(live, max_tokens=2, logit_bias={"not-a-token": 1})


def test_stop_token_ids_ignore_eos_and_min_tokens(live) -> None:
    eos = live.engine.tokenizer.eos_token_id
    pulled = complete(live, max_tokens=8, logit_bias={str(eos): 100})
    assert pulled.choices[0].finish_reason == "stop" and pulled.usage.completion_tokens == 1
    held = complete(live, max_tokens=8, logit_bias={str(eos): 100}, min_tokens=3)
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4
    ignored = complete(live, max_tokens=5, logit_bias={str(eos): 100}, ignore_eos=True)
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 5
    token = tokenize(live, prompt=" castle", add_special_tokens=False)[-1]
    stopped = complete(
        live, max_tokens=8, logit_bias={str(token): 100}, stop_token_ids=[token], ignore_eos=True
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1


def test_bad_words_and_the_stop_string_kept(live) -> None:
    plain = complete(live, max_tokens=10).choices[0].text
    words = plain.split()
    assert words, plain
    without = complete(live, max_tokens=10, bad_words=[words[0]]).choices[0].text
    assert words[0] not in without.split()[:1]
    stop = plain[len(plain) // 2 :][:3]
    cut = complete(live, max_tokens=10, stop=[stop]).choices[0].text
    kept = complete(live, max_tokens=10, stop=[stop], include_stop_str_in_output=True)
    assert kept.choices[0].text == cut + stop
