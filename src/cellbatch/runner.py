"""The runner: one engine thread drives sessions, a scheduler and an executor (DESIGN §5).

Owns: the engine thread and everything it touches (the executor, the consuming
side of the scheduler, each session's committed length and pending tokens, every
live generation), and the faces other threads hold: `Runner`, `Session`,
`GenerationHandle`.
Promises: commands from any thread (open, clone, start, cancel, close) reach the
engine through one FIFO inbox and run between forwards; every generation settles
exactly once, its outcome published before waiters wake and before `on_settled`;
once a generation has started, ending it by any route leaves its session's
context = what it held before + the delta + exactly the tokens delivered; an
executor failure poisons only the sessions of the failed batch; a shortage of KV
cells defers new generations (admission control) rather than failing work in
flight.
Never: raises on the engine thread because of a caller or an executor (errors
become `failed` generations), blocks a caller that closes a session, or runs two
forwards at once.

Admission control: when `executor.free_cells()` is not None, a generation starts
only when its worst case (tokens it feeds + max_new_tokens) fits in the free cells
less what running generations may still claim; others wait in arrival order.
Only a running generation can free cells by itself, so a generation that does not
fit while none runs fails at once with the reason (close idle sessions or ask
for fewer tokens) instead of waiting for something that may never happen.

A prefill turn (`Session.prefill_async`) feeds its delta and settles `length` with
no tokens once the model has consumed it (to build a shared prefix to clone, say).
Engine metrics count it under `prefill_turns`, not as a generation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import enum
import itertools
import logging
import operator
import queue
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from time import perf_counter
from typing import Any

from cellbatch.executor import Executor
from cellbatch.metrics import EngineMetrics, GenerationMetrics
from cellbatch.scheduler import DecodeFirstScheduler, Scheduler
from cellbatch.types import (
    MAX_POSITION,
    BatchInput,
    FinishReason,
    GenConfig,
    GenerationUpdate,
    Input,
    InvalidArgumentError,
    Output,
    SessionId,
    Task,
    TaskId,
    Token,
)

log = logging.getLogger(__name__)

UpdateCallback = Callable[[GenerationUpdate], None]
SettledCallback = Callable[["GenerationHandle"], None]

# An idle engine looks again after this long even without a command (commands wake it at once).
_IDLE_WAIT_S = 0.1

_EXECUTOR_METHODS = (
    "initialize",
    "open_session",
    "close_session",
    "clone",
    "set_sampling",
    "preferred_batch_tokens",
    "execute",
    "free_cells",
)

# Inbox command kinds; a command is a tuple (kind, *arguments).
_OPEN = "open"
_CLONE = "clone"
_START = "start"
_CANCEL = "cancel"
_CLOSE = "close"
_WAKE = "wake"


class InitializationState(str, enum.Enum):
    INITIALIZING = "initializing"
    READY = "ready"
    FAILED = "failed"


class GenerationHandle:
    """A caller's view of one generation. Thread-safe; also awaitable from asyncio.

    A default-constructed handle is bound to no generation (`valid()` is False).
    The outcome (finish reason, error, tokens, metrics) is published before
    `wait()` returns and before `on_settled` runs.
    """

    def __init__(self) -> None:
        self._gen: _Generation | None = None
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._tokens: list[Token] = []
        self._reason: FinishReason | None = None
        self._error = ""
        self._listeners: list[Callable[[], None]] = []

    def valid(self) -> bool:
        return self._gen is not None

    def cancel(self) -> None:
        """End the generation `cancelled` within one step; a no-op once it settled."""
        gen = self._gen
        if gen is None or gen.runner is None or self._settled.is_set():
            return
        gen.cancel_requested = True
        gen.runner._post((_CANCEL, gen))

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

    def metrics(self) -> GenerationMetrics:
        """A copy of the generation's counters (final once settled)."""
        gen = self._gen
        return dataclasses.replace(gen.metrics) if gen is not None else GenerationMetrics()

    def result(self, timeout: float | None = None) -> GenerationUpdate:
        """Wait, then sum the generation up as one update: every token, reason, error."""
        if not self.wait(timeout):
            raise TimeoutError(f"the generation did not settle within {timeout} s")
        with self._lock:
            return GenerationUpdate(tuple(self._tokens), self._reason, self._error)

    async def result_async(self) -> GenerationUpdate:
        """`result()` for asyncio: suspends instead of blocking the event loop."""
        self._require_bound()
        loop = asyncio.get_running_loop()
        settled = loop.create_future()

        def resolve() -> None:
            if not settled.done():
                settled.set_result(None)

        wake = _threadsafe_waker(loop, resolve)
        self._add_listener(wake)
        try:
            if not self._settled.is_set():
                await settled
        finally:
            self._remove_listener(wake)
        return self.result(0)

    def __await__(self) -> Generator[Any, None, GenerationUpdate]:
        return self.result_async().__await__()

    async def stream(self) -> AsyncIterator[GenerationUpdate]:
        """The updates as they come, for asyncio. Updates that arrive between two
        reads are merged; the last one carries the finish reason. Starting late is
        fine: the first update then holds every token delivered so far."""
        self._require_bound()
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        wake = _threadsafe_waker(loop, changed.set)
        self._add_listener(wake)
        sent = 0
        try:
            while True:
                # Cleared before reading: a publish after the read sets it again.
                changed.clear()
                with self._lock:
                    fresh = tuple(self._tokens[sent:])
                    reason, error = self._reason, self._error
                sent += len(fresh)
                if reason is not None:
                    yield GenerationUpdate(fresh, reason, error)
                    return
                if fresh:
                    yield GenerationUpdate(fresh)
                await changed.wait()
        finally:
            self._remove_listener(wake)

    def _require_bound(self) -> None:
        if self._gen is None:
            raise RuntimeError(
                "this GenerationHandle is not bound to a generation; "
                "get one from Session.generate_async()"
            )

    def _add_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def _remove_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def _publish(
        self, tokens: Sequence[Token], reason: FinishReason | None = None, error: str = ""
    ) -> None:
        """Engine side: record delivered tokens and, last of all, the outcome."""
        with self._lock:
            self._tokens.extend(tokens)
            if reason is not None:
                self._reason, self._error = reason, error
            listeners = list(self._listeners) if self._listeners else ()
        if reason is not None:
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


