"""LoRA adapters in the runner, over the fake executor: a generation acquires its adapter
when submitted, the executor learns the id before the generation's tasks run, the
adapter is released once the generation has settled, and the prefix cache never serves
one adapter's cells to another."""

from __future__ import annotations

import threading

import pytest

from cellbatch.generation_config import GenConfig
from cellbatch.types import FinishReason, InvalidArgumentError
from fake_executor import WAIT_S, make_tokens, open_session


class Adapters:
    """An AdapterLookup that records what is acquired and released."""

    def __init__(self, names: dict[str, int]) -> None:
        self.names = dict(names)
        self.acquired: list[int] = []
        self.released: list[tuple[int, int, int]] = []
        self.lock = threading.Lock()

    def acquire(self, name: str) -> int:
        with self.lock:
            if name not in self.names:
                raise InvalidArgumentError(f"no LoRA adapter named {name!r} is loaded")
            self.acquired.append(self.names[name])
            return self.names[name]

    def release(self, adapter_id: int, prompt_tokens: int, generated_tokens: int) -> None:
        with self.lock:
            self.released.append((adapter_id, prompt_tokens, generated_tokens))


def test_a_generation_runs_with_its_adapter_and_releases_it_once_settled(runners) -> None:
    adapters = Adapters({"sql": 7})
    runner, fake = runners.make(adapters=adapters)
    fake.hold()
    handle = runner.submit(make_tokens(10), GenConfig(max_new_tokens=3, adapter="sql"))
    assert fake.wait_held(WAIT_S)
    assert adapters.acquired == [7] and adapters.released == []  # held while it runs
    (sid,) = {inp.sid for inp in fake.batches[0].inputs}
    assert fake.adapters == [(sid, 7)]  # installed before its first step
    fake.release()
    assert handle.wait(WAIT_S) and handle.finish_reason() == FinishReason.TOKEN_LIMIT
    assert adapters.released == [(7, 10, 3)]


def test_the_base_model_is_installed_for_a_generation_without_an_adapter(runners) -> None:
    adapters = Adapters({"sql": 7})
    runner, fake = runners.make(adapters=adapters)
    session = open_session(runner)
    for adapter, expected in (("sql", 7), (None, 0)):
        handle = session.generate_async(
            make_tokens(4), GenConfig(max_new_tokens=2), adapter=adapter
        )
        assert handle.wait(WAIT_S) and handle.finish_reason() == FinishReason.TOKEN_LIMIT
        assert fake.adapters[-1] == (session.id, expected)
    assert adapters.acquired == [7] and [r[0] for r in adapters.released] == [7]
    session.close()


@pytest.mark.parametrize(
    ("adapters", "message"),
    [
        (Adapters({"sql": 7}), "no LoRA adapter named 'chat'"),
        (None, "serves no LoRA adapters"),
    ],
)
def test_an_unknown_adapter_fails_the_generation_and_runs_nothing(
    runners, adapters, message
) -> None:
    runner, fake = runners.make(adapters=adapters)
    handle = runner.submit(make_tokens(5), GenConfig(adapter="chat"))
    assert handle.wait(WAIT_S) and handle.finish_reason() == FinishReason.FAILED
    assert message in handle.error()
    assert fake.batches == [] and (adapters is None or adapters.released == [])


def test_a_prefill_turn_runs_with_its_adapter(runners) -> None:
    adapters = Adapters({"sql": 7})
    runner, fake = runners.make(adapters=adapters)
    session = open_session(runner)
    handle = session.prefill_async(make_tokens(6), adapter="sql")
    assert handle.wait(WAIT_S) and handle.finish_reason() == FinishReason.TOKEN_LIMIT
    assert fake.adapters == [(session.id, 7)] and adapters.released == [(7, 6, 0)]
    session.close()


def test_the_prefix_cache_serves_a_prefix_only_to_its_own_adapter(runners) -> None:
    adapters = Adapters({"a": 1, "b": 2})
    runner, _ = runners.make(adapters=adapters, prefix_cache_entries=8)
    prompt = make_tokens(20)
    for adapter in ("a", None):
        handle = runner.submit(prompt, GenConfig(max_new_tokens=2, adapter=adapter))
        assert handle.wait(WAIT_S)
    cached = {}
    for adapter in ("b", "a", None, "b"):
        handle = runner.submit(prompt, GenConfig(max_new_tokens=2, adapter=adapter))
        assert handle.wait(WAIT_S) and handle.finish_reason() == FinishReason.TOKEN_LIMIT
        cached.setdefault(adapter, []).append(handle.metrics().cached_tokens)
    # b never ran before its first request: nothing of a's or the base's serves it.
    assert cached == {"b": [0, 19], "a": [19], None: [19]}
