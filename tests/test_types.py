"""Configs are checked where they are built: a fitting value of another type becomes the
declared one, anything else is refused there, naming the field (never a TypeError later,
inside the engine thread)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from cellbatch import Runner
from cellbatch.generation_config import GenConfig, SamplingParams
from cellbatch.scheduler import DecodeFirstScheduler
from cellbatch.types import FinishReason, InvalidArgumentError
from fake_executor import WAIT_S, FakeExecutor, make_tokens, open_session


def test_gen_config_coerces_sequences_to_its_declared_types() -> None:
    config = GenConfig(
        stop_tokens=(2, np.int64(3)),  # type: ignore[arg-type]
        extra_stop_tokens=[7],  # type: ignore[arg-type]
        stop_strings=["\n\n", "END"],  # type: ignore[arg-type]
        seed=np.int64(4),  # type: ignore[arg-type]
    )
    assert config.stop_tokens == frozenset({2, 3})
    assert config.extra_stop_tokens == frozenset({7})
    assert config.stop_strings == ("\n\n", "END")
    assert config.seed == 4 and type(config.seed) is int
    assert GenConfig(stop_strings="END").stop_strings == ("END",)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"stop_tokens": "ab"}, "stop_tokens"),
        ({"stop_tokens": [1.5]}, "stop_tokens[0]"),
        ({"stop_tokens": [-1]}, "stop_tokens"),
        ({"stop_tokens": 2}, "stop_tokens"),
        ({"extra_stop_tokens": [True]}, "extra_stop_tokens[0]"),
        ({"stop_strings": ["a", 3]}, "stop_strings[1]"),
        ({"seed": -1}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"sampling": {"temperature": 0.5}}, "sampling"),
        ({"include_stop_string": "yes"}, "include_stop_string"),
    ],
)
def test_gen_config_refuses_what_cannot_be_its_type(fields: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidArgumentError, match="^" + re.escape(named)):
        GenConfig(**fields)  # type: ignore[arg-type]


def test_sampling_params_coerce_sequences_and_numbers() -> None:
    params = SamplingParams(
        temperature=1,
        top_k=np.int32(5),  # type: ignore[arg-type]
        logit_bias={5: 1, 6: -2.5},  # type: ignore[arg-type]
        allowed_tokens=[1, 2, 2],  # type: ignore[arg-type]
        banned_sequences=[[3, 4], (5,)],  # type: ignore[arg-type]
        min_tokens_held=(2,),  # type: ignore[arg-type]
    )
    assert params.temperature == 1.0 and type(params.temperature) is float
    assert params.top_k == 5 and type(params.top_k) is int
    assert params.logit_bias == ((5, 1.0), (6, -2.5))
    assert params.allowed_tokens == frozenset({1, 2})
    assert params.banned_sequences == ((3, 4), (5,))
    assert params.min_tokens_held == frozenset({2})
    assert SamplingParams(logit_bias=[(5, 1.0)]).logit_bias == ((5, 1.0),)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"top_k": 2.0}, "top_k"),
        ({"logit_bias": [(1, 2, 3)]}, r"logit_bias\[0\]"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias token"),
        ({"allowed_tokens": "abc"}, "allowed_tokens"),
        ({"banned_sequences": [[1, "x"]]}, r"banned_sequences\[0\]\[1\]"),
        ({"constraint": "json"}, "constraint"),
    ],
)
def test_sampling_params_refuse_what_cannot_be_their_type(
    fields: dict[str, object], named: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"^{named}"):
        SamplingParams(**fields)  # type: ignore[arg-type]


def test_stop_tokens_given_as_a_tuple_stop_a_generation() -> None:
    """The case that failed inside the engine thread with a TypeError (tuple | frozenset)."""
    fake = FakeExecutor(stop_after=2, stop_token=2)
    with Runner(fake, DecodeFirstScheduler.create(64, 8, 16)) as runner:
        session = open_session(runner)
        config = GenConfig(max_new_tokens=5, stop_tokens=(2,))  # type: ignore[arg-type]
        handle = session.generate_async(make_tokens(4), config)
        assert handle.wait(WAIT_S)
        assert handle.finish_reason() == FinishReason.STOP_TOKEN, handle.error()
        assert handle.tokens() == [1004, 2]
        session.close()
