"""Requests running on the engine: their generations, as they stream, until they end.

Owns: starting a plan's generations on the backend (one engine, or replicas: see
`backend`), following them as they stream; the set of live requests (to cancel them
on disconnect or shutdown), the queue limit, and the per-request timing the metrics
observe.
Promises: a request that ends early (its client left, the server stops) cancels its
generations within a step; the streamed text is the runner's incremental text: no
split characters and no part of a stop string, ever.
Never: plans requests (the planner does), parses HTTP or frames events (the app does).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from cellbatch.server.api import FINISH_REASONS, ApiError, Backend, Choice, Plan
from cellbatch.server.observability import ServerMetrics
from cellbatch.types import GenerationUpdate


@dataclass(eq=False)
class Job:
    """A running request: its choices and how they are going (compared by identity)."""

    plan: Plan
    choices: list[Choice]
    arrival: float
    first_token: float | None = None

    def cancel(self) -> None:
        for choice in self.choices:
            choice.handle.cancel()


class EngineService:
    def __init__(
        self,
        backend: Backend,
        served_model_name: str,
        metrics: ServerMetrics,
        max_queued_requests: int,
    ) -> None:
        self.backend = backend
        self.model_name = served_model_name
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self._live: set[Job] = set()
        self._queued = 0  # requests whose generations have not produced a token yet

    def admit(self) -> None:
        """Refuse a new request when too many wait already."""
        if self._queued >= self.max_queued_requests:
            raise ApiError(
                429,
                f"{self._queued} requests are waiting to start; retry shortly",
                kind="rate_limit_error",
                code="too_many_requests",
            )

    async def start(self, plan: Plan) -> Job:
        """Start every generation of the plan on the backend."""
        arrival = time.perf_counter()
        self._queued += 1
        try:
            choices = await self.backend.start(plan)
        except Exception:
            self._queued -= 1
            raise
        request = Job(plan, choices, arrival)
        self._live.add(request)
        return request

    async def follow(self, request: Job) -> AsyncIterator[tuple[Choice, GenerationUpdate]]:
        """Each choice's updates as they come (choices interleaved), then the end."""
        queue: asyncio.Queue[tuple[Choice, GenerationUpdate] | None] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            async for update in choice.handle.stream():
                await queue.put((choice, update))
            await queue.put(None)

        tasks = [asyncio.create_task(pump(choice)) for choice in request.choices]
        last = request.arrival
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                choice, update = item
                record_update(choice, update)
                if update.tokens:
                    now = time.perf_counter()
                    if request.first_token is None:
                        request.first_token = now
                        self._queued -= 1
                        self.metrics.ttft.observe(now - request.arrival)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                yield choice, update
        finally:
            for task in tasks:
                task.cancel()
            request.cancel()  # a no-op for settled generations

    def finish(self, request: Job, endpoint: str) -> None:
        """Account for a request that ended (whatever way)."""
        if request in self._live:
            self._live.discard(request)
            if request.first_token is None:
                self._queued -= 1
            reasons = {choice.finish_reason for choice in request.choices}
            for reason in reasons:
                label = FINISH_REASONS.get(reason, "error") if reason else "abort"
                self.metrics.requests.labels(endpoint=endpoint, finish_reason=label).inc()
            self.metrics.e2e.observe(time.perf_counter() - request.arrival)

    def cancel_all(self) -> None:
        for request in list(self._live):
            request.cancel()

    def load(self) -> tuple[int, int]:
        """(requests generating, requests waiting for their first token)."""
        return len(self._live) - self._queued, self._queued


def record_update(choice: Choice, update: GenerationUpdate) -> None:
    """What an update adds to its choice: tokens, text, logprobs, the finish."""
    choice.tokens.extend(update.tokens)
    choice.text.append(update.text)
    choice.logprobs.extend(update.logprobs)
    if update.prompt_logprobs:
        choice.prompt_logprobs = update.prompt_logprobs
    if update.finish_reason is not None:
        choice.finish_reason, choice.error = update.finish_reason, update.error


async def until_disconnected(
    work: asyncio.Future[Any], disconnected: Callable[[], object], every: float = 0.1
) -> bool:
    """Wait for `work`; True if the client left first (then `work` is left running)."""
    while not work.done():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(work), every)
        if not work.done() and await disconnected():  # type: ignore[misc]
            return True
    return False
