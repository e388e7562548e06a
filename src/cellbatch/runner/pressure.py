"""KV pressure: freeing cells for the work that needs them (engine thread only).

Owns: no state of its own; it acts on the session book, the admission queue and the
task book when cells run short.
Promises: an idle session's cells are dropped before a running generation's (least
recently used first); a running generation gives way only under "optimistic"
admission, the least urgent first and the newest among those, going back to the head
of the queue with its queued tasks cancelled and its cells dropped (its context is
recomputed when it resumes), either for a step that lacks cells or for a more urgent
generation that waits for cells (never for an equally or less urgent one); a
generation that cannot fit even with everything else freed fails with the numbers,
alone. Every drop, deferral and preemption is recorded as an event in the ledger.
Never: runs a step or settles a generation itself (failures go to the `fail`
callback it is given); holds the metrics or their lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cellbatch.executor import Executor
from cellbatch.metrics import DeferredForCells, MetricsLedger, Preempted, SessionReclaimed
from cellbatch.runner.admission import Admission, AdmissionPolicy
from cellbatch.runner.generation import Generation, SessionRecord
from cellbatch.runner.sessions import SessionBook
from cellbatch.runner.tasks import TaskBook
from cellbatch.types import KVUsage, Task

log = logging.getLogger(__name__)


class KVPressure:
    # Six parameters: the executor and the loop's books it frees cells from, the ledger
    # it reports to, and the loop's one way to end a generation.
    def __init__(
        self,
        executor: Executor,
        sessions: SessionBook,
        admission: Admission,
        tasks: TaskBook,
        ledger: MetricsLedger,
        fail: Callable[[Generation, str], None],
    ) -> None:
        self._executor = executor
        self._sessions = sessions
        self._admission = admission
        self._tasks = tasks
        self._ledger = ledger
        self._fail = fail

    def usage(self) -> KVUsage | None:
        try:
            return self._executor.kv_usage()
        except Exception:
            log.exception("executor.kv_usage() raised; admitting without a cell limit")
            return None

    def cells_for(self, generation: Generation) -> bool:
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

    def make_room(self, tasks: list[Task]) -> list[Task]:
        """The batch, after freeing the cells it needs (optimistic admission): idle
        sessions' cells first, then running generations' (`preemption_victim`). A lone
        generation that cannot fit even so fails."""
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
                        f"not enough KV cells: the session holds {victim.state.resident} "
                        f"and its next step needs {need} more, but the pool has "
                        f"{usage.max_cells} in all ({usage.free_cells} free); raise max_cells "
                        "or lower max_new_tokens",
                    )
                else:
                    self._preempt(victim)
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
