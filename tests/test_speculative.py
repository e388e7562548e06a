"""SpeculativeConfig: vLLM's --speculative-config, checked where it is built."""

from __future__ import annotations

import pytest

from cellbatch.speculative import SpeculativeConfig, parse_speculative_config
from cellbatch.types import InvalidArgumentError


def test_vllm_spellings_parse() -> None:
    ngram = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}'
    )
    assert ngram == SpeculativeConfig("ngram", 4, 4, 2)
    assert ngram is not None and ngram.lookup == (2, 4)
    draft = parse_speculative_config(
        {"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}
    )
    assert draft == SpeculativeConfig("draft_model", 3, model="/m")
    # A model alone names a draft model, as in vLLM.
    assert parse_speculative_config({"model": "/m"}) == SpeculativeConfig("draft_model", model="/m")
    assert parse_speculative_config(None) is None
    assert parse_speculative_config(ngram) is ngram


def test_lookup_window_defaults_follow_the_end_given() -> None:
    assert SpeculativeConfig("ngram").lookup == (2, 4)
    assert SpeculativeConfig("ngram", prompt_lookup_max=1).lookup == (1, 1)
    assert SpeculativeConfig("ngram", prompt_lookup_min=6).lookup == (6, 6)
    assert SpeculativeConfig("ngram", prompt_lookup_max=8).lookup == (2, 8)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"method": "eagle"}, "method must be one of ngram, draft_model"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup"),
        ({"method": "ngram", "model": "/m"}, "takes no model"),
        ({"method": "draft_model"}, 'needs "model"'),
        ({"method": "draft_model", "model": "/m", "prompt_lookup_max": 3}, "prompt_lookup_max"),
        ({"method": "ngram", "draft_tensor_parallel_size": 1}, "unknown keys"),
        ({"num_speculative_tokens": 4}, 'needs "method"'),
        ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(value: object, named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        parse_speculative_config(value)  # type: ignore[arg-type]
