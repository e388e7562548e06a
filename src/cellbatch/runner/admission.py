"""Admission: which waiting generations start, and which running one gives way.

Owns: the queue of generations waiting to run (arrival order; a preempted one goes
back to its head) and the running generations in the order they were admitted.
Promises: first come, first served: the head of the queue starts before anything
behind it; under "optimistic" admission (the default) a generation starts when the
cells it needs now fit (what it feeds, plus one decode cell per running generation),
and the most recently admitted running generation is the one preempted when a step
lacks cells; under "reserve" a generation starts only when its worst case (what it
feeds plus every token it may generate) fits beside the worst cases of those
running, and nothing is ever preempted.
Never: calls the executor or the scheduler, or ends a generation; the runner loop
acts on what this decides.
"""

from __future__ import annotations

import enum
from collections import deque

from cellbatch.runner.generation import Generation


class AdmissionPolicy(str, enum.Enum):
    OPTIMISTIC = "optimistic"
    RESERVE = "reserve"


def cells_to_feed(generation: Generation) -> int:
    """Cells the generation's session still has to fill before its next token:
    context not in the executor's cells, plus the delta if the turn has not begun."""
    state = generation.state
    assert state is not None
    pending_delta = 0 if generation.started else len(generation.delta)
    return len(state.context) - state.resident + pending_delta


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

    def is_running(self, generation: Generation) -> bool:
        return generation in self._running

    def enqueue(self, generation: Generation) -> None:
        self.waiting.append(generation)

    def head(self) -> Generation | None:
        return self.waiting[0] if self.waiting else None

    def start(self, generation: Generation) -> None:
        """The head starts running."""
        assert self.waiting and self.waiting[0] is generation
        self.waiting.popleft()
        self._running[generation] = None

    def preempt(self, generation: Generation) -> None:
        """A running generation goes back to the head of the queue."""
        del self._running[generation]
        self.waiting.appendleft(generation)

    def remove(self, generation: Generation) -> None:
        """A generation that ended leaves, wherever it was."""
        if generation in self._running:
            del self._running[generation]
        elif generation in self.waiting:
            self.waiting.remove(generation)

    def newest_running(self) -> Generation | None:
        return next(reversed(self._running), None)

    def need(self, generation: Generation) -> int:
        """Cells the generation must find free to start: what it feeds now, and under
        "reserve" also every token it may still generate."""
        need = cells_to_feed(generation)
        if self.policy is AdmissionPolicy.RESERVE and not generation.feed_only:
            need += generation.config.max_new_tokens - generation.metrics.generated_tokens
        return need

    def spoken_for(self) -> int:
        """Free cells the running generations will claim: their unfed context, plus
        under "reserve" their remaining token budgets, and under "optimistic" one
        decode cell each."""
        claimed = 0
        for generation in self._running:
            claimed += self.need(generation)
            if self.policy is AdmissionPolicy.OPTIMISTIC:
                claimed += 1
        return claimed

    def fits(self, generation: Generation, free_cells: int) -> bool:
        """Whether the generation can start with `free_cells` cells free now."""
        headroom = 1 if self.policy is AdmissionPolicy.OPTIMISTIC else 0
        return self.need(generation) + headroom <= free_cells - self.spoken_for()
