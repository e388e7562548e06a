"""The runner: one engine thread drives sessions, a scheduler and an executor (DESIGN §5).

Owns: the engine thread and everything it touches (the executor, the consuming
side of the scheduler, every session's state and every live generation); the
waiting queue of generations (through `Admission`), including submitted ones that
wait for a session of their own.
Promises: commands from any thread reach the engine through one FIFO inbox and run
between forwards; every generation settles exactly once, its outcome published
before waiters wake and before `on_settled`; once a generation has started,
ending it by any route leaves its session's context = what it held before + the
delta + exactly the tokens delivered; an executor failure poisons only the
sessions of the failed batch; a shortage of KV cells never fails work in flight:
waiting generations wait, and under "optimistic" admission the newest running
generation is preempted (its cells dropped, its context recomputed when it
resumes, its random stream untouched), idle sessions' cells being dropped first.
Only a generation whose context cannot fit the whole pool fails, with the numbers.
Never: raises on the engine thread because of a caller or an executor (errors
become `failed` generations), blocks a caller that closes a session, or runs two
forwards at once.
"""

from __future__ import annotations

import concurrent.futures
import enum
import itertools
import logging
import threading
from collections.abc import Sequence
from time import perf_counter

from cellbatch.executor import Executor
from cellbatch.metrics import EngineMetrics
from cellbatch.runner.admission import Admission, AdmissionPolicy
from cellbatch.runner.batch import BatchFailure, check_outputs
from cellbatch.runner.commands import (
    CancelGeneration,
    CloneSession,
    CloseSession,
    Command,
    Inbox,
    OpenSession,
    SessionFuture,
    StartGeneration,
)
from cellbatch.runner.generation import (
    Generation,
    SessionStart,
    SessionState,
    SettledCallback,
    UpdateCallback,
    overflow_message,
)
from cellbatch.runner.handle import GenerationHandle
from cellbatch.runner.session import Session, TurnDefaults, start_generation
from cellbatch.scheduler import DecodeFirstScheduler, Scheduler
from cellbatch.text_stream import Detokenizer
from cellbatch.types import (
    MAX_POSITION,
    BatchInput,
    FinishReason,
    GenConfig,
    Input,
    InvalidArgumentError,
    KVUsage,
    OutOfResourcesError,
    Output,
    SessionId,
    Task,
    TaskId,
    Token,
)

log = logging.getLogger(__name__)

# An idle engine looks again after this long even without a command (commands wake it at once).
_IDLE_WAIT_S = 0.1

_EXECUTOR_METHODS = (
    "initialize",
    "open_session",
    "close_session",
    "clone",
    "truncate",
    "set_sampling",
    "execute",
    "kv_usage",
)


class InitializationState(str, enum.Enum):
    INITIALIZING = "initializing"
    READY = "ready"
    FAILED = "failed"