class _SessionState:
    """Engine-side truth about one session. Written only by the engine thread;
    other threads read `position` and `carry` (each assignment is atomic)."""

    __slots__ = ("active", "carry", "closed", "poisoned", "position", "sid")

    def __init__(self, sid: SessionId, position: int = 0) -> None:
        self.sid = sid
        self.position = position  # committed: tokens the executor holds for us
        # In the context but not fed yet: the last generated token, or the unfed
        # rest of a turn that ended early. The next turn feeds them first.
        self.carry: tuple[Token, ...] = ()
        self.active: _Generation | None = None
        self.poisoned = ""  # why, once an executor failure hit this session
        self.closed = False


class _Generation:
    """Engine-side state of one generation (engine thread only, except the
    `cancel_requested` flag, which any thread may raise)."""

    __slots__ = (
        "cancel_requested",
        "config",
        "deferred",
        "delta",
        "ended",
        "fed",
        "feed",
        "feed_only",
        "handle",
        "input_error",
        "last_step",
        "metrics",
        "on_settled",
        "on_update",
        "pending",
        "reserved",
        "runner",
        "started",
        "state",
    )

    def __init__(
        self,
        runner: Runner | None,
        state: _SessionState | None,
        config: GenConfig,
        on_update: UpdateCallback | None,
        on_settled: SettledCallback | None,
        feed_only: bool = False,
    ) -> None:
        self.runner = runner
        self.state = state
        self.config = config
        self.feed_only = feed_only  # a prefill turn: feed the delta, generate nothing
        self.on_update = on_update
        self.on_settled = on_settled
        self.handle = GenerationHandle()
        self.handle._gen = self
        self.metrics = GenerationMetrics(submit_time=perf_counter())
        self.delta: tuple[Token, ...] = ()
        self.input_error = ""
        self.feed: tuple[Token, ...] = ()  # carry + delta, fixed when the generation starts
        self.fed = 0  # how many of `feed` are committed
        self.pending: tuple[Token, ...] = ()  # the last generated token, not fed yet
        self.reserved = 0  # KV cells this generation may still claim (admission control)
        self.deferred = False  # it once had to wait for cells
        self.last_step = -1
        self.cancel_requested = False
        self.started = False
        self.ended = False

    def emit(self, update: GenerationUpdate) -> str:
        """Deliver a non-final update; returns why on_update failed, or ""."""
        failure = self._call_on_update(update)
        self.handle._publish(update.tokens)
        return failure

    def settle(self, reason: FinishReason, error: str, tokens: tuple[Token, ...]) -> FinishReason:
        """Deliver the final update, publish the outcome, then run on_settled once.
        A raising on_update turns the outcome into `failed`. Returns the outcome."""
        failure = self._call_on_update(GenerationUpdate(tokens, reason, error))
        if failure:
            reason, error = FinishReason.FAILED, failure
        self.on_update = None
        self.metrics.end_time = perf_counter()
        self.handle._publish(tokens, reason, error)
        # Dropped before the call so that its captures die with this frame.
        on_settled, self.on_settled = self.on_settled, None
        if on_settled is not None:
            try:
                on_settled(self.handle)
            except Exception:
                log.exception("on_settled raised after the generation had settled")
        return reason

    def _call_on_update(self, update: GenerationUpdate) -> str:
        if self.on_update is None:
            return ""
        try:
            self.on_update(update)
        except Exception as exc:
            self.on_update = None  # a callback that raised is never called again
            return f"on_update raised {exc!r}; the generation was stopped"
        return ""


