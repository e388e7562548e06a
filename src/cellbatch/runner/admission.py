"""Admission: which waiting generations start, and which running one gives way.

Owns: the queue of generations waiting to run (by priority, lower first, then arrival
order; a preempted one goes back to the head of its priority) and the running
generations in the order they were admitted; `Occupancy`, how many of each there are
at one moment.
Promises: first come, first served within a priority: the head of the queue starts
before anything behind it, and a more urgent generation (`GenConfig.priority`) waits
ahead of every less urgent one; under "optimistic" admission (the default) a
generation starts when the cells it needs now fit beside a growth reserve of
GROWTH_CELLS per generation that would then be running, and the one preempted when
cells run short is the least urgent running generation, the most recently admitted of
those; under "reserve" a generation starts only when its
worst case (what it feeds plus every token it may generate) fits beside the worst
cases of those running, and nothing is ever preempted.
Never: calls the executor or the scheduler, or ends a generation; the step planner
acts on what this decides.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import NamedTuple

from cellbatch.runner.generation import Generation, GenerationStatus

# Free cells kept per running generation when another starts under optimistic admission.
# Without them a pool refills within a step or two of a start, and the generation that
# started (the newest, so the one preempted) recomputes its whole context for those few
# tokens; with them every start buys at least this many steps before a preemption.
# Measured (64 chat generations of up to 256 tokens, fp32, one engine, /tmp A/B of this
# constant): in a pool of 4 worst cases, 1 / 16 / 32 cells gave 95 / 48 / 19 preemptions,
# 11249 / 6913 / 3393 recomputed tokens and 92 / 93 / 101 tokens/s, the same tokens; in
# a pool of 16 worst cases preemptions stayed at 18-19 whatever the value.
GROWTH_CELLS = 32


class AdmissionPolicy(str, enum.Enum):
    OPTIMISTIC = "optimistic"
    RESERVE = "reserve"


def cells_to_feed(generation: Generation) -> int:
    """Cells the generation's session still has to fill before its next token:
    context not in the executor's cells, plus the delta if the turn has not begun."""
    state = generation.state
    assert state is not None
    pending_delta = 0 if generation.admitted else len(generation.delta)
    return len(state.context) - state.computed + pending_delta


class Occupancy(NamedTuple):
    """Generations running and waiting at one moment (a tuple: `running, waiting = ...`)."""

    running: int
    waiting: int


class Admission:
    """The waiting queue and the running set (engine thread only)."""

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy
        self.waiting: deque[Generation] = deque()
        self._running: dict[Generation, None] = {}  # insertion order = admission order

    @property
    def running(self) -> list[Generation]:
        return list(self._running)

    def running_count(self) -> int:
        return len(self._running)

    def occupancy(self) -> Occupancy:
        return Occupancy(len(self._running), len(self.waiting))

    def is_running(self, generation: Generation) -> bool:
        return generation in self._running

    def enqueue(self, generation: Generation) -> None:
        generation.move(GenerationStatus.WAITING)
        self._queue(generation, first_of_priority=False)

    def head(self) -> Generation | None:
        return self.waiting[0] if self.waiting else None

    def start(self, generation: Generation) -> None:
        """The head starts running."""
        assert self.waiting and self.waiting[0] is generation
        self.waiting.popleft()
        generation.move(GenerationStatus.RUNNING)
        self._running[generation] = None

    def preempt(self, generation: Generation) -> None:
        """A running generation goes back to the head of the queue (of its priority)."""
        del self._running[generation]
        generation.move(GenerationStatus.PREEMPTED)
        self._queue(generation, first_of_priority=True)

    def _queue(self, generation: Generation, first_of_priority: bool) -> None:
        """Behind every more urgent waiting generation and ahead of every less urgent
        one; among its equals, last (arrival order) or first (a preempted one)."""
        waiting, priority = self.waiting, generation.priority
        if not waiting or (not first_of_priority and waiting[-1].priority <= priority):
            waiting.append(generation)  # the common case: one priority, arrival order
            return
        for index, other in enumerate(waiting):
            if other.priority > priority or (first_of_priority and other.priority == priority):
                waiting.insert(index, generation)
                return
        waiting.append(generation)

    def remove(self, generation: Generation) -> None:
        """A generation that ended leaves, wherever it was."""
        if generation in self._running:
            del self._running[generation]
        elif generation in self.waiting:
            self.waiting.remove(generation)

    def preemption_victim(self) -> Generation | None:
        """The running generation to give its cells up first: the least urgent, the
        most recently admitted of those."""
        victim: Generation | None = None
        for generation in reversed(self._running):
            if victim is None or generation.priority > victim.priority:
                victim = generation
        return victim

    def need(self, generation: Generation) -> int:
        """Cells the generation must find free to start: what it feeds now, and under
        "reserve" also every token it may still generate."""
        need = cells_to_feed(generation)
        if self.policy is AdmissionPolicy.RESERVE and not generation.feeds_only:
            need += generation.config.max_new_tokens - generation.metrics.generated_tokens
        return need

    def spoken_for(self) -> int:
        """Free cells the running generations will claim: their unfed context, plus
        under "reserve" their remaining token budgets, and under "optimistic" a growth
        reserve each."""
        claimed = 0
        for generation in self._running:
            claimed += self.need(generation)
            if self.policy is AdmissionPolicy.OPTIMISTIC:
                claimed += GROWTH_CELLS
        return claimed

    def fits(self, generation: Generation, free_cells: int) -> bool:
        """Whether the generation can start with `free_cells` cells free now. A
        generation that would run alone needs only its feed and one decode cell: it
        must be able to start in any pool that holds it."""
        headroom = 0
        if self.policy is AdmissionPolicy.OPTIMISTIC:
            headroom = GROWTH_CELLS if self._running else 1
        return self.need(generation) + headroom <= free_cells - self.spoken_for()
