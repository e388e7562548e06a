"""The engine loop: what the runner's one engine thread does
(docs/design.md#runner-sessions-and-handles).

Owns: everything the engine thread touches (the executor, every session's record and
every live generation, the `StepPlanner` that decides each step and through it the
consuming side of the scheduler and the waiting queue, including submitted
generations that wait for a session of their own); the engine's `MetricsLedger`,
which it and its books record events in; the KV usage and occupancy it publishes
after each step.
Promises: commands from any thread reach the engine through one FIFO inbox and run
between forwards; each step runs what the planner planned, and moves each session's
`computed` to what the executor fed and the generation kept; every generation settles
exactly once, its outcome published before waiters wake and before `on_settled`;
once a generation has started, ending it by any route leaves its session's context =
what it held before + the delta + exactly the tokens delivered; an executor failure
poisons only the sessions of the failed batch; a shortage of KV cells never fails
work in flight (the planner defers, drops idle cells or preempts: see
`step_planner`); only a generation whose context cannot fit the whole pool fails,
with the numbers.
Never: raises on the engine thread because of a caller or an executor (errors
become `failed` generations), blocks a caller that closes a session, runs two
forwards at once, decides what runs next, or changes a counter except by recording
an event.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import logging
import threading
from collections.abc import Sequence
from time import perf_counter

from cellbatch.executor import Executor
from cellbatch.metrics import EngineMetrics
from cellbatch.runner.admission import AdmissionPolicy, Occupancy
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
    Sync,
)
from cellbatch.runner.generation import (
    Generation,
    GenerationKind,
    GenerationStatus,
    SessionRecord,
)
from cellbatch.runner.metrics_ledger import (
    GenerationFinished,
    GenerationStarted,
    Initialized,
    MetricsLedger,
    PrefillTurnStarted,
    SessionRefused,
    StepDone,
    StepFailed,
)
from cellbatch.runner.session import Session, TurnDefaults
from cellbatch.runner.sessions import SessionBook
from cellbatch.runner.step_planner import PlannedStep, StepPlanner
from cellbatch.scheduler import Scheduler
from cellbatch.speculative import SpeculativeConfig
from cellbatch.types import (
    BatchInput,
    FinishReason,
    GenerationUpdate,
    InvalidArgumentError,
    KVUsage,
    OutOfResourcesError,
    Output,
    Token,
)

log = logging.getLogger(__name__)

# An idle engine looks again after this long even without a command (commands wake it at once).
_IDLE_WAIT_S = 0.1


class InitializationState(str, enum.Enum):
    INITIALIZING = "initializing"
    READY = "ready"
    FAILED = "failed"


class EngineLoop:
    """The engine thread's side of a Runner: `run()` is the thread's target.

    The attributes are engine-thread state, except the ones the face reads or sets
    from any thread: `stop_requested` (a flag), the ledger, the KV and occupancy
    snapshot and the initialisation outcome behind the readers below.
    """

    # Six parameters: the parts the Runner wires together (executor, scheduler, inbox)
    # and the three policies it was given; the loop builds its books from them.
    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler,
        inbox: Inbox,
        defaults: TurnDefaults,
        policy: AdmissionPolicy,
        prefix_cache_entries: int = 0,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self._executor = executor
        self._scheduler = scheduler
        self._defaults = defaults
        self._inbox = inbox
        self.stop_requested = False
        self.init_state = InitializationState.INITIALIZING
        self.init_error = ""
        self.initialized = threading.Event()
        self._ledger = MetricsLedger()
        # The KV usage and occupancy stay here, under a lock of their own, rather than
        # in the ledger: they are the engine's state as of its last step, overwritten
        # whole at each refresh, not events to add up; in the ledger they would need a
        # second, non-event way in, and a reader of one would wait on writers of the other.
        self._published_lock = threading.Lock()
        self._kv: KVUsage | None = None
        self._occupancy = Occupancy(0, 0)
        # Invariant: a generation is in the planner's queue or running set iff it is live
        # and has passed its checks; the books' invariants are in their modules.
        self._sessions = SessionBook(executor, self._ledger, prefix_cache_entries)
        self._planner = StepPlanner(
            executor, scheduler, self._sessions, self._ledger, policy, self._fail, speculative
        )
        self._step_index = 0

    # -- any thread ----------------------------------------------------------------

    def metrics(self) -> EngineMetrics:
        """A consistent copy of the engine counters."""
        return self._ledger.snapshot()

    def kv_usage(self) -> KVUsage | None:
        """The executor's KV cells as of the end of the last step (None: no limit)."""
        with self._published_lock:
            return self._kv

    def occupancy(self) -> Occupancy:
        """Generations running and waiting, as of the end of the last step."""
        with self._published_lock:
            return self._occupancy

    def count_refused_session(self) -> None:
        """A caller's open that never reached the engine (the runner had stopped)."""
        self._ledger.record(SessionRefused())

    # -- engine thread: lifecycle ------------------------------------------------

    def run(self) -> None:
        outcome = (FinishReason.CANCELLED, "the runner is shut down")
        try:
            if self._initialize():
                self._loop()
            else:
                outcome = (FinishReason.FAILED, self.init_error)
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
            self.init_error = f"executor initialisation failed: {exc!r}"
            self.init_state = InitializationState.FAILED
            self.initialized.set()
            return False
        self._ledger.record(Initialized(perf_counter() - start))
        self._refresh_kv()
        self.init_state = InitializationState.READY
        self.initialized.set()
        return True

    def _loop(self) -> None:
        while not self.stop_requested:
            applied = self._apply_queued()
            if self.stop_requested:
                return
            self._planner.admit()
            if self._step():
                continue
            if applied:
                self._refresh_kv()  # closes free cells between steps too
            arrived = self._inbox.get(_IDLE_WAIT_S)
            if arrived is not None:
                self._apply(arrived)
                self._refresh_kv()
            # While idle, a done command must not keep its future (and a Session) alive.
            del arrived

    def _apply_queued(self) -> bool:
        """Apply what is queued now; True if anything was. (A function of its own, so that
        no applied command stays referenced from the loop's frame: its future may hold
        the only other reference to a Session whose drop must close it.)"""
        commands = self._inbox.take_queued()
        for command in commands:
            self._apply(command)
        return bool(commands)

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
        elif isinstance(command, Sync):
            self._refresh_kv()
            command.future.set_result(None)

    def _stop(self, outcome: tuple[FinishReason, str]) -> None:
        """Answer what is still queued, end every live generation, close every
        session once. Runs last on the engine thread, whatever happened before."""
        self._inbox.close(outcome)
        self.stop_requested = True
        reason, error = outcome
        syncs: list[concurrent.futures.Future[None]] = []
        for command in self._inbox.take_queued():
            if isinstance(command, (OpenSession, CloneSession)):
                if command.future.set_running_or_notify_cancel():
                    self._sessions.count(None)
                    command.future.set_result(None)
            elif isinstance(command, StartGeneration):
                self._count_start(command.generation)
                self._end(command.generation, reason, error)
            elif isinstance(command, CloseSession):
                self._close(command.state)
            elif isinstance(command, Sync):
                syncs.append(command.future)
        for generation in self._planner.live():
            self._end(generation, reason, error)
        self._planner.clear()
        for state in self._sessions.states():
            self._sessions.close(state)
        try:
            self._refresh_kv()
        finally:
            for future in syncs:
                future.set_result(None)

    # -- engine thread: sessions ---------------------------------------------------

    def _open(self, future: SessionFuture) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            state = self._sessions.count(self._sessions.open())
        except Exception as exc:
            future.set_exception(exc)
            return
        future.set_result(self._face(state))

    def _clone(self, source: SessionRecord, upto: int, future: SessionFuture) -> None:
        if not future.set_running_or_notify_cancel():
            return
        # Unfed tokens and any speculative state beyond `committed` are not committed.
        if source.closed or source.close_requested or source.poisoned or upto > source.committed:
            future.set_result(None)
            return
        try:
            state = self._sessions.count(self._sessions.copy(source, upto))
        except Exception as exc:
            future.set_exception(exc)
            return
        future.set_result(self._face(state))

    def _face(self, state: SessionRecord | None) -> Session | None:
        return None if state is None else Session._bind(self._inbox, state, self._defaults)

    def _close(self, state: SessionRecord) -> None:
        """Its face closed the session: end its generation, then close it (once no
        waiting submission still needs to start from it)."""
        if state.closed or state.close_requested:
            return
        if state.active is not None:
            self._end(state.active, FinishReason.CANCELLED, "the session was closed")
        self._sessions.close_when_free(state)

    # -- engine thread: starting generations -----------------------------------------

    def _start(self, generation: Generation) -> None:
        self._count_start(generation)
        if generation.cancel_requested:
            self._end(generation, FinishReason.CANCELLED, "cancelled by the caller")
            return
        error = generation.input_error or generation.refusal()
        if error:
            self._end(generation, FinishReason.FAILED, error)
            return
        if generation.state is not None:
            generation.state.active = generation  # waiting for cells already counts as active
        else:
            self._sessions.hold_source(generation)
        self._planner.enqueue(generation)

    def _count_start(self, generation: Generation) -> None:
        self._ledger.record(PrefillTurnStarted() if generation.feeds_only else GenerationStarted())

    # -- engine thread: steps ------------------------------------------------------

    def _step(self) -> bool:
        """Run one planned step; False when there was no work."""
        step = self._planner.next_step()
        if step is None:
            return False
        if not step.tasks:
            return True  # its tasks' generations were preempted: plan again at once
        self._step_index += 1
        start = perf_counter()
        try:
            outputs = check_outputs(step.inputs, self._executor.execute(BatchInput(step.inputs)))
        except (BatchFailure, InvalidArgumentError, OutOfResourcesError) as failure:
            outputs, why = (), str(failure)
        except Exception as exc:
            log.exception("executor.execute raised")
            outputs, why = (), f"executor.execute raised {exc!r}"
        end = perf_counter()
        if self.stop_requested:
            return True  # shutdown discards what was in flight
        if outputs:
            self._planner.ran(step, outputs, end - start)
            self._finish_batch(step, outputs, start, end)
        else:
            self._fail_batch(step, why, start, end)
        self._refresh_kv()
        return True

    def _fail_batch(self, step: PlannedStep, why: str, start: float, end: float) -> None:
        self._ledger.record(StepFailed(start, end))
        for inp in step.inputs:
            state = self._sessions.get(inp.sid)
            if state is not None and not state.poisoned:
                state.poisoned = why
        for generation in dict.fromkeys(step.owners):  # an ordered set
            self._end(generation, FinishReason.FAILED, f"the executor failed on this batch: {why}")

    def _finish_batch(
        self, step: PlannedStep, outputs: Sequence[Output | None], start: float, end: float
    ) -> None:
        index = self._step_index
        generated = 0
        next_decodes: list[tuple[Generation, Token]] = []
        cancelled: dict[Generation, None] = {}  # ordered set
        for task, generation, output in zip(step.tasks, step.owners, outputs, strict=True):
            inp = task.input
            state = generation.state
            assert state is not None
            # The executor consumed the input, whatever happened to the generation: the
            # session's cells hold it now, so the next turn continues after it.
            state.advance(inp.start + inp.size)
            if generation.ended:
                continue
            generation.count_step(task.is_decode, inp.size, start, index)
            if generation.cancel_requested:
                cancelled[generation] = None  # ended once the whole batch is counted
            elif output is not None and output.embedding is not None:
                # A pooling generation: its prompt's pooled hidden states end it.
                pooled = GenerationUpdate((), embedding=output.embedding)
                self._end(generation, FinishReason.TOKEN_LIMIT, last=pooled)
            elif output is not None:
                generated += self._accept(generation, output, end, next_decodes)
            elif generation.feeds_only and state.computed == len(state.context):
                self._end(generation, FinishReason.TOKEN_LIMIT)
        self._ledger.record(StepDone.of(step.tasks, outputs, start, end, generated))
        for generation in cancelled:
            self._end(generation, FinishReason.CANCELLED, "cancelled by the caller")
        if next_decodes:
            self._planner.decode_next(next_decodes)

    def _accept(
        self,
        generation: Generation,
        output: Output,
        now: float,
        next_decodes: list[tuple[Generation, Token]],
    ) -> int:
        """Deliver the tokens the generation keeps (with their logprobs) and queue its
        next decode; returns how many it kept."""
        state = generation.state
        assert state is not None
        update = generation.deliver(output.tokens, output.logprobs, output.prompt_logprobs)
        kept, reason = update.tokens, update.finish_reason
        count = len(kept)
        state.context.extend(kept)
        # The executor already fed all but the last of an accepted run; tokens past
        # what we keep are not computed, and the next input's lower start rewinds them.
        state.advance(state.computed + count - 1)
        generation.metrics.record_tokens(count, now)
        if reason is not None:
            self._end(generation, reason, last=update)
            return count
        failure = generation.emit(update)
        if failure:
            self._end(generation, FinishReason.FAILED, failure)
            return count
        next_decodes.append((generation, kept[-1]))
        return count

    def _end(
        self,
        generation: Generation,
        reason: FinishReason,
        error: str = "",
        last: GenerationUpdate | None = None,
    ) -> None:
        """Settle a live generation exactly once and release what it held; `last` is
        the update of the tokens that ended it, when tokens did."""
        if generation.ended:
            return
        was_admitted = generation.admitted
        state = generation.state
        self._planner.remove(generation)
        generation.move(GenerationStatus.ENDED)
        if (
            reason is FinishReason.CANCELLED
            and not was_admitted
            and generation.kind is not GenerationKind.SUBMISSION
            and state is not None
        ):
            # A turn cancelled while it waited for cells leaves its delta in the session,
            # unfed, as a turn cancelled after it began does: what a session holds after
            # a cancel never depends on whether the turn had left the queue.
            state.context.extend(generation.delta)
        self._sessions.release_source(generation)
        if state is not None and state.active is generation:
            state.active = None
            state.last_used = self._step_index
        closing = generation.closing_text()
        if closing:  # text held back (a possible stop string) that the end releases
            base = last or GenerationUpdate(())
            last = dataclasses.replace(base, text=base.text + closing)
        outcome = generation.settle(reason, error, last)
        if generation.kind is GenerationKind.SUBMISSION and state is not None:
            # A submission's session lives as long as it does, or on as a snapshot.
            self._sessions.finished(state, reusable=outcome is not FinishReason.FAILED)
        if generation.feeds_only:
            return  # a prefill turn: counted when it started, it has no outcome to record
        self._ledger.record(GenerationFinished(outcome, generation.metrics.ttft))

    def _fail(self, generation: Generation, why: str) -> None:
        self._end(generation, FinishReason.FAILED, why)

    def _refresh_kv(self) -> None:
        usage = self._planner.usage()
        occupancy = self._planner.occupancy()
        with self._published_lock:
            self._kv, self._occupancy = usage, occupancy
