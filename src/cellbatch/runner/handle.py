"""GenerationHandle: a caller's view of one generation, for threads and asyncio.

Owns: what has been published of one generation (tokens, their logprobs, prompt
logprobs, text, a pooling generation's embedding, outcome) and the listeners waiting
on it.
Promises: thread-safe; the outcome is published before `wait()` returns, before
listeners run and before `on_settled`; `await handle` and `result_async()` suspend
until the generation settles (never just until its next update); `stream()` yields
each update's tokens, logprobs and text once, merged when the reader is slower (the
logprobs stay aligned with the tokens), and the prompt logprobs once, with the first
tokens.
Never: touches engine state or knows the inbox; `cancel()` calls the canceller it
was bound with (which posts the command).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any, Protocol

from cellbatch.metrics import GenerationMetrics
from cellbatch.types import FinishReason, GenerationUpdate, Token, TokenLogprob


class Observed(Protocol):
    """What a handle reads and flags of its generation (a `Generation` is one; the
    handle module sits below it, so it names only this)."""

    metrics: GenerationMetrics
    cancel_requested: bool


class GenerationHandle:
    """One generation's tokens, text and outcome. A default-constructed handle is
    bound to no generation (`valid()` is False)."""

    def __init__(self) -> None:
        self._generation: Observed | None = None
        self._post_cancel: Callable[[], object] | None = None
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._tokens: list[Token] = []
        self._logprobs: list[TokenLogprob] = []
        self._prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
        self._embedding: tuple[float, ...] = ()
        self._text: list[str] = []
        self._reason: FinishReason | None = None
        self._error = ""
        self._listeners: list[Callable[[], None]] = []

    def _bind(self, generation: Observed, post_cancel: Callable[[], object] | None) -> None:
        """Tie the handle to its generation; `post_cancel` asks the engine to end it
        (None: it is settled already, or never runs)."""
        self._generation, self._post_cancel = generation, post_cancel

    def valid(self) -> bool:
        return self._generation is not None

    def cancel(self) -> None:
        """End the generation `cancelled` within one step; a no-op once it settled."""
        generation = self._generation
        if generation is None or self._post_cancel is None or self._settled.is_set():
            return
        # The flag reaches a step already under way; the command ends the generation
        # between steps even if nothing of it is in flight.
        generation.cancel_requested = True
        self._post_cancel()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the generation has settled; False if `timeout` ran out first."""
        self._require_bound()
        return self._settled.wait(timeout)

    def done(self) -> bool:
        return self._settled.is_set()

    def finish_reason(self) -> FinishReason | None:
        return self._reason

    def error(self) -> str:
        return self._error

    def tokens(self) -> list[Token]:
        """Every token delivered so far, in order."""
        with self._lock:
            return list(self._tokens)

    def logprobs(self) -> list[TokenLogprob]:
        """The delivered tokens' logprobs, aligned with `tokens()` (empty unless the
        generation's sampling params ask for logprobs)."""
        with self._lock:
            return list(self._logprobs)

    def prompt_logprobs(self) -> list[TokenLogprob | None]:
        """The prompt logprobs (see `Output.prompt_logprobs`); empty until the first
        tokens arrive, or when not asked."""
        with self._lock:
            return list(self._prompt_logprobs)

    def text(self) -> str:
        """The text released so far (empty for a runner without a tokenizer)."""
        with self._lock:
            return "".join(self._text)

    def metrics(self) -> GenerationMetrics:
        """A copy of the generation's counters (final once settled)."""
        generation = self._generation
        if generation is None:
            return GenerationMetrics()
        return dataclasses.replace(generation.metrics)

    def result(self, timeout: float | None = None) -> GenerationUpdate:
        """Wait, then sum the generation up as one update: tokens, reason, error, text,
        logprobs, prompt logprobs and (a pooling generation's) embedding."""
        if not self.wait(timeout):
            raise TimeoutError(f"the generation did not settle within {timeout} s")
        return self._summary()

    async def result_async(self) -> GenerationUpdate:
        """`result()` for asyncio: suspends until the generation settles."""
        self._require_bound()
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        wake = _threadsafe_waker(loop, changed.set)
        self._add_listener(wake)
        try:
            # A listener runs on every update; only settlement ends the wait.
            while not self._settled.is_set():
                await changed.wait()
                changed.clear()
        finally:
            self._remove_listener(wake)
        return self._summary()

    def __await__(self) -> Generator[Any, None, GenerationUpdate]:
        return self.result_async().__await__()

    async def stream(self) -> AsyncIterator[GenerationUpdate]:
        """The updates as they come, for asyncio. Updates that arrive between two
        reads are merged; the last one carries the finish reason. Starting late is
        fine: the first update then holds everything delivered so far."""
        self._require_bound()
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        wake = _threadsafe_waker(loop, changed.set)
        self._add_listener(wake)
        sent_tokens = sent_texts = sent_logprobs = 0
        sent_prompt = False
        try:
            while True:
                # Cleared before reading: a publish after the read sets it again.
                changed.clear()
                with self._lock:
                    tokens = tuple(self._tokens[sent_tokens:])
                    text = "".join(self._text[sent_texts:])
                    logprobs = tuple(self._logprobs[sent_logprobs:])
                    prompt = () if sent_prompt else self._prompt_logprobs
                    sent_tokens, sent_texts = len(self._tokens), len(self._text)
                    sent_logprobs = len(self._logprobs)
                    sent_prompt = sent_prompt or bool(prompt)
                    reason, error, embedding = self._reason, self._error, self._embedding
                if reason is not None:
                    yield GenerationUpdate(tokens, reason, error, text, logprobs, prompt, embedding)
                    return
                if tokens or text:
                    yield GenerationUpdate(
                        tokens, text=text, logprobs=logprobs, prompt_logprobs=prompt
                    )
                await changed.wait()
        finally:
            self._remove_listener(wake)

    def _summary(self) -> GenerationUpdate:
        with self._lock:
            return GenerationUpdate(
                tuple(self._tokens),
                self._reason,
                self._error,
                "".join(self._text),
                tuple(self._logprobs),
                self._prompt_logprobs,
                self._embedding,
            )

    def _require_bound(self) -> None:
        if self._generation is None:
            raise RuntimeError(
                "this GenerationHandle is not bound to a generation; "
                "get one from Session.generate_async() or Runner.submit()"
            )

    def _add_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def _remove_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def _publish(self, update: GenerationUpdate) -> None:
        """Engine side: record an update's tokens, logprobs and text and, last of all,
        its outcome (when it carries a finish reason)."""
        with self._lock:
            self._tokens.extend(update.tokens)
            self._logprobs.extend(update.logprobs)
            if update.prompt_logprobs:
                self._prompt_logprobs = update.prompt_logprobs
            if update.embedding:
                self._embedding = update.embedding
            if update.text:
                self._text.append(update.text)
            if update.finish_reason is not None:
                self._reason, self._error = update.finish_reason, update.error
            listeners = list(self._listeners)
        if update.finish_reason is not None:
            self._settled.set()
        for listener in listeners:
            listener()


def _threadsafe_waker(
    loop: asyncio.AbstractEventLoop, callback: Callable[[], None]
) -> Callable[[], None]:
    """A function any thread may call to run `callback` on `loop`."""

    def wake() -> None:
        # A closed loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback)

    return wake