def _read_delta(delta: Sequence[Token], config: GenConfig) -> tuple[tuple[Token, ...], str]:
    """The delta as a tuple of token ids, or () and why it cannot run. Checks only
    what does not depend on the session; lengths first, so that a huge delta is
    refused without being copied."""
    max_new = config.max_new_tokens
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new <= 0:
        return (), f"max_new_tokens must be a positive integer, got {max_new!r}"
    try:
        size = len(delta)
    except TypeError:
        return (), f"delta must be a sequence of token ids, got {type(delta).__name__}"
    if size == 0:
        return (), "delta is empty: a turn must feed at least one new token"
    if size + max_new - 2 > MAX_POSITION:
        return (), _overflow_message(0, size, max_new)
    try:
        tokens = tuple(map(operator.index, delta))
    except TypeError:
        return (), "delta must hold integer token ids"
    lowest = min(tokens)
    if lowest < 0:
        return (), f"token ids must be >= 0; got {lowest} at index {tokens.index(lowest)}"
    return tokens, ""


def _overflow_message(context: int, feed: int, max_new: int) -> str:
    return (
        f"the turn overflows the position range: {context} tokens of context + {feed} to feed "
        f"+ max_new_tokens {max_new} would need positions up to "
        f"{context + feed + max_new - 2}, above {MAX_POSITION}; shorten the delta or lower "
        "max_new_tokens"
    )


