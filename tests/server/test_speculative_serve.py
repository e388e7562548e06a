"""`cellbatch serve` with speculative decoding answers exactly as without it: greedy and
seeded sampling, stop strings, logprobs, `n`, JSON mode; and /metrics reports the drafts
and their acceptance, labelled by method, as vLLM's spec_decode metrics do."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from served import API_KEY, MODEL_NAME, LiveServer


@pytest.fixture(scope="module")
def speculating(start_server: Callable[..., LiveServer], tiny_chat_model: Path) -> LiveServer:
    """The served model drafting for itself: every greedy draft is kept."""
    config = {"method": "draft_model", "model": str(tiny_chat_model), "num_speculative_tokens": 4}
    return start_server(prefix_cache_entries=8, speculative=config)


def _answer(server: LiveServer, **request: Any) -> list[tuple[Any, ...]]:
    completion = server.client().completions.create(model=MODEL_NAME, **request)
    return [
        (
            choice.index,
            choice.text,
            choice.finish_reason,
            None if choice.logprobs is None else choice.logprobs.token_logprobs,
            None if choice.logprobs is None else choice.logprobs.top_logprobs,
        )
        for choice in completion.choices
    ]


def test_completions_equal_the_server_without_speculation(
    live: LiveServer, speculating: LiveServer
) -> None:
    requests: list[dict[str, Any]] = [
        {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "logprobs": 2},
        {"prompt": "Tell me a story", "max_tokens": 48, "temperature": 0.8, "top_p": 0.9,
         "seed": 5, "n": 3},
        {"prompt": "List the planets", "max_tokens": 48, "temperature": 0.8, "seed": 11,
         "logprobs": 1, "frequency_penalty": 0.5},
    ]  # fmt: skip
    for request in requests:
        assert _answer(speculating, **request) == _answer(live, **request), request
    # A stop string from the middle of an answer cuts both at the same place.
    ((_, text, *_),) = _answer(live, prompt="Say something", max_tokens=48, temperature=0)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = {"prompt": "Say something", "max_tokens": 48, "temperature": 0, "stop": [stop]}
    answer = _answer(speculating, **stopped)
    assert answer == _answer(live, **stopped)
    assert answer[0][2] == "stop"


def test_json_mode_equals_the_server_without_speculation(
    live: LiveServer, speculating: LiveServer
) -> None:
    request = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Describe a cat as JSON."}],
        "max_tokens": 64,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    plain = live.client().chat.completions.create(**request)
    spec = speculating.client().chat.completions.create(**request)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.choices[0].finish_reason == plain.choices[0].finish_reason


def test_metrics_report_drafts_and_acceptance_by_method(speculating: LiveServer) -> None:
    _answer(speculating, prompt="Count to ten", max_tokens=24, temperature=0)
    text = httpx.get(
        speculating.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
    ).text
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    method = (("method", "draft_model"),)
    drafted = samples[("cellbatch_spec_decode_num_draft_tokens_total", method)]
    accepted = samples[("cellbatch_spec_decode_num_accepted_tokens_total", method)]
    assert drafted > 0 and samples[("cellbatch_spec_decode_num_drafts_total", method)] > 0
    assert samples[("cellbatch_spec_decode_acceptance_rate", method)] == accepted / drafted
    first = (
        "cellbatch_spec_decode_num_accepted_tokens_per_pos_total",
        (*method, ("position", "0")),
    )
    assert 0 < samples[first] <= accepted