class Runner:
    """Runs every generation of one executor on one engine thread.

    `Runner(executor, scheduler=None, tokenizer=None, stop_tokens=(),
    admission="optimistic")` starts the engine thread at once; it initialises the
    executor first (see `initialization_state()`). `stop_tokens` serve every
    generation whose config leaves them None; `tokenizer` (anything with
    `decode(tokens) -> str`) gives updates their text and enables stop strings. Use
    it as a context manager, or call `shutdown()`.
    """

    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler | None = None,
        *,
        tokenizer: Detokenizer | None = None,
        stop_tokens: Sequence[Token] = (),
        admission: str | AdmissionPolicy = AdmissionPolicy.OPTIMISTIC,
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
        self._executor = executor
        self._scheduler: Scheduler = (
            scheduler if scheduler is not None else DecodeFirstScheduler.create()
        )
        self._max_prefill_chunk = self._scheduler.max_prefill_chunk
        self._defaults = TurnDefaults(frozenset(stop_tokens), tokenizer)
        self._inbox = Inbox()
        self._stop_requested = False
        self._init_state = InitializationState.INITIALIZING
        self._init_error = ""
        self._initialized = threading.Event()
        self._metrics = EngineMetrics()
        self._kv: KVUsage | None = None
        self._metrics_lock = threading.Lock()
        # Engine-thread state. Invariant: a session is in _sessions iff it is open on
        # the executor; a generation is in _admission iff it is live and has passed
        # its checks; _task_owner holds every queued or in-flight task.
        self._sessions: dict[SessionId, SessionState] = {}
        self._admission = Admission(policy)
        self._task_owner: dict[TaskId, Generation] = {}
        self._tids = itertools.count()
        self._admitted = itertools.count(1)
        self._step_index = 0
        self._thread = threading.Thread(target=self._run, name="cellbatch-engine", daemon=True)
        self._thread.start()

    # -- public, any thread ----------------------------------------------------

    def open_session_async(self) -> concurrent.futures.Future[Session | None]:
        """A new empty session, or None when the executor has no room (counted as
        refused) or the runner is not running."""
        future: SessionFuture = concurrent.futures.Future()
        if not self._inbox.post(OpenSession(future)):
            with self._metrics_lock:
                self._metrics.sessions_refused += 1
            future.set_result(None)
        return future

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
        source_state = None
        if source is not None:
            source_state = source._state
            if source_state is None or not isinstance(upto, int) or upto < 0:
                generation = Generation(config, on_update, on_settled, start=SessionStart())
                generation.handle._bind(generation, None)
                generation.settle(
                    FinishReason.FAILED,
                    f"source must be an opened session and upto an integer >= 0, got {upto!r}",
                    (),
                    "",
                )
                return generation.handle
        generation = Generation(
            config, on_update, on_settled, start=SessionStart(source_state, upto)
        )
        return start_generation(generation, prompt, self._inbox, self._defaults)

    def shutdown(self) -> None:
        """Cancel everything live, close every session once, stop the engine.
        Idempotent; from any thread. Waits for the full stop, except when called
        on the engine thread itself (from a callback), where it only asks."""
        self._stop_requested = True
        self._inbox.wake()
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

    def kv_usage(self) -> KVUsage | None:
        """The executor's KV cells as of the end of the last step (None: no limit)."""
        with self._metrics_lock:
            return self._kv

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- engine thread: lifecycle ------------------------------------------------

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
        self._refresh_kv()
        self._init_state = InitializationState.READY
        self._initialized.set()
        return True

    def _loop(self) -> None:
        while not self._stop_requested:
            commands = self._inbox.take_queued()
            for command in commands:
                self._apply(command)
            if self._stop_requested:
                return
            if self._admission.waiting:
                self._admit()
            if self._step():
                continue
            if commands:
                self._refresh_kv()  # closes free cells between steps too
            del commands
            command = self._inbox.get(_IDLE_WAIT_S)
            if command is not None:
                self._apply(command)
                self._refresh_kv()
            # While idle, a done command must not keep its future (and a Session) alive.
            del command

    def _apply(self, command: Command) -> None:
        if isinstance(command, StartGeneration):
            self._start(command.generation)
        elif isinstance(command, CancelGeneration):
            self._end(command.generation, FinishReason.CANCELLED, "cancelled by the caller")
        elif isinstance(command, CloseSession):
            self._close(command.state)
        elif isinstance(command, CloneSession):
            self._clone(command.source, command.upto, command.future)
        elif isinstance(command, OpenSession):
            self._open(command.future)

    def _stop(self, outcome: tuple[FinishReason, str]) -> None:
        """Answer what is still queued, end every live generation, close every
        session once. Runs last on the engine thread, whatever happened before."""
        self._inbox.close(outcome)
        self._stop_requested = True
        reason, error = outcome
        for command in self._inbox.take_queued():
            if isinstance(command, (OpenSession, CloneSession)):
                if command.future.set_running_or_notify_cancel():
                    self._count_session(None)
                    command.future.set_result(None)
            elif isinstance(command, StartGeneration):
                self._count_start(command.generation)
                self._end(command.generation, reason, error)
            elif isinstance(command, CloseSession):
                self._close(command.state)
        for generation in [*self._admission.waiting, *self._admission.running]:
            self._end(generation, reason, error)
        self._scheduler.clear()
        self._task_owner.clear()
        for state in list(self._sessions.values()):
            self._close_now(state)

    # -- engine thread: sessions ---------------------------------------------------

    def _open(self, future: SessionFuture) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            sid = self._executor.open_session()
        except Exception as exc:
            future.set_exception(exc)
            return
        self._publish_session(sid, (), 0, future)

    def _clone(self, source: SessionState, upto: int, future: SessionFuture) -> None:
        if not future.set_running_or_notify_cancel():
            return
        # Unfed tokens and any speculative state beyond `committed` are not committed.
        if source.closed or source.close_requested or source.poisoned or upto > source.committed:
            future.set_result(None)
            return
        try:
            state = self._copy_session(source, upto)
        except Exception as exc:
            future.set_exception(exc)
            return
        if state is None:
            self._count_session(None)
            future.set_result(None)
            return
        self._count_session(state.sid)
        future.set_result(Session._bind(self._inbox, state, self._defaults))

    def _copy_session(self, source: SessionState, upto: int) -> SessionState | None:
        """A new session holding `source`'s first `upto` context tokens, sharing the
        cells `source` has for them; None when the executor refuses."""
        shared = min(upto, source.resident)
        sid = self._executor.clone(source.sid, shared)
        if sid is None:
            return None
        state = SessionState(sid, source.context[:upto], shared)
        state.committed = min(upto, source.committed)
        self._sessions[sid] = state
        return state

    def _publish_session(
        self, sid: SessionId | None, context: Sequence[Token], resident: int, future: SessionFuture
    ) -> None:
        self._count_session(sid)
        if sid is None:
            future.set_result(None)
            return
        state = SessionState(sid, context, resident)
        self._sessions[sid] = state
        future.set_result(Session._bind(self._inbox, state, self._defaults))

    def _count_session(self, sid: SessionId | None) -> None:
        with self._metrics_lock:
            if sid is None:
                self._metrics.sessions_refused += 1
            else:
                self._metrics.sessions_opened += 1

    def _close(self, state: SessionState) -> None:
        """Its face closed the session: end its generation; close it on the executor
        once no waiting submission still needs to start from it."""
        if state.closed or state.close_requested:
            return
        state.close_requested = True
        if state.active is not None:
            self._end(state.active, FinishReason.CANCELLED, "the session was closed")
        if state.clone_waiters == 0:
            self._close_now(state)

    def _close_now(self, state: SessionState) -> None:
        if state.closed:
            return
        state.closed = True
        self._sessions.pop(state.sid, None)
        try:
            self._executor.close_session(state.sid)
        except Exception:
            log.exception("executor.close_session(%d) raised", state.sid)

    def _drop_cells(self, state: SessionState) -> None:
        """Free the session's cells (those it shares stay with the other owners); its
        context is fed again by its next turn."""
        self._executor.truncate(state.sid, 0)
        state.resident = 0

    # -- engine thread: starting generations -----------------------------------------

    def _start(self, generation: Generation) -> None:
        self._count_start(generation)
        if generation.cancel_requested:
            self._end(generation, FinishReason.CANCELLED, "cancelled by the caller")
            return
        error = generation.input_error or self._refusal(generation)
        if error:
            self._end(generation, FinishReason.FAILED, error)
            return
        if generation.state is not None:
            generation.state.active = generation  # waiting for cells already counts as active
        elif generation.start.source is not None:
            generation.start.source.clone_waiters += 1
            generation.queued_on_source = True
        self._admission.enqueue(generation)

    def _count_start(self, generation: Generation) -> None:
        with self._metrics_lock:
            if generation.feed_only:
                self._metrics.prefill_turns += 1
            else:
                self._metrics.generations_started += 1

    @staticmethod
    def _refusal(generation: Generation) -> str:
        """Why the generation cannot be queued, or ""."""
        state = generation.state
        if state is None:  # a submission
            source, upto = generation.start.source, generation.start.upto
            if source is None:
                if not generation.delta:
                    return "the prompt is empty: a generation must feed at least one token"
                return ""
            if source.closed or source.close_requested:
                return "the source session is closed; submit before closing it"
            if source.poisoned:
                return f"the source session is poisoned ({source.poisoned})"
            if upto > len(source.context) or (upto == 0 and not generation.delta):
                return (
                    f"cannot start from {upto} tokens of a session holding "
                    f"{len(source.context)}, with {len(generation.delta)} more to feed; "
                    "upto must be within the source's context and something must be fed"
                )
            return ""
        if state.closed or state.close_requested:
            return "session is closed"
        if state.poisoned:
            return (
                f"session {state.sid} is poisoned by an earlier executor failure "
                f"({state.poisoned}); close it and open a new session"
            )
        if state.active is not None:
            return "the session already has an active generation; wait for it or cancel it"
        if not generation.delta and not state.context:
            return "delta is empty: a turn must feed at least one new token"
        if generation.feed_only and not generation.delta and not state.unfed():
            return "delta is empty: a prefill turn must feed at least one new token"
        feed = len(state.unfed()) + len(generation.delta)
        if state.committed + feed + generation.config.max_new_tokens - 2 > MAX_POSITION:
            return overflow_message(state.committed, feed, generation.config.max_new_tokens)
        return ""

    def _admit(self) -> None:
        """Start waiting generations in arrival order while they can get a session
        and the cells they need."""
        while (generation := self._admission.head()) is not None:
            if generation.state is None and not self._give_session(generation):
                if self._admission.running_count() == 0:
                    self._end(
                        generation,
                        FinishReason.FAILED,
                        f"no session available: all {len(self._sessions)} are open and idle; "
                        "close sessions or raise max_sessions",
                    )
                    continue
                return  # a running generation will free its session
            if not self._cells_for(generation):
                return
            self._begin(generation)

    def _give_session(self, generation: Generation) -> bool:
        """Open (or copy from its source) the session a submission runs on; False
        when the executor has no session free."""
        source, upto = generation.start.source, generation.start.upto
        try:
            if source is None:
                sid = self._executor.open_session()
                state = None if sid is None else SessionState(sid)
                if state is not None:
                    self._sessions[state.sid] = state
            elif source.close_requested and source.clone_waiters == 1 and source.active is None:
                state = self._take_over(source, upto)
            else:
                state = self._copy_session(source, upto)
        except Exception as exc:
            self._end(generation, FinishReason.FAILED, f"the executor refused a session: {exc!r}")
            return True
        if state is None:
            return False
        if state is not source:
            self._count_session(state.sid)
        self._release_waiting_source(generation)
        generation.state = state
        state.active = generation
        return True

    def _take_over(self, source: SessionState, upto: int) -> SessionState:
        """The last submission from a closed source runs on the source's own session."""
        if upto < source.resident:
            self._executor.truncate(source.sid, upto)
            source.resident = upto
        del source.context[upto:]
        source.committed = min(source.committed, upto)
        source.close_requested = False
        return source

    def _release_waiting_source(self, generation: Generation) -> None:
        """The submission no longer needs its source: the source closes if its face
        asked for that and no other submission waits on it."""
        source = generation.start.source if generation.start is not None else None
        if not generation.queued_on_source or source is None:
            return
        generation.queued_on_source = False
        source.clone_waiters -= 1
        if source.clone_waiters == 0 and source.close_requested:
            self._close_now(source)

    def _cells_for(self, generation: Generation) -> bool:
        """Whether the generation can start now; drops idle sessions' cells for it when
        nothing runs, and fails it when even the whole pool cannot hold it."""
        usage = self._read_kv()
        if usage is None:
            return True
        while not self._admission.fits(generation, usage.free_cells):
            if self._admission.running_count():
                if not generation.deferred:
                    generation.deferred = True
                    with self._metrics_lock:
                        self._metrics.deferred_for_cells += 1
                return False  # running generations will free cells or be preempted
            victim = self._idle_victim(exclude=generation.state)
            if victim is None or self._admission.policy is AdmissionPolicy.RESERVE:
                need = self._admission.need(generation)
                self._end(
                    generation,
                    FinishReason.FAILED,
                    f"not enough KV cells: this turn needs {need} (tokens to feed"
                    + (
                        " + max_new_tokens"
                        if self._admission.policy is AdmissionPolicy.RESERVE
                        else " + 1"
                    )
                    + f") but only {usage.free_cells} of {usage.max_cells} are "
                    "free and nothing running will release any; close idle sessions, shorten "
                    "the prompt or lower max_new_tokens",
                )
                return False
            self._reclaim(victim)
            usage = self._read_kv()
            assert usage is not None
        return True

    def _idle_victim(self, exclude: SessionState | None) -> SessionState | None:
        """The least recently used session whose cells can be dropped: one holding
        cells with no running generation, that no waiting submission starts from."""
        candidates = [
            state
            for state in self._sessions.values()
            if state.resident > 0
            and state is not exclude
            and state.clone_waiters == 0
            and (state.active is None or not self._admission.is_running(state.active))
        ]
        return min(candidates, key=lambda state: state.last_used, default=None)

    def _reclaim(self, state: SessionState) -> None:
        self._drop_cells(state)
        with self._metrics_lock:
            self._metrics.sessions_reclaimed += 1

    def _begin(self, generation: Generation) -> None:
        """Run the head: queue its feed (everything its session lacks) as prompt chunks."""
        state = generation.state
        assert state is not None
        self._admission.start(generation)
        generation.admitted_order = next(self._admitted)
        if not generation.started:
            generation.started = True
            state.context.extend(generation.delta)
            if state.resident == len(state.context):
                # Nothing new to feed (an empty delta after a prefill turn, say): feed the
                # last token again, for the logits of the first new token.
                self._executor.truncate(state.sid, len(state.context) - 1)
                state.resident = len(state.context) - 1
            generation.metrics.prompt_tokens = len(state.context) - state.committed
            with self._metrics_lock:
                self._metrics.prompt_tokens += generation.metrics.prompt_tokens
            try:
                self._executor.set_sampling(
                    state.sid, generation.config.sampling, generation.config.seed
                )
            except Exception as exc:
                self._end(generation, FinishReason.FAILED, f"executor.set_sampling raised {exc!r}")
                return
        recomputed = state.committed - state.resident
        with self._metrics_lock:
            self._metrics.recomputed_tokens += recomputed
            self._metrics.peak_concurrent_generations = max(
                self._metrics.peak_concurrent_generations, self._admission.running_count()
            )
        feed = tuple(state.context[state.resident :])
        size, chunk = len(feed), self._max_prefill_chunk
        # Every chunk has the same base position; only the last one asks for output,
        # unless this is a prefill turn.
        tasks = [
            Task(
                next(self._tids),
                Input(
                    state.sid,
                    not generation.feed_only and offset + chunk >= size,
                    offset,
                    min(chunk, size - offset),
                    feed,
                    state.resident,
                ),
                is_decode=False,
            )
            for offset in range(0, size, chunk)
        ]
        self._submit([(generation, tasks)])

    def _submit(self, work: list[tuple[Generation, list[Task]]]) -> None:
        """Queue each generation's tasks; a generation whose tasks the scheduler
        refuses ends `failed`. One call for the common case, one per generation to
        find the culprit when the scheduler refuses the lot."""
        everything = [task for _, tasks in work for task in tasks]
        if self._scheduler_accepts(everything):
            for generation, tasks in work:
                for task in tasks:
                    self._task_owner[task.tid] = generation
            return
        for generation, tasks in work:
            if len(work) > 1 and self._scheduler_accepts(tasks):
                for task in tasks:
                    self._task_owner[task.tid] = generation
            else:
                self._end(
                    generation,
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

    # -- engine thread: steps ------------------------------------------------------

    def _step(self) -> bool:
        """Run one batch; False when there was no work."""
        tasks = self._scheduler.get_work()
        if not tasks:
            return False
        if self._admission.policy is AdmissionPolicy.OPTIMISTIC:
            tasks = self._make_room(tasks)
            if not tasks:
                return True
        self._step_index += 1
        inputs = tuple(task.input for task in tasks)
        start = perf_counter()
        try:
            outputs = check_outputs(inputs, self._executor.execute(BatchInput(inputs)))
        except (BatchFailure, InvalidArgumentError, OutOfResourcesError) as failure:
            outputs, why = (), str(failure)
        except Exception as exc:
            log.exception("executor.execute raised")
            outputs, why = (), f"executor.execute raised {exc!r}"
        end = perf_counter()
        if self._stop_requested:
            return True  # shutdown discards what was in flight
        if outputs:
            self._finish_batch(tasks, outputs, start, end)
        else:
            self._fail_batch(tasks, why, start, end)
        self._refresh_kv()
        return True

    def _make_room(self, tasks: list[Task]) -> list[Task]:
        """The batch, after freeing the cells it needs: idle sessions' cells first,
        then the newest running generations' (preempted, they wait at the head of the
        queue). A lone generation that cannot fit even so fails."""
        usage = self._read_kv()
        while usage is not None and sum(t.input.size for t in tasks) > usage.free_cells:
            victim_state = self._idle_victim(exclude=None)
            if victim_state is not None:
                self._reclaim(victim_state)
            else:
                victim = self._admission.newest_running()
                assert victim is not None and victim.state is not None
                sid = victim.state.sid
                if self._admission.running_count() == 1:
                    need = sum(t.input.size for t in tasks)
                    self._end(
                        victim,
                        FinishReason.FAILED,
                        f"not enough KV cells: the session holds {victim.state.resident} "
                        f"and its next step needs {need} more, but the pool has "
                        f"{usage.max_cells} in all ({usage.free_cells} free); raise max_cells "
                        "or lower max_new_tokens",
                    )
                else:
                    self._preempt(victim)
                tasks = [task for task in tasks if task.sid != sid]
            usage = self._read_kv()
        return tasks

    def _preempt(self, generation: Generation) -> None:
        state = generation.state
        assert state is not None
        for task in self._scheduler.cancel(state.sid):
            self._task_owner.pop(task.tid, None)
        self._drop_cells(state)
        self._admission.preempt(generation)
        with self._metrics_lock:
            self._metrics.preemptions += 1

    def _fail_batch(self, tasks: list[Task], why: str, start: float, end: float) -> None:
        with self._metrics_lock:
            self._metrics.record_failed_step(start, end)
        failed: dict[Generation, None] = {}  # ordered set
        for task in tasks:
            generation = self._task_owner.pop(task.tid, None)
            if generation is not None:
                failed[generation] = None
            state = self._sessions.get(task.sid)
            if state is not None and not state.poisoned:
                state.poisoned = why
        for generation in failed:
            self._end(generation, FinishReason.FAILED, f"the executor failed on this batch: {why}")

    def _finish_batch(
        self, tasks: list[Task], outputs: Sequence[Output | None], start: float, end: float
    ) -> None:
        step = self._step_index
        decodes = prefill_tokens = generated = 0
        prefill_sids: set[SessionId] = set()
        context: dict[SessionId, int] = {}  # each session's length after the step
        next_decodes: list[tuple[Generation, list[Task]]] = []
        cancelled: dict[Generation, None] = {}  # ordered set
        for task, output in zip(tasks, outputs, strict=True):
            inp = task.input
            end_position = inp.start + inp.size
            context[inp.sid] = end_position
            if task.is_decode:
                decodes += 1
            else:
                prefill_tokens += inp.size
                prefill_sids.add(inp.sid)
            generation = self._task_owner.pop(task.tid, None)
            if generation is None:
                continue
            state = generation.state
            assert state is not None
            # The executor consumed the input, whatever happened to the generation: the
            # session's cells hold it now, so the next turn continues after it.
            state.advance(end_position)
            if generation.ended:
                continue
            self._count_step(generation, task, start, step)
            if generation.cancel_requested:
                cancelled[generation] = None  # ended once the whole batch is counted
            elif output is not None:
                generated += self._accept(generation, output.tokens, end, next_decodes)
            elif generation.feed_only and state.resident == len(state.context):
                self._end(generation, FinishReason.TOKEN_LIMIT)
        with self._metrics_lock:
            self._metrics.record_step(
                start, end, decodes, len(prefill_sids), prefill_tokens, sum(context.values())
            )
            self._metrics.generated_tokens += generated
        for generation in cancelled:
            self._end(generation, FinishReason.CANCELLED, "cancelled by the caller")
        if next_decodes:
            self._submit(next_decodes)

    @staticmethod
    def _count_step(generation: Generation, task: Task, start: float, step: int) -> None:
        metrics = generation.metrics
        if metrics.first_step_time is None:
            metrics.first_step_time = start
        if not task.is_decode:
            metrics.prefilled_tokens += task.input.size
        if generation.last_step != step:
            generation.last_step = step
            if task.is_decode:
                metrics.decode_steps += 1
            else:
                metrics.prefill_steps += 1

    def _accept(
        self,
        generation: Generation,
        tokens: tuple[Token, ...],
        now: float,
        next_decodes: list[tuple[Generation, list[Task]]],
    ) -> int:
        """Deliver the tokens the generation keeps and queue its next decode;
        returns how many it kept."""
        state = generation.state
        assert state is not None
        kept, text, reason = generation.deliver(tokens)
        count = len(kept)
        state.context.extend(kept)
        # The executor already fed all but the last of an accepted run; tokens past
        # what we keep are not committed, and the next input's lower start rewinds them.
        state.advance(state.resident + count - 1)
        generation.metrics.record_tokens(count, now)
        if reason is not None:
            self._end(generation, reason, "", kept, text)
            return count
        failure = generation.emit(kept, text)
        if failure:
            self._end(generation, FinishReason.FAILED, failure)
            return count
        decode = Task(
            next(self._tids),
            Input(state.sid, True, 0, 1, kept[-1:], state.resident),
            is_decode=True,
        )
        next_decodes.append((generation, [decode]))
        return count

    def _end(
        self,
        generation: Generation,
        reason: FinishReason,
        error: str = "",
        tokens: tuple[Token, ...] = (),
        text: str = "",
    ) -> None:
        """Settle a live generation exactly once and release what it held."""
        if generation.ended:
            return
        generation.ended = True
        state = generation.state
        if self._admission.is_running(generation) and state is not None:
            for task in self._scheduler.cancel(state.sid):
                self._task_owner.pop(task.tid, None)
        self._admission.remove(generation)
        self._release_waiting_source(generation)
        if state is not None and state.active is generation:
            state.active = None
            state.last_used = self._step_index
        outcome = generation.settle(reason, error, tokens, text + generation.closing_text())
        if generation.start is not None and state is not None:
            self._close_now(state)  # a submission's session lives as long as it does
        if generation.feed_only:
            return  # a prefill turn: counted when it started, it has no outcome to record
        ttft = generation.metrics.ttft
        with self._metrics_lock:
            self._metrics.record_finish(outcome)
            if ttft is not None:
                self._metrics.record_ttft(ttft)

    # -- engine thread: KV usage ---------------------------------------------------

    def _read_kv(self) -> KVUsage | None:
        try:
            return self._executor.kv_usage()
        except Exception:
            log.exception("executor.kv_usage() raised; admitting without a cell limit")
            return None

    def _refresh_kv(self) -> None:
        usage = self._read_kv()
        with self._metrics_lock:
            self._kv = usage
