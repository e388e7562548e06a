"""The replicas behind `cellbatch serve --replicas N`: the server's Backend over Ray.

Owns: each request's trip to a replica (chosen by `PrefixRouter`: prefix affinity,
then the least loaded), its updates passed on to the choices as they arrive, its
cancellation, and what a replica failure does to it; the replicas' health (a ping
each, noticing restarts by their new process id) and their figures for /metrics.
Promises: updates reach the service as soon as a replica sends them (no waiting to
fill anything); a request whose replica fails before anything of it was streamed is
started once more on another replica (or on the same one once Ray brought it back);
one whose replica fails later ends every unfinished choice `failed` with a message
naming the replica, which the app turns into an OpenAI error; other requests are
untouched and nothing waits forever on a dead replica (Ray fails the calls in flight
on an actor whose process died). Routing goes around a replica that failed, until it
answers again or `DOWN_S` have passed (Ray then holds new calls until it is back, or
fails them, and the request moves on). `/health` lists every replica (status, pid, requests running,
restarts seen); it serves while any replica answers. `/metrics` sums the engine
figures and labels each replica's, with its up/down, running requests, routing
decisions, retries, failures and restarts seen.
Never: plans requests or builds responses; restarts replicas itself (Ray does).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cellbatch.constraint import ConstraintCompiler
from cellbatch.distributed.replica import Delivery
from cellbatch.distributed.replicas import ReplicaSet
from cellbatch.distributed.routing import PrefixRouter
from cellbatch.engine.embedding import embedding_size
from cellbatch.generation_config import Constraint
from cellbatch.metrics import GenerationMetrics
from cellbatch.model.adapters import AdapterInfo
from cellbatch.server.api import Choice, Plan
from cellbatch.server.observability import EngineFiguresCollector
from cellbatch.types import FinishReason, GenerationUpdate, InvalidArgumentError, Token

# A replica that does not answer a ping (or a figures call) this fast is shown down.
PING_TIMEOUT_S = 2.0
# How long routing avoids a replica after a call to it failed, unless it answers first.
DOWN_S = 10.0


class ReplicaBackend:
    def __init__(self, replicas: ReplicaSet, router: PrefixRouter | None = None) -> None:
        info = replicas.info
        self.replicas = replicas
        self.tokenizer = info.tokenizer
        self.vocab_size = info.vocab_size
        self.shape = info.shape
        self.router = router or PrefixRouter(len(replicas))
        self.ray = replicas.cluster.ray
        self._pids = [replica.pid for replica in replicas.infos]
        self._failed_at: dict[int, float] = {}  # replica -> when a call to it last failed
        self.restarts: Counter[int] = Counter()
        self.retries: Counter[int] = Counter()  # requests moved off a failed replica
        self.failures: Counter[int] = Counter()  # requests ended by their replica's failure
        self._requests: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._constraints: ConstraintCompiler | None = None  # built on first use
        self._adapters = {adapter.name: adapter for adapter in info.adapters}

    def check_constraint(self, constraint: Constraint) -> None:
        """Compiled here with the replicas' tokenizer (each replica compiles it again for
        its own engine)."""
        if self._constraints is None and self.tokenizer is not None:
            self._constraints = ConstraintCompiler.for_tokenizer(
                self.tokenizer, self.vocab_size, self.tokenizer.stop_tokens
            )
        if self._constraints is None:
            raise InvalidArgumentError(
                "the served model has no tokenizer, so a constraint cannot be compiled for it"
            )
        self._constraints.check(constraint)

    def decode(self, tokens: Sequence[Token]) -> str:
        if self.tokenizer is None:
            return " ".join(str(token) for token in tokens)
        return self.tokenizer.decode(tokens)

    async def start(self, plan: Plan) -> list[Choice]:
        request = _RemoteRequest(self, plan)
        task = asyncio.create_task(request.run())
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)
        return [
            Choice(index, index // plan.n, handle) for index, handle in enumerate(request.handles)
        ]

    def embedding_size(self, dimensions: int | None) -> int:
        info = self.replicas.info
        return embedding_size(info.hidden_size, info.matryoshka_dimensions, dimensions)

    def embedding_sizes(self) -> tuple[int, tuple[int, ...] | None]:
        info = self.replicas.info
        return info.hidden_size, info.matryoshka_dimensions

    async def embed(
        self, prompts: Sequence[Sequence[Token]], pooling: str, priority: int
    ) -> list[GenerationUpdate]:
        """On the replica routing picks for the first prompt; once more elsewhere when
        that replica fails, then failed summaries naming it."""
        avoid: set[int] = set()
        for attempt in range(2):
            route = self.router.choose(prompts[0], down=self.down() | avoid)
            self.router.started(route, prompts[0], len(prompts))
            try:
                actor = self.replicas.actors[route.replica]
                summaries: list[GenerationUpdate] = await actor.embed.remote(
                    list(prompts), pooling, priority
                )
                self.answered(route.replica)
                return summaries
            except self.ray.exceptions.RayActorError as error:
                self.failed(route.replica)
                avoid.add(route.replica)
                if attempt == 1:
                    self.failures[route.replica] += 1
                    message = f"replica {route.replica} failed during the request ({error})"
                    return [GenerationUpdate((), FinishReason.FAILED, message) for _ in prompts]
                self.retries[route.replica] += 1
            finally:
                self.router.ended(route.replica, len(prompts))
        raise AssertionError("unreachable: the second attempt returns")

    async def health(self) -> tuple[bool, dict[str, object]]:
        if self._closed:
            return False, {"status": "stopping"}
        pids = await asyncio.gather(*(self._ping(r) for r in range(len(self.replicas))))
        replicas = [
            {
                "replica": r,
                "status": "ok" if pid is not None else "unavailable",
                "pid": self._pids[r],
                "requests_running": self.router.load[r],
                "restarts": self.restarts[r],
            }
            for r, pid in enumerate(pids)
        ]
        up = sum(pid is not None for pid in pids)
        status = "ok" if up == len(pids) else "degraded" if up else "unavailable"
        return up > 0, {"status": status, "replicas": replicas}

    def adapters(self) -> list[AdapterInfo]:
        return list(self._adapters.values())

    async def load_adapter(self, name: str, path: str) -> None:
        """On every replica, or on none: one that refuses it unloads it from the others.
        (A replica that Ray restarts comes back with the adapters it was started with.)"""
        calls = [actor.load_adapter.remote(name, path) for actor in self.replicas.actors]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failed:
            loaded = [
                actor
                for actor, outcome in zip(self.replicas.actors, outcomes, strict=True)
                if not isinstance(outcome, BaseException)
            ]
            await asyncio.gather(
                *(actor.unload_adapter.remote(name) for actor in loaded), return_exceptions=True
            )
            raise InvalidArgumentError(_cause(failed[0]))
        self._adapters[name] = cast("AdapterInfo", outcomes[0])  # none failed

    async def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise InvalidArgumentError(f"no LoRA adapter named {name!r} is loaded")
        del self._adapters[name]
        calls = [actor.unload_adapter.remote(name) for actor in self.replicas.actors]
        await asyncio.gather(*calls, return_exceptions=True)

    def collector(self) -> Collector:
        return _ReplicaCollector(self)

    def stopping(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        self.replicas.close()

    # -- replica state ---------------------------------------------------------------

    async def _ping(self, replica: int) -> int | None:
        call = self.replicas.actors[replica].pid.remote()
        try:
            pid = await asyncio.wait_for(asyncio.wrap_future(call.future()), PING_TIMEOUT_S)
        except (asyncio.TimeoutError, self.ray.exceptions.RayError):
            return None
        self.answered(replica, pid)
        return int(pid)

    def answered(self, replica: int, pid: int | None = None) -> None:
        """The replica works (as process `pid`, when known)."""
        self._failed_at.pop(replica, None)
        if pid is not None and pid != self._pids[replica]:
            self._pids[replica] = pid
            self.restarts[replica] += 1
            self.router.forget(replica)  # a new process: its prefix cache is empty

    def down(self) -> set[int]:
        """The replicas routing avoids now."""
        since = time.monotonic() - DOWN_S
        return {replica for replica, when in self._failed_at.items() if when > since}

    def failed(self, replica: int) -> None:
        self._failed_at[replica] = time.monotonic()
        self.router.forget(replica)


class _RemoteHandle:
    """One choice of a request on a replica, as `ChoiceHandle`. Cancelling a choice
    cancels its whole request (the server only ever cancels requests whole)."""

    def __init__(self, request: _RemoteRequest) -> None:
        self._request = request
        self._updates: asyncio.Queue[GenerationUpdate] = asyncio.Queue()
        self._metrics = GenerationMetrics()
        self.finished = False

    def deliver(self, update: GenerationUpdate, metrics: GenerationMetrics | None) -> None:
        if self.finished:
            return
        self.finished = update.finish_reason is not None
        if metrics is not None:
            self._metrics = metrics
        self._updates.put_nowait(update)

    async def stream(self) -> AsyncIterator[GenerationUpdate]:
        while True:
            update = await self._updates.get()
            yield update
            if update.finish_reason is not None:
                return

    def cancel(self) -> None:
        self._request.cancel()

    def metrics(self) -> GenerationMetrics:
        return self._metrics


class _RemoteRequest:
    def __init__(self, backend: ReplicaBackend, plan: Plan) -> None:
        self.backend = backend
        self.plan = plan
        self.id = uuid.uuid4().hex
        self.handles = [_RemoteHandle(self) for _ in range(len(plan.prompts) * plan.n)]
        self.replica: int | None = None
        self.streamed = False
        self.cancelled = False

    async def run(self) -> None:
        backend, router = self.backend, self.backend.router
        prompt, weight = self.plan.prompts[0], len(self.handles)
        avoid: set[int] = set()
        completed = False
        try:
            for attempt in range(2):
                route = router.choose(prompt, down=backend.down() | avoid)
                router.started(route, prompt, weight)
                self.replica = route.replica
                try:
                    await self._follow(route.replica)
                    completed = True
                    return
                except backend.ray.exceptions.RayActorError as error:
                    backend.failed(route.replica)
                    if self.streamed or self.cancelled or attempt == 1:
                        backend.failures[route.replica] += 1
                        self._fail(f"replica {route.replica} failed during the request ({error})")
                        return
                    backend.retries[route.replica] += 1
                    avoid.add(route.replica)
                finally:
                    router.ended(route.replica, weight)
        except asyncio.CancelledError:
            self._fail("the server stopped before the request finished")
            raise
        except Exception as error:  # a replica's bug fails its request alone
            self._fail(f"replica {self.replica} could not serve the request: {error}")
        finally:
            if not completed:
                self.cancel()  # in case the replica still runs it
            self._fail(f"replica {self.replica} ended the request without its results")

    async def _follow(self, replica: int) -> None:
        actor = self.backend.replicas.actors[replica]
        plan = self.plan
        stream = actor.stream.remote(self.id, plan.prompts, plan.configs, plan.n)
        if self.cancelled:
            actor.cancel.remote(self.id)
        async for ref in stream:
            deliveries: list[Delivery] = await ref
            self.streamed = True
            for delivery in deliveries:
                self.handles[delivery.choice].deliver(delivery.update, delivery.metrics)
        self.backend.answered(replica)

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        if self.replica is not None:
            self.backend.replicas.actors[self.replica].cancel.remote(self.id)

    def _fail(self, message: str) -> None:
        for handle in self.handles:
            handle.deliver(GenerationUpdate((), FinishReason.FAILED, message), None)


class _ReplicaCollector(Collector):
    """The replicas' figures, read at scrape time (from /metrics' worker thread)."""

    def __init__(self, backend: ReplicaBackend) -> None:
        self._backend = backend

    def collect(self) -> Iterator[Metric]:
        backend = self._backend
        ray = backend.ray
        calls = [actor.figures.remote() for actor in backend.replicas.actors]
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=PING_TIMEOUT_S)
        figures: dict[str, dict[str, float]] = {}
        for replica, call in enumerate(calls):
            if call in ready:
                with contextlib.suppress(ray.exceptions.RayError):
                    figures[str(replica)] = ray.get(call)
        method = backend.replicas.infos[0].speculative if backend.replicas.infos else None
        yield from EngineFiguresCollector(lambda: figures, method).collect()
        replicas = [str(r) for r in range(len(calls))]
        up = GaugeMetricFamily(
            "cellbatch_replica_up", "1 if the replica answered this scrape.", labels=["replica"]
        )
        running = GaugeMetricFamily(
            "cellbatch_replica_requests_running",
            "Generations routed to the replica and not ended.",
            labels=["replica"],
        )
        routed = CounterMetricFamily(
            "cellbatch_replica_routed_requests",
            "Requests sent to the replica, by why it was chosen.",
            labels=["replica", "reason"],
        )
        moved = CounterMetricFamily(
            "cellbatch_replica_retried_requests",
            "Requests started again elsewhere after the replica failed before streaming.",
            labels=["replica"],
        )
        failed = CounterMetricFamily(
            "cellbatch_replica_failed_requests",
            "Requests ended with an error because the replica failed while streaming.",
            labels=["replica"],
        )
        restarts = CounterMetricFamily(
            "cellbatch_replica_restarts",
            "Times the server found the replica in a new process.",
            labels=["replica"],
        )
        for r, name in enumerate(replicas):
            up.add_metric([name], 1.0 if name in figures else 0.0)
            running.add_metric([name], backend.router.load[r])
            moved.add_metric([name], backend.retries[r])
            failed.add_metric([name], backend.failures[r])
            restarts.add_metric([name], backend.restarts[r])
        for (r, reason), count in list(backend.router.routed.items()):
            routed.add_metric([str(r), reason], count)
        yield from (up, running, routed, moved, failed, restarts)


def _cause(error: BaseException) -> str:
    """A replica's error as its last line says it (Ray wraps it in its traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else repr(error)
