"""The runner-overhead benchmark (benchmarks/runner_overhead.py) still drives today's Runner:
its instant executor implements the executor protocol and a short run counts its steps."""

from __future__ import annotations

from cellbatch.executor import Executor
from runner_overhead import InstantExecutor, measure


def test_the_instant_executor_implements_the_protocol() -> None:
    assert isinstance(InstantExecutor(), Executor)


def test_a_short_run_counts_one_step_per_token() -> None:
    rate, steps = measure(sessions=3, tokens=5)
    # The first step feeds the prompts and yields each first token; four more decode.
    assert steps == 5 and rate > 0
