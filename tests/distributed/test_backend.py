"""ReplicaBackend against scripted stand-in actors (no Ray running): a replica that fails
before streaming is retried once elsewhere, one that fails mid-stream fails its request
with its name, two failures end the request (no hang), cancels reach the replica, and
health sees replicas down and restarted."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from cellbatch.distributed import backend as replica_backend
from cellbatch.distributed.backend import ReplicaBackend
from cellbatch.distributed.cluster import import_ray
from cellbatch.distributed.replica import Delivery, ReplicaInfo
from cellbatch.engine import EngineShape
from cellbatch.generation_config import GenConfig
from cellbatch.metrics import GenerationMetrics
from cellbatch.server.api import Choice, Plan
from cellbatch.types import FinishReason, GenerationUpdate

ray = import_ray(local=True)
PLAN = Plan(prompts=[[1, 2, 3]], configs=[GenConfig(max_new_tokens=2)], n=2)


def died() -> Exception:
    return ray.exceptions.ActorDiedError()


def token(choice: int, value: int, final: bool = False) -> Delivery:
    reason = FinishReason.TOKEN_LIMIT if final else None
    metrics = GenerationMetrics(cached_tokens=value) if final else None
    return Delivery(choice, GenerationUpdate((value,), reason, text=f"<{value}>"), metrics)


WHOLE = [[token(0, 5), token(1, 6)], [token(0, 7, final=True), token(1, 8, final=True)]]


class Ref:
    """An ObjectRef stand-in: awaitable, with a future()."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, Any]:
        async def get() -> Any:
            if isinstance(self.value, BaseException):
                raise self.value
            return self.value

        return get().__await__()

    def future(self) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if isinstance(self.value, BaseException):
            future.set_exception(self.value)
        else:
            future.set_result(self.value)
        return future


class Stream:
    """A streaming call: yields the scripted delivery lists, raising any exception in
    the script at its place."""

    def __init__(self, script: list[Any]) -> None:
        self.script = list(script)

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Ref:
        await asyncio.sleep(0)
        if not self.script:
            raise StopAsyncIteration
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return Ref(item)


class Method:
    def __init__(self, call: Callable[..., Any]) -> None:
        self.remote = call


class Actor:
    """A replica whose stream calls follow `scripts`, one each, in turn."""

    def __init__(self, *scripts: list[Any], pid: Any = 100) -> None:
        self.calls = 0
        self.cancelled: list[str] = []
        self.stream = Method(self._stream)
        self.cancel = Method(self.cancelled.append)
        self.pid = Method(lambda: Ref(pid))
        self._scripts = list(scripts)

    def _stream(self, request_id: str, prompts: Any, configs: Any, n: int) -> Stream:
        self.calls += 1
        return Stream(self._scripts.pop(0))


class Replicas:
    def __init__(self, *actors: Actor) -> None:
        self.actors = list(actors)
        self.infos = [
            ReplicaInfo(i, 100, 64, EngineShape(max_session_tokens=256), None, "tiny", 1)
            for i in range(len(actors))
        ]
        self.info = self.infos[0]
        self.cluster = type("Cluster", (), {"ray": ray})()

    def __len__(self) -> int:
        return len(self.actors)


def run(backend_test: Callable[[ReplicaBackend], Awaitable[None]], *actors: Actor) -> None:
    asyncio.run(backend_test(ReplicaBackend(Replicas(*actors))))  # type: ignore[arg-type]


async def follow(choices: list[Choice]) -> list[list[GenerationUpdate]]:
    """Every choice's updates, once the backend has settled the request."""

    async def updates(choice: Choice) -> list[GenerationUpdate]:
        return [update async for update in choice.handle.stream()]

    streams = await asyncio.wait_for(asyncio.gather(*(updates(c) for c in choices)), 5)
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    await asyncio.wait_for(asyncio.gather(*others), 5)
    return streams


def test_a_replica_failing_before_streaming_is_retried_once_on_another() -> None:
    first, second = Actor([died()]), Actor(WHOLE)

    async def check(backend: ReplicaBackend) -> None:
        choices = await backend.start(PLAN)
        streams = await follow(choices)
        assert [[u.tokens for u in s] for s in streams] == [[(5,), (7,)], [(6,), (8,)]]
        assert streams[0][-1].finish_reason is FinishReason.TOKEN_LIMIT
        assert choices[1].handle.metrics().cached_tokens == 8
        assert (first.calls, second.calls) == (1, 1)
        assert backend.retries[0] == 1 and not backend.failures
        assert backend.down() == {0} and backend.router.load == [0, 0]

    run(check, first, second)


def test_a_replica_failing_mid_stream_fails_its_request_naming_it() -> None:
    first, second = Actor([WHOLE[0], died()]), Actor(WHOLE)

    async def check(backend: ReplicaBackend) -> None:
        streams = await follow(await backend.start(PLAN))
        for stream in streams:
            assert stream[0].tokens and stream[-1].finish_reason is FinishReason.FAILED
            assert "replica 0 failed during the request" in stream[-1].error
        assert second.calls == 0 and backend.failures[0] == 1 and not backend.retries

    run(check, first, second)


def test_two_failures_end_the_request_without_hanging() -> None:
    first, second = Actor([died()]), Actor([died()])

    async def check(backend: ReplicaBackend) -> None:
        streams = await follow(await backend.start(PLAN))
        assert all(s[-1].finish_reason is FinishReason.FAILED for s in streams)
        assert "replica 1" in streams[0][-1].error
        assert backend.retries[0] == 1 and backend.failures[1] == 1
        assert backend.down() == {0, 1}

    run(check, first, second)


def test_a_single_replica_is_tried_again_itself() -> None:
    only = Actor([died()], WHOLE)  # Ray brought it back for the second call

    async def check(backend: ReplicaBackend) -> None:
        streams = await follow(await backend.start(PLAN))
        assert streams[0][-1].finish_reason is FinishReason.TOKEN_LIMIT
        assert only.calls == 2 and backend.down() == set()

    run(check, only)


def test_cancelling_a_choice_cancels_its_request_on_the_replica() -> None:
    actor = Actor([[token(0, 5)], [token(0, 6, final=True), token(1, 7, final=True)]])

    async def check(backend: ReplicaBackend) -> None:
        choices = await backend.start(PLAN)
        choices[0].handle.cancel()  # before the stream even started
        choices[1].handle.cancel()
        await follow(choices)
        assert len(actor.cancelled) == 1

    run(check, actor)


def test_health_shows_replicas_down_and_restarted() -> None:
    first, second, third = Actor(pid=100), Actor(pid=died()), Actor(pid=321)

    async def check(backend: ReplicaBackend) -> None:
        serving, body = await backend.health()
        assert serving and body["status"] == "degraded"
        rows = body["replicas"]
        assert [r["status"] for r in rows] == ["ok", "unavailable", "ok"]  # type: ignore[index]
        assert [r["restarts"] for r in rows] == [0, 0, 1]  # type: ignore[index]
        assert rows[2]["pid"] == 321  # type: ignore[index]

    run(check, first, second, third)


def test_a_failed_replica_is_avoided_for_a_while_only(monkeypatch) -> None:
    backend = ReplicaBackend(Replicas(Actor(), Actor()))  # type: ignore[arg-type]
    backend.failed(1)
    assert backend.down() == {1}
    backend.answered(1)
    assert backend.down() == set()
    backend.failed(0)
    monkeypatch.setattr(replica_backend, "DOWN_S", 0.0)  # the time ran out
    assert backend.down() == set()
