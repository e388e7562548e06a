"""What runs next: the one owner of each step's work (docs/design.md#the-step-planner).

Owns: the admission queue and the running set (`Admission`), the task book and through
it the scheduler's queue, and the draft budget; every decision about what the next
forward holds: which waiting generations start (their session, the cells their feed
needs, their prompt chunks), which queued tasks run, the cells those take, which
session's cells are dropped (its `computed` length falls) and which generation gives
its cells up when they run short, and how many drafted tokens each decode may verify.
Promises: first come, first served within a priority (`Admission`): the head of the
queue starts before anything behind it, once it has a session and (`Admission.fits`)
its cells, for which a less urgent running generation gives its cells up under
"optimistic" admission (never an equally or more urgent one); a planned step's
tokens never exceed the free cells: idle sessions' cells go first (snapshots, then the
least recently used), then under "optimistic" admission the running generation
`Admission.preemption_victim` names gives its cells up (its tasks cancelled, back to
the head of the queue, its context recomputed when it resumes); only a generation
that cannot fit even with everything else freed fails, with the numbers. The
scheduler's decode-first order and budget are kept as they come: a step holds what
`get_work` handed out, less the tasks of the generations preempted for it. Every
drop, deferral, preemption and admission is recorded as an event in the ledger.
Drafts take only what is left of the step's token budget and free cells after the
decodes and prompt chunks (speculation never delays a prompt), as `DraftBudget`
grants them.
Never: runs a forward, delivers tokens or settles a generation (its failures go to
the `fail` callback the loop gives it); touches the scheduler except through the task
book.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cellbatch.executor import Executor
from cellbatch.runner.admission import Admission, AdmissionPolicy, Occupancy
from cellbatch.runner.draft_budget import DraftBudget
from cellbatch.runner.generation import Generation, GenerationStatus, SessionRecord
from cellbatch.runner.metrics_ledger import (
    Admitted,
    DeferredForCells,
    MetricsLedger,
    Preempted,
    PromptFed,
    SessionReclaimed,
)
from cellbatch.runner.sessions import SessionBook
from cellbatch.runner.tasks import TaskBook
from cellbatch.scheduler import Scheduler
from cellbatch.speculative import SpeculativeConfig
from cellbatch.types import Input, InvalidArgumentError, KVUsage, Output, Task, Token

log = logging.getLogger(__name__)

Fail = Callable[[Generation, str], None]


@dataclass(frozen=True)
class PlannedStep:
    """One forward's work: `inputs[i]` runs `tasks[i]` for `owners[i]`."""

    tasks: tuple[Task, ...]
    owners: tuple[Generation, ...]
    inputs: tuple[Input, ...]