class Session:
    """One conversation: its context persists across turns. Thread-safe.

    A default-constructed Session is not opened; get real ones from
    `Runner.open_session_async()` or `Session.clone_async()`. Closing (by
    `close()`, leaving a `with` block, or dropping the last reference) queues the
    close on the engine thread and never waits; the active generation then ends
    `cancelled`.
    """

    def __init__(self) -> None:
        self._runner: Runner | None = None
        self._state: _SessionState | None = None
        self._closer: weakref.finalize | None = None
        self._closed = False

    @classmethod
    def _bind(cls, runner: Runner, state: _SessionState) -> Session:
        session = cls()
        session._runner = runner
        session._state = state
        # The finalizer holds the runner and the state, never the Session itself.
        session._closer = weakref.finalize(session, runner._request_close, state)
        session._closer.atexit = False
        return session

    @property
    def id(self) -> SessionId | None:
        return None if self._state is None else self._state.sid

    def is_open(self) -> bool:
        return self._state is not None and not self._closed and not self._state.closed

    def position(self) -> int:
        """Committed context length: tokens the model has consumed for this session.
        The pending token (see `pending()`) is not counted."""
        return 0 if self._state is None else self._state.position

    def pending(self) -> tuple[Token, ...]:
        """Context tokens not fed to the model yet (usually the last generated
        token); the next turn feeds them before its delta."""
        return () if self._state is None else self._state.carry

    def generate_async(
        self,
        delta: Sequence[Token],
        config: GenConfig | None = None,
        on_update: UpdateCallback | None = None,
        on_settled: SettledCallback | None = None,
    ) -> GenerationHandle:
        """Start a turn: feed `delta` (after any pending tokens), then generate.

        `on_update(update)` and `on_settled(handle)` run on the engine thread; a
        raising on_update fails only this generation. Errors never raise here:
        they come back as a `failed` generation with a message. On a session
        that was never opened, or is closed, the handle settles before this
        returns (and the callbacks run on this thread).
        """
        config = config if config is not None else GenConfig()
        gen = _Generation(self._runner, self._state, config, on_update, on_settled)
        return self._start_turn(gen, delta)

    def prefill_async(
        self, delta: Sequence[Token], on_settled: SettledCallback | None = None
    ) -> GenerationHandle:
        """Start a prefill turn: feed `delta` (after any pending tokens) and generate
        nothing. The handle settles `length` with no tokens once the model has consumed
        the delta; then `position()` counts it and `clone_async` can share it. Errors
        come back as for `generate_async`."""
        # max_new_tokens=1 sizes the checks: the last position fed is that of the
        # delta's last token, as for a one-token generation.
        config = GenConfig(max_new_tokens=1)
        gen = _Generation(self._runner, self._state, config, None, on_settled, feed_only=True)
        return self._start_turn(gen, delta)

    def _start_turn(self, gen: _Generation, delta: Sequence[Token]) -> GenerationHandle:
        if self._state is None or self._runner is None:
            gen.settle(FinishReason.FAILED, "session is not initialized", ())
        elif self._closed or self._state.closed:
            gen.settle(FinishReason.CANCELLED, "session is closed", ())
        else:
            gen.delta, gen.input_error = _read_delta(delta, gen.config)
            if not self._runner._post((_START, gen)):
                gen.settle(*self._runner._closing_outcome, ())
        return gen.handle

    def clone_async(self, upto: int) -> concurrent.futures.Future[Session | None]:
        """A new idle session holding this one's committed prefix [0, upto), with
        no sampling policy. None when refused: upto < 0 or > position(), a
        poisoned or closed source, no clone support or no capacity. A clone
        queued before this session's close still runs."""
        future: concurrent.futures.Future[Session | None] = concurrent.futures.Future()
        if (
            self._runner is None
            or self._state is None
            or not self.is_open()
            or not isinstance(upto, int)
            or upto < 0
            or not self._runner._post((_CLONE, self._state, upto, future))
        ):
            future.set_result(None)
        return future

    def close(self) -> None:
        """Queue the close and return at once; idempotent."""
        self._closed = True
        if self._closer is not None:
            self._closer()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Runner:
    """Runs every generation of one executor on one engine thread.

    `Runner(executor, scheduler=None)` starts the engine thread at once; it
    initialises the executor first (see `initialization_state()`). Use it as a
    context manager, or call `shutdown()`.
    """

    def __init__(self, executor: Executor, scheduler: Scheduler | None = None) -> None:
        missing = [
            name for name in _EXECUTOR_METHODS if not callable(getattr(executor, name, None))
        ]
        if missing:
            raise InvalidArgumentError(
                f"{type(executor).__name__} lacks {', '.join(missing)}: a runner needs an "
                "executor implementing cellbatch.executor.Executor"
            )
        self._executor = executor
        self._scheduler: Scheduler = (
            scheduler if scheduler is not None else DecodeFirstScheduler.create()
        )
        self._chunk_size = self._scheduler.max_prefill_chunk_size
        # SimpleQueue because its put is reentrant: a Session's finalizer may post a
        # close at any moment, even in the middle of another put on the same thread.
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._post_lock = threading.RLock()  # reentrant for the same reason
        self._accepting = True
        self._closing_outcome = (FinishReason.CANCELLED, "the runner is shut down")
        self._stop_requested = False
        self._init_state = InitializationState.INITIALIZING
        self._init_error = ""
        self._initialized = threading.Event()
        self._metrics = EngineMetrics()
        self._metrics_lock = threading.Lock()
        # Engine-thread state. Invariant: a session is in _sessions iff it is open
        # on the executor; a generation is in _waiting or _running iff it is live.
        self._sessions: dict[SessionId, _SessionState] = {}
        self._waiting: deque[_Generation] = deque()
        self._running: set[_Generation] = set()
        self._reserved_cells = 0  # sum of `reserved` over _running
        self._task_owner: dict[TaskId, _Generation] = {}  # queued or in-flight tasks
        self._tids = itertools.count()
        self._step_index = 0
        self._thread = threading.Thread(target=self._run, name="cellbatch-engine", daemon=True)
        self._thread.start()

    # -- public, any thread ----------------------------------------------------

    def open_session_async(self) -> concurrent.futures.Future[Session | None]:
        """A new empty session, or None when the executor has no room (counted as
        refused) or the runner is not running."""
        future: concurrent.futures.Future[Session | None] = concurrent.futures.Future()
        if not self._post((_OPEN, future)):
            with self._metrics_lock:
                self._metrics.sessions_refused += 1
            future.set_result(None)
        return future

    def shutdown(self) -> None:
        """Cancel everything live, close every session once, stop the engine.
        Idempotent; from any thread. Waits for the full stop, except when called
        on the engine thread itself (from a callback), where it only asks."""
        self._stop_requested = True
        self._inbox.put((_WAKE,))
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def stopping(self) -> bool:
        """True once shutdown was asked for (or the engine stopped by itself)."""
        return self._stop_requested

    def initialization_state(self) -> InitializationState:
        return self._init_state

    def initialization_error(self) -> str:
        return self._init_error

    def wait_initialized(self, timeout: float | None = None) -> InitializationState:
        """Block until executor initialisation has finished (or `timeout` ran out)."""
        self._initialized.wait(timeout)
        return self._init_state

    def metrics(self) -> EngineMetrics:
        """A consistent copy of the engine counters."""
        with self._metrics_lock:
            return self._metrics.copy()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- inbox -------------------------------------------------------------------

    def _post(self, command: tuple[Any, ...]) -> bool:
        """Queue a command for the engine; False once the runner no longer takes any."""
        with self._post_lock:
            if not self._accepting:
                return False
            self._inbox.put(command)
            return True

    def _request_close(self, state: _SessionState) -> None:
        self._post((_CLOSE, state))

    # -- engine thread -------------------------------------------------------------

    def _run(self) -> None:
        outcome = (FinishReason.CANCELLED, "the runner is shut down")
        try:
            if self._initialize():
                self._loop()
            else:
                outcome = (FinishReason.FAILED, self._init_error)
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            log.exception("the cellbatch engine crashed; stopping")
            outcome = (FinishReason.FAILED, f"the engine crashed: {exc!r}")
        finally:
            self._stop(outcome)

    def _initialize(self) -> bool:
        start = perf_counter()
        try:
            self._executor.initialize()
        except Exception as exc:
            self._init_error = f"executor initialisation failed: {exc!r}"
            self._init_state = InitializationState.FAILED
            self._initialized.set()
            return False
        with self._metrics_lock:
            self._metrics.init_time = perf_counter() - start
        self._init_state = InitializationState.READY
        self._initialized.set()
        return True

    def _loop(self) -> None:
        while not self._stop_requested:
            self._drain_inbox()
            if self._stop_requested:
                return
            if self._waiting:
                self._admit()
            if self._step():
                continue
            try:
                command = self._inbox.get(timeout=_IDLE_WAIT_S)
            except queue.Empty:
                continue
            self._apply(command)
            # While idle, a done command must not keep its future (and a Session) alive.
            del command

    def _drain_inbox(self) -> None:
        # Only what is queued now: commands posted meanwhile wait one forward, so a
        # callback that keeps posting cannot starve the running generations.
        for _ in range(self._inbox.qsize()):
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._apply(command)

    def _apply(self, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == _START:
            self._start(command[1])
        elif kind == _CANCEL:
            gen = command[1]
            if not gen.ended:
                self._end(gen, FinishReason.CANCELLED, "cancelled by the caller")
        elif kind == _CLOSE:
            self._close(command[1])
        elif kind == _CLONE:
            self._clone(command[1], command[2], command[3])
        elif kind == _OPEN:
            self._open(command[1])

    def _open(self, future: concurrent.futures.Future[Session | None]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            sid = self._executor.open_session()
        except Exception as exc:
            future.set_exception(exc)
            return
        self._register(sid, 0, future)

    def _clone(
        self,
        source: _SessionState,
        upto: int,
        future: concurrent.futures.Future[Session | None],
    ) -> None:
        if not future.set_running_or_notify_cancel():
            return
        # The pending token and any speculative state beyond `position` are not committed.
        if source.closed or source.poisoned or upto > source.position:
            future.set_result(None)
            return
        try:
            sid = self._executor.clone(source.sid, upto)
        except Exception as exc:
            future.set_exception(exc)
            return
        self._register(sid, upto, future)

    def _register(
        self,
        sid: SessionId | None,
        position: int,
        future: concurrent.futures.Future[Session | None],
    ) -> None:
        with self._metrics_lock:
            if sid is None:
                self._metrics.sessions_refused += 1
            else:
                self._metrics.sessions_opened += 1
        if sid is None:
            future.set_result(None)
            return
        state = _SessionState(sid, position)
        self._sessions[sid] = state
        future.set_result(Session._bind(self, state))

    def _close(self, state: _SessionState) -> None:
        if state.closed:
            return
        state.closed = True
        if state.active is not None:
            self._end(state.active, FinishReason.CANCELLED, "the session was closed")
        self._sessions.pop(state.sid, None)
        try:
            self._executor.close_session(state.sid)
        except Exception:
            log.exception("executor.close_session(%d) raised", state.sid)

    def _start(self, gen: _Generation) -> None:
        state = gen.state
        assert state is not None  # unbound sessions never post
        self._count_start(gen)
        if gen.cancel_requested or state.closed:
            why = "cancelled by the caller" if gen.cancel_requested else "the session was closed"
            self._end(gen, FinishReason.CANCELLED, why)
            return
        error = gen.input_error or self._refusal(state, gen)
        if error:
            self._end(gen, FinishReason.FAILED, error)
            return
        state.active = gen  # waiting for cells already counts as active
        self._waiting.append(gen)

    def _count_start(self, gen: _Generation) -> None:
        with self._metrics_lock:
            if gen.feed_only:
                self._metrics.prefill_turns += 1
            else:
                self._metrics.generations_started += 1

    @staticmethod
    def _refusal(state: _SessionState, gen: _Generation) -> str:
        """Why the session cannot take this generation now, or ""."""
        if state.poisoned:
            return (
                f"session {state.sid} is poisoned by an earlier executor failure "
                f"({state.poisoned}); close it and open a new session"
            )
        if state.active is not None:
            return "the session already has an active generation; wait for it or cancel it"
        feed = len(state.carry) + len(gen.delta)
        if state.position + feed + gen.config.max_new_tokens - 2 > MAX_POSITION:
            return _overflow_message(state.position, feed, gen.config.max_new_tokens)
        return ""

    def _admit(self) -> None:
        """Start waiting generations in arrival order while their worst case fits."""
        free = self._free_cells()
        while self._waiting:
            gen = self._waiting[0]
            state = gen.state
            assert state is not None
            need = len(state.carry) + len(gen.delta) + gen.config.max_new_tokens
            if free is not None and need > free - self._reserved_cells:
                if self._running:
                    if not gen.deferred:
                        gen.deferred = True
                        with self._metrics_lock:
                            self._metrics.deferred_for_cells += 1
                    return  # running generations will release their reservations
                self._end(
                    gen,
                    FinishReason.FAILED,
                    f"not enough KV cells: this turn may need {need} (tokens to feed + "
                    f"max_new_tokens) but only {free} are free and no running generation "
                    "will release any; close idle sessions, shorten the prompt or lower "
                    "max_new_tokens",
                )
                continue
            self._waiting.popleft()
            self._begin(gen, need if free is not None else 0)

    def _free_cells(self) -> int | None:
        try:
            return self._executor.free_cells()
        except Exception:
            log.exception("executor.free_cells() raised; admitting without a cell limit")
            return None

    def _begin(self, gen: _Generation, reservation: int) -> None:
        state = gen.state
        assert state is not None
        # From here on the generation owns the unfed tokens; see _end for where they go.
        gen.feed = state.carry + gen.delta
        state.carry = ()
        gen.started = True
        gen.reserved = reservation
        self._reserved_cells += reservation
        self._running.add(gen)
        gen.metrics.prompt_tokens = len(gen.feed)
        with self._metrics_lock:
            self._metrics.prompt_tokens += len(gen.feed)
            self._metrics.peak_concurrent_generations = max(
                self._metrics.peak_concurrent_generations, len(self._running)
            )
        try:
            self._executor.set_sampling(state.sid, gen.config.sampling, gen.config.seed)
        except Exception as exc:
            self._end(gen, FinishReason.FAILED, f"executor.set_sampling raised {exc!r}")
            return
        # Every chunk has the same base position; only the last one asks for output,
        # unless this is a prefill turn.
        size, chunk = len(gen.feed), self._chunk_size
        tasks = [
            Task(
                next(self._tids),
                Input(
                    state.sid,
                    not gen.feed_only and offset + chunk >= size,
                    offset,
                    min(chunk, size - offset),
                    gen.feed,
                    state.position,
                ),
                is_decode=False,
            )
            for offset in range(0, size, chunk)
        ]
        self._submit([(gen, tasks)])

    def _submit(self, work: list[tuple[_Generation, list[Task]]]) -> None:
        """Queue each generation's tasks; a generation whose tasks the scheduler
        refuses ends `failed`. One call for the common case, one per generation to
        find the culprit when the scheduler refuses the lot."""
        everything = [task for _, tasks in work for task in tasks]
        if self._scheduler_accepts(everything):
            for gen, tasks in work:
                for task in tasks:
                    self._task_owner[task.tid] = gen
            return
        for gen, tasks in work:
            if len(work) > 1 and self._scheduler_accepts(tasks):
                for task in tasks:
                    self._task_owner[task.tid] = gen
            else:
                self._end(
                    gen,
                    FinishReason.FAILED,
                    f"the scheduler refused the generation's tasks ({len(tasks)} tasks, "
                    f"sizes {[task.input.size for task in tasks]}); this is a bug in the "
                    "runner or the scheduler's limits",
                )

    def _scheduler_accepts(self, tasks: list[Task]) -> bool:
        try:
            return self._scheduler.submit(tasks)
        except Exception:
            log.exception("scheduler.submit raised")
            return False

    def _step(self) -> bool:
        """Run one batch; False when there was no work."""
        tasks = self._scheduler.get_work()
        if not tasks:
            return False
        self._step_index += 1
        inputs = tuple(task.input for task in tasks)
        start = perf_counter()
        outputs, failure = self._execute(inputs)
        end = perf_counter()
        if self._stop_requested:
            return True  # shutdown discards what was in flight
        if failure:
            self._fail_batch(tasks, failure, start, end)
        else:
            self._finish_batch(tasks, outputs, start, end)
        return True

    def _execute(self, inputs: tuple[Input, ...]) -> tuple[Sequence[Output | None], str]:
        """The batch's outputs, or () and why the whole batch failed."""
        try:
            result = self._executor.execute(BatchInput(inputs))
        except Exception as exc:
            return (), f"executor.execute raised {exc!r}"
        if result is None:
            why = getattr(self._executor, "last_error", "")
            return (), "executor.execute failed" + (f": {why}" if why else "")
        outputs = getattr(result, "outputs", None)
        if not isinstance(outputs, (tuple, list)):
            return (), f"executor.execute returned {type(result).__name__}, not a BatchOutput"
        if len(outputs) != len(inputs):
            return (), f"the executor returned {len(outputs)} outputs for {len(inputs)} inputs"
        for i, (inp, out) in enumerate(zip(inputs, outputs, strict=True)):
            if out is None:
                if inp.produce_output:
                    return (), f"no output for input {i} (session {inp.sid}), which asked for one"
            elif not isinstance(out, Output):
                return (), f"output {i} is a {type(out).__name__}, not an Output"
            elif not inp.produce_output:
                return (), f"an output for input {i} (session {inp.sid}), which asked for none"
            elif out.sid != inp.sid:
                return (), f"output {i} names session {out.sid}, but input {i} is session {inp.sid}"
            elif not out.tokens:
                return (), f"output {i} (session {inp.sid}) holds no tokens"
        return outputs, ""

    def _fail_batch(self, tasks: list[Task], why: str, start: float, end: float) -> None:
        with self._metrics_lock:
            self._metrics.record_failed_step(start, end)
        failed: dict[_Generation, None] = {}  # ordered set
        for task in tasks:
            gen = self._task_owner.pop(task.tid, None)
            if gen is not None:
                failed[gen] = None
            state = self._sessions.get(task.sid)
            if state is not None and not state.poisoned:
                state.poisoned = why
        for gen in failed:
            self._end(gen, FinishReason.FAILED, f"the executor failed on this batch: {why}")

    def _finish_batch(
        self,
        tasks: list[Task],
        outputs: Sequence[Output | None],
        start: float,
        end: float,
    ) -> None:
        step = self._step_index
        decodes = prefill_tokens = generated = 0
        prefill_sids: set[SessionId] = set()
        context: dict[SessionId, int] = {}  # each session's length after the step
        next_decodes: list[tuple[_Generation, list[Task]]] = []
        for task, output in zip(tasks, outputs, strict=True):
            inp = task.input
            end_position = inp.position + inp.offset + inp.size
            context[inp.sid] = end_position
            if task.is_decode:
                decodes += 1
            else:
                prefill_tokens += inp.size
                prefill_sids.add(inp.sid)
            gen = self._task_owner.pop(task.tid, None)
            if gen is None or gen.ended:
                continue
            if gen.last_step != step:
                gen.last_step = step
                if gen.metrics.first_step_time is None:
                    gen.metrics.first_step_time = start
                if task.is_decode:
                    gen.metrics.decode_steps += 1
                else:
                    gen.metrics.prefill_steps += 1
            if gen.cancel_requested or self._stop_requested:
                # A consumed prompt chunk stays consumed; an output nobody will see is
                # not committed, so its input is fed again by the next turn.
                if output is None:
                    self._commit(gen, task, end_position)
                elif gen.cancel_requested:
                    self._end(gen, FinishReason.CANCELLED, "cancelled by the caller")
                continue
            self._commit(gen, task, end_position)
            if output is not None:
                generated += self._accept(gen, output.tokens, end, next_decodes)
            elif gen.feed_only and gen.fed == len(gen.feed):
                self._end(gen, FinishReason.TOKEN_LIMIT)
        with self._metrics_lock:
            self._metrics.record_step(
                start, end, decodes, len(prefill_sids), prefill_tokens, sum(context.values())
            )
            self._metrics.generated_tokens += generated
        if next_decodes:
            self._submit(next_decodes)

    def _commit(self, gen: _Generation, task: Task, end_position: int) -> None:
        """The executor consumed the task's input: the session's context grew."""
        state = gen.state
        assert state is not None
        state.position = end_position
        size = task.input.size
        if task.is_decode:
            gen.pending = ()
        else:
            gen.fed += size
            gen.metrics.prefilled_tokens += size
        if gen.reserved:
            self._release(gen, size)

    def _release(self, gen: _Generation, cells: int) -> None:
        # Cells now in use count in free_cells(); they no longer need a reservation.
        released = min(cells, gen.reserved)
        gen.reserved -= released
        self._reserved_cells -= released

    def _accept(
        self,
        gen: _Generation,
        tokens: tuple[Token, ...],
        now: float,
        next_decodes: list[tuple[_Generation, list[Task]]],
    ) -> int:
        """Deliver the tokens the generation keeps and queue its next decode;
        returns how many it kept."""
        state = gen.state
        assert state is not None
        room = gen.config.max_new_tokens - gen.metrics.generated_tokens
        kept = tuple(tokens[:room])  # executors may answer with any sequence
        reason: FinishReason | None = None
        stop_tokens = gen.config.stop_tokens
        if stop_tokens:
            for i, token in enumerate(kept):
                if token in stop_tokens:  # the stop token beats the budget and is delivered
                    kept, reason = kept[: i + 1], FinishReason.STOP_TOKEN
                    break
        if reason is None and len(kept) == room:
            reason = FinishReason.TOKEN_LIMIT
        count = len(kept)
        # The executor already fed all but the last of an accepted run; tokens past
        # what we keep are not committed, and the next input's lower start rewinds them.
        state.position += count - 1
        if gen.reserved:
            self._release(gen, count - 1)
        gen.pending = kept[-1:]
        gen.metrics.record_tokens(count, now)
        if reason is not None:
            self._end(gen, reason, "", kept)
            return count
        failure = gen.emit(GenerationUpdate(kept))
        if failure:
            self._end(gen, FinishReason.FAILED, failure)
            return count
        decode = Task(
            next(self._tids),
            Input(state.sid, True, 0, 1, gen.pending, state.position),
            is_decode=True,
        )
        next_decodes.append((gen, [decode]))
        return count

    def _end(
        self,
        gen: _Generation,
        reason: FinishReason,
        error: str = "",
        tokens: tuple[Token, ...] = (),
    ) -> None:
        """Settle a live generation exactly once and release what it held."""
        if gen.ended:
            return
        gen.ended = True
        state = gen.state
        assert state is not None
        if gen.started:
            for task in self._scheduler.cancel(state.sid):
                self._task_owner.pop(task.tid, None)
            self._running.discard(gen)
            self._reserved_cells -= gen.reserved
            gen.reserved = 0
            # Invariant: context = before + delta + delivered. What the generation did
            # not feed (the unfed rest of its prompt, its last token) stays pending.
            state.carry = gen.feed[gen.fed :] + gen.pending
        elif gen in self._waiting:
            self._waiting.remove(gen)
        if state.active is gen:
            state.active = None
        outcome = gen.settle(reason, error, tokens)
        if gen.feed_only:
            return  # a prefill turn: counted when it started, it has no outcome to record
        ttft = gen.metrics.ttft
        with self._metrics_lock:
            self._metrics.record_finish(outcome)
            if ttft is not None:
                self._metrics.record_ttft(ttft)

    def _stop(self, outcome: tuple[FinishReason, str]) -> None:
        """Answer what is still queued, end every live generation, close every
        session once. Runs last on the engine thread, whatever happened before."""
        with self._post_lock:
            self._closing_outcome = outcome
            self._accepting = False
        self._stop_requested = True
        reason, error = outcome
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            kind = command[0]
            if kind in (_OPEN, _CLONE):
                future = command[-1]
                if future.set_running_or_notify_cancel():
                    self._register(None, 0, future)
            elif kind == _START:
                self._count_start(command[1])
                self._end(command[1], reason, error)
            elif kind == _CLOSE:
                self._close(command[1])
        for gen in [*self._waiting, *self._running]:
            self._end(gen, reason, error)
        self._scheduler.clear()
        self._task_owner.clear()
        for state in list(self._sessions.values()):
            self._close(state)
