"""Runner: the face of the engine for callers on any thread
(docs/design.md#runner-sessions-and-handles).

Owns: the engine thread, the inbox it drains and the `EngineLoop` it runs.
Promises: construction checks the executor and the options, then starts the
engine thread, which initialises the executor first; every request (a session, a
submission) is a command posted to the inbox, answered through a future or a
handle; `shutdown()` is idempotent, from any thread (also a callback), and waits
for the full stop except on the engine thread itself; a runner still running when
the interpreter exits is shut down by an `atexit` hook before finalization, so that
its engine thread never meets a finalizing interpreter inside a torch call.
Never: touches engine state; it reads only the loop's published figures (the
counters' snapshot, KV usage, occupancy, initialisation outcome), and records only
the refusal of an open the stopped engine never saw.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
from collections.abc import Sequence

from cellbatch.executor import Executor
from cellbatch.generation_config import GenConfig
from cellbatch.metrics import EngineMetrics
from cellbatch.runner.admission import AdmissionPolicy, Occupancy
from cellbatch.runner.commands import Inbox, OpenSession, SessionFuture, Sync
from cellbatch.runner.generation import (
    AdapterLookup,
    ContextSource,
    Generation,
    GenerationKind,
    SettledCallback,
    UpdateCallback,
)
from cellbatch.runner.handle import GenerationHandle
from cellbatch.runner.loop import EngineLoop, InitializationState
from cellbatch.runner.session import Session, TurnDefaults, start_generation
from cellbatch.scheduler import DecodeFirstScheduler, Scheduler
from cellbatch.speculative import SpeculativeConfig
from cellbatch.text_stream import Detokenizer
from cellbatch.types import FinishReason, InvalidArgumentError, KVUsage, Token

_EXECUTOR_METHODS = (
    "initialize",
    "open_session",
    "close_session",
    "clone",
    "truncate",
    "set_sampling",
    "set_adapter",
    "execute",
    "kv_usage",
)


class _EngineThread:
    """The engine thread of one runner, and how to stop it.

    Every one that runs is in `_RUNNING` until its loop returns, so that the exit hook
    reaches it even when its Runner was dropped without a shutdown (the thread holds
    the loop, not the Runner).
    """

    def __init__(self, loop: EngineLoop, inbox: Inbox) -> None:
        self._loop, self._inbox = loop, inbox
        self.thread = threading.Thread(target=self._run, name="cellbatch-engine", daemon=True)

    def start(self) -> None:
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._loop.run()
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(self)

    def stop(self) -> None:
        self._loop.stop_requested = True
        self._inbox.wake()
        if threading.current_thread() is not self.thread:
            self.thread.join()


_RUNNING: set[_EngineThread] = set()
_RUNNING_LOCK = threading.Lock()


@atexit.register
def _stop_engines_at_exit() -> None:
    # A daemon thread that is inside torch (its GIL released) when the interpreter
    # finalizes is unwound through C++ frames on its next GIL acquire, and the C++
    # runtime aborts the process (exit 134, "terminate called without an active
    # exception"). atexit hooks run before finalization, while threads still run.
    with _RUNNING_LOCK:
        engines = list(_RUNNING)
    for engine in engines:
        engine.stop()


class Runner:
    """Runs every generation of one executor on one engine thread.

    `Runner(executor, scheduler=None, tokenizer=None, stop_tokens=(),
    admission="optimistic")` starts the engine thread at once; it initialises the
    executor first (see `initialization_state()`). `stop_tokens` serve every
    generation whose config leaves them None; `tokenizer` (anything with
    `decode(tokens) -> str`) gives updates their text and enables stop strings;
    `admission` is "optimistic" (start what fits now, preempt under pressure) or
    "reserve" (start only what fits at its worst case, never preempt);
    `prefix_cache_entries` > 0 keeps that many finished submissions' sessions as
    snapshots, so that a later submission sharing a prefix with one starts from its
    cells (they give way first under pressure). `speculative` (the config the
    executor's drafter was built from) lets decodes verify drafted tokens, as many
    as pay for themselves (`runner.draft_budget`); `adapters` are the LoRA adapters a
    generation's config may name. Use it as a context manager, or call `shutdown()`.
    """

    # The public constructor: an executor, and seven options with defaults.
    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler | None = None,
        *,
        tokenizer: Detokenizer | None = None,
        stop_tokens: Sequence[Token] = (),
        admission: str | AdmissionPolicy = AdmissionPolicy.OPTIMISTIC,
        prefix_cache_entries: int = 0,
        speculative: SpeculativeConfig | None = None,
        adapters: AdapterLookup | None = None,
    ) -> None:
        missing = [
            name for name in _EXECUTOR_METHODS if not callable(getattr(executor, name, None))
        ]
        if missing:
            raise InvalidArgumentError(
                f"{type(executor).__name__} lacks {', '.join(missing)}: a runner needs an "
                "executor implementing cellbatch.executor.Executor"
            )
        try:
            policy = AdmissionPolicy(admission)
        except ValueError:
            choices = [p.value for p in AdmissionPolicy]
            raise InvalidArgumentError(
                f"unknown admission {admission!r}; use one of {choices}"
            ) from None
        if isinstance(prefix_cache_entries, bool) or not (
            isinstance(prefix_cache_entries, int) and prefix_cache_entries >= 0
        ):
            raise InvalidArgumentError(
                f"prefix_cache_entries must be an integer >= 0 (0: off), got "
                f"{prefix_cache_entries!r}"
            )
        self._defaults = TurnDefaults(frozenset(stop_tokens), tokenizer, adapters)
        self._inbox = Inbox()
        self._loop = EngineLoop(
            executor,
            scheduler if scheduler is not None else DecodeFirstScheduler.create(),
            self._inbox,
            self._defaults,
            policy,
            prefix_cache_entries,
            speculative,
        )
        self._engine = _EngineThread(self._loop, self._inbox)
        self._engine.start()

    def open_session_async(self) -> concurrent.futures.Future[Session | None]:
        """A new empty session, or None when the executor has no room (counted as
        refused) or the runner is not running."""
        future: SessionFuture = concurrent.futures.Future()
        if not self._inbox.post(OpenSession(future)):
            self._loop.count_refused_session()
            future.set_result(None)
        return future

    # The public face: the prompt, its config and callbacks, and where it starts from.
    def submit(
        self,
        prompt: Sequence[Token],
        config: GenConfig | None = None,
        on_update: UpdateCallback | None = None,
        on_settled: SettledCallback | None = None,
        *,
        source: Session | None = None,
        upto: int = 0,
    ) -> GenerationHandle:
        """A generation on a session of its own, closed when it settles.

        It waits in arrival order until a session and the KV cells it needs are
        free. With `source`, the session starts as a copy of `source`'s first `upto`
        context tokens (sharing their cells) and `prompt` is what follows them; a
        submission queued before `source` is closed still starts from it (the last
        one takes `source`'s session over instead of copying it). Errors come back
        as a `failed` generation, as for `Session.generate_async`.
        """
        config = config if config is not None else GenConfig()
        source_state = source._state if source is not None else None
        generation = Generation(
            config,
            on_update,
            on_settled,
            kind=GenerationKind.SUBMISSION,
            start=ContextSource(source_state, upto),
        )
        if source is not None and (source_state is None or not isinstance(upto, int) or upto < 0):
            generation.handle._bind(generation, None)
            generation.settle(
                FinishReason.FAILED,
                f"source must be an opened session and upto an integer >= 0, got {upto!r}",
            )
            return generation.handle
        return start_generation(generation, prompt, self._inbox, self._defaults)

    def shutdown(self) -> None:
        """Cancel everything live, close every session once, stop the engine.
        Idempotent; from any thread. Waits for the full stop, except when called
        on the engine thread itself (from a callback), where it only asks."""
        self._engine.stop()

    def sync(self, timeout: float | None = None) -> bool:
        """Wait until the engine has applied every command posted before this call (a
        close, a settlement's release of its session) and `kv_usage()` counts what
        they freed; True once so (at once on a stopped runner), False on timeout."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        if not self._inbox.post(Sync(future)):
            return True
        try:
            future.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def stopping(self) -> bool:
        """True once shutdown was asked for (or the engine stopped by itself)."""
        return self._loop.stop_requested

    def initialization_state(self) -> InitializationState:
        return self._loop.init_state

    def initialization_error(self) -> str:
        return self._loop.init_error

    def wait_initialized(self, timeout: float | None = None) -> InitializationState:
        """Block until executor initialisation has finished (or `timeout` ran out)."""
        self._loop.initialized.wait(timeout)
        return self._loop.init_state

    def metrics(self) -> EngineMetrics:
        """A consistent copy of the engine counters."""
        return self._loop.metrics()

    def kv_usage(self) -> KVUsage | None:
        """The executor's KV cells as of the end of the last step (None: no limit)."""
        return self._loop.kv_usage()

    def occupancy(self) -> Occupancy:
        """Generations running and waiting as of the engine's last step."""
        return self._loop.occupancy()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