class StepPlanner:
    """Decides each step (engine thread only)."""

    # Seven parameters: the executor and scheduler it plans for, the session book it
    # takes sessions and cells from, the ledger it reports to, the admission policy, the
    # loop's one way to end a generation, and whether (how) decodes speculate.
    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler,
        sessions: SessionBook,
        ledger: MetricsLedger,
        policy: AdmissionPolicy,
        fail: Fail,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self._executor = executor
        self._sessions = sessions
        self._ledger = ledger
        self._fail = fail
        self._admission = Admission(policy)
        self._tasks = TaskBook(scheduler)
        self._max_step_tokens = scheduler.max_batch_tokens
        self._drafts = DraftBudget(speculative) if speculative is not None else None
        self._admitted = itertools.count(1)

    # -- the queue -----------------------------------------------------------------

    @property
    def policy(self) -> AdmissionPolicy:
        return self._admission.policy

    def enqueue(self, generation: Generation) -> None:
        """A checked generation waits for a session and cells."""
        self._admission.enqueue(generation)

    def live(self) -> list[Generation]:
        """Every waiting and running generation."""
        return [*self._admission.waiting, *self._admission.running]

    def running_count(self) -> int:
        return self._admission.running_count()

    def occupancy(self) -> Occupancy:
        return self._admission.occupancy()

    def remove(self, generation: Generation) -> None:
        """An ended generation leaves the queue or the running set; a running one's
        queued tasks are cancelled."""
        state = generation.state
        if self._admission.is_running(generation) and state is not None:
            self._tasks.cancel(state.sid)
        self._admission.remove(generation)

    def clear(self) -> None:
        """Drop every queued task (shutdown)."""
        self._tasks.clear()

    def usage(self) -> KVUsage | None:
        try:
            return self._executor.kv_usage()
        except Exception:
            log.exception("executor.kv_usage() raised; admitting without a cell limit")
            return None

    # -- admission -----------------------------------------------------------------

    def admit(self) -> None:
        """Start waiting generations in queue order (priority, then arrival) while they
        can get a session and the cells they need."""
        while (generation := self._admission.head()) is not None:
            if generation.state is None and not self._give_session(generation):
                if self._admission.running_count() == 0:
                    self._fail(
                        generation,
                        f"no session available: all {len(self._sessions)} are open and idle; "
                        "close sessions or raise max_sessions",
                    )
                    continue
                return  # a running generation will free its session
            if not self._cells_for(generation):
                return
            self._begin(generation)

    def _give_session(self, generation: Generation) -> bool:
        """Find the session a submission runs on; False when none is free yet."""
        try:
            state = self._sessions.for_submission(generation)
        except Exception as exc:
            self._fail(generation, f"the executor refused a session: {exc!r}")
            return True
        if state is None:
            return False
        generation.state = state
        state.active = generation
        return True

    def _cells_for(self, generation: Generation) -> bool:
        """Whether the generation can start now; drops idle sessions' cells for it when
        nothing runs, and fails it when even that cannot make it fit."""
        usage = self.usage()
        if usage is None:
            return True
        while not self._admission.fits(generation, usage.free_cells):
            running = self._admission.preemption_victim()
            if (
                running is not None
                and running.priority > generation.priority
                and self._admission.policy is AdmissionPolicy.OPTIMISTIC
            ):
                self._preempt(running)  # a less urgent generation gives way to this one
                usage = self.usage()
                assert usage is not None
                continue
            if self._admission.running_count():
                if not generation.deferred:
                    generation.deferred = True
                    self._ledger.record(DeferredForCells())
                return False  # running generations will free cells or be preempted
            victim = self._sessions.idle_victim(self._admission.is_running, generation.state)
            reserve = self._admission.policy is AdmissionPolicy.RESERVE
            if victim is None or reserve:
                need = self._admission.need(generation)
                what = "tokens to feed + max_new_tokens" if reserve else "tokens to feed + 1"
                self._fail(
                    generation,
                    f"not enough KV cells: this turn needs {need} ({what}) but only "
                    f"{usage.free_cells} of {usage.max_cells} are free and nothing running "
                    "will release any; close idle sessions, shorten the prompt or lower "
                    "max_new_tokens",
                )
                return False
            self._reclaim(victim)
            usage = self.usage()
            assert usage is not None
        return True

    def _begin(self, generation: Generation) -> None:
        """Run the head: queue its feed (everything its session lacks) as prompt chunks."""
        state = generation.state
        assert state is not None
        first_admission = generation.status is GenerationStatus.WAITING
        self._admission.start(generation)
        generation.admitted_order = next(self._admitted)
        if first_admission:
            state.context.extend(generation.delta)
            if state.computed == len(state.context):
                # Nothing new to feed (an empty delta after a prefill turn, say): feed the
                # last token again, for the logits of the first new token.
                self._sessions.drop_cells(state, len(state.context) - 1)
            generation.metrics.prompt_tokens = len(state.context) - state.committed
            self._ledger.record(PromptFed(generation.metrics.prompt_tokens))
            try:
                self._executor.set_sampling(
                    state.sid, generation.executor_sampling(), generation.config.seed
                )
                self._executor.set_adapter(state.sid, generation.adapter_id)
            except InvalidArgumentError as exc:  # a policy or adapter the executor cannot run
                self._fail(generation, str(exc))
                return
            except Exception as exc:
                why = f"the executor raised installing the generation's policy: {exc!r}"
                self._fail(generation, why)
                return
            state.feed_with(generation.adapter_id)
        self._ledger.record(
            Admitted(self._admission.running_count(), state.committed - state.computed)
        )
        self._submit([(generation, self._tasks.prompt_tasks(generation))])

    # -- steps ---------------------------------------------------------------------

    def next_step(self) -> PlannedStep | None:
        """The next forward's work, its cells made free; None when nothing is queued,
        no tasks when every generation it had was preempted or failed for want of
        cells."""
        tasks = self._tasks.next_batch()
        if not tasks:
            return None
        if self._admission.policy is AdmissionPolicy.OPTIMISTIC:
            tasks = self._make_room(tasks)
        owned = [(task, self._tasks.take(task.tid)) for task in tasks]
        work = [(task, owner) for task, owner in owned if owner is not None]
        inputs = [task.input for task, _ in work]
        if self._drafts is not None:
            self._grant_drafts(work, inputs)
        return PlannedStep(
            tuple(task for task, _ in work),
            tuple(owner for _, owner in work),
            tuple(inputs),
        )

    def ran(self, step: PlannedStep, outputs: Sequence[Output | None], seconds: float) -> None:
        """A step ran: what its verifications kept, and its time, teach the draft budget."""
        if self._drafts is None:
            return
        base = drafted = 0
        for generation, inp, output in zip(step.owners, step.inputs, outputs, strict=True):
            base += inp.size
            if output is not None and output.drafted:
                drafted += output.drafted
                self._drafts.verified(generation, output.drafted, len(output.tokens) - 1)
        self._drafts.observe(base + drafted, seconds, base)

    def _grant_drafts(self, work: list[tuple[Task, Generation]], inputs: list[Input]) -> None:
        """Let the step's decodes verify drafts, as many as the draft budget grants
        within the step's spare tokens and free cells."""
        assert self._drafts is not None
        step_tokens = sum(inp.size for inp in inputs)
        spare = self._max_step_tokens - step_tokens
        usage = self.usage()
        if usage is not None:
            spare = min(spare, usage.free_cells - step_tokens)
        decodes = [index for index, (task, _) in enumerate(work) if task.is_decode]
        grants = self._drafts.grant([work[i][1] for i in decodes], step_tokens, spare)
        for index, granted in zip(decodes, grants, strict=True):
            if granted:
                inputs[index] = dataclasses.replace(inputs[index], max_drafts=granted)

    def decode_next(self, work: list[tuple[Generation, Token]]) -> None:
        """Queue each generation's next one-token decode of the token it was given."""
        self._submit(
            [
                (generation, [self._tasks.decode_task(generation, token, state.computed)])
                for generation, token in work
                if (state := generation.state) is not None
            ]
        )

    def _submit(self, work: list[tuple[Generation, list[Task]]]) -> None:
        for generation in self._tasks.submit(work):
            tasks = dict(work)[generation]
            self._fail(
                generation,
                f"the scheduler refused the generation's tasks ({len(tasks)} tasks, sizes "
                f"{[task.input.size for task in tasks]}); this is a bug in the runner or the "
                "scheduler's limits",
            )

    def _make_room(self, tasks: list[Task]) -> list[Task]:
        """The batch, after freeing the cells it needs (optimistic admission): idle
        sessions' cells first, then the preemption victims'. A lone generation that
        cannot fit even so fails."""
        usage = self.usage()
        while usage is not None and sum(t.input.size for t in tasks) > usage.free_cells:
            idle = self._sessions.idle_victim(self._admission.is_running, None)
            if idle is not None:
                self._reclaim(idle)
            else:
                victim = self._admission.preemption_victim()
                assert victim is not None and victim.state is not None
                sid = victim.state.sid
                if self._admission.running_count() == 1:
                    need = sum(t.input.size for t in tasks)
                    self._fail(
                        victim,
                        f"not enough KV cells: the session holds {victim.state.computed} "
                        f"and its next step needs {need} more, but the pool has "
                        f"{usage.max_cells} in all ({usage.free_cells} free); raise max_cells "
                        "or lower max_new_tokens",
                    )
                else:
                    self._preempt(victim)
                for task in tasks:
                    if task.sid == sid:
                        self._tasks.take(task.tid)  # handed out, but it will not run
                tasks = [task for task in tasks if task.sid != sid]
            usage = self.usage()
        return tasks

    def _preempt(self, generation: Generation) -> None:
        state = generation.state
        assert state is not None
        self._tasks.cancel(state.sid)
        self._sessions.drop_cells(state)
        self._admission.preempt(generation)
        self._ledger.record(Preempted())

    def _reclaim(self, state: SessionRecord) -> None:
        self._sessions.reclaim(state)
        self._ledger.record(SessionReclaimed())
