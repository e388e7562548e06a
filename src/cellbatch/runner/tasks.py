"""The runner's book of scheduled tasks (engine thread only).

Owns: task ids (issued monotonically, never reused) and which generation each queued
or in-flight task belongs to; the cutting of a turn's feed into prompt chunks.
Promises: every task handed to the scheduler is in the book until its step has run,
its session's queued tasks were cancelled, or the book was cleared; a turn's chunks
share one base position with increasing offsets, at most `max_prefill_chunk` each,
and only the last asks for output (none for a prefill turn); every task carries its
generation's priority.
Never: decides what runs or when; the step planner (through the scheduler) does.
"""

from __future__ import annotations

import itertools
import logging

from cellbatch.runner.generation import Generation
from cellbatch.scheduler import Scheduler
from cellbatch.types import Input, SessionId, Task, TaskId, Token

log = logging.getLogger(__name__)


class TaskBook:
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._owner: dict[TaskId, Generation] = {}
        self._tids = itertools.count()
        self._max_prefill_chunk = scheduler.max_prefill_chunk

    def prompt_tasks(self, generation: Generation) -> list[Task]:
        """The chunks that feed everything the generation's session lacks."""
        state = generation.state
        assert state is not None
        feed = tuple(state.context[state.computed :])
        size, chunk = len(feed), self._max_prefill_chunk
        return [
            Task(
                next(self._tids),
                Input(
                    state.sid,
                    not generation.feeds_only and offset + chunk >= size,
                    offset,
                    min(chunk, size - offset),
                    feed,
                    state.computed,
                ),
                is_decode=False,
                priority=generation.priority,
            )
            for offset in range(0, size, chunk)
        ]

    def next_batch(self) -> list[Task]:
        """The scheduler's next batch: decodes first, then prompt chunks."""
        return self._scheduler.get_work()

    def decode_task(self, generation: Generation, token: Token, position: int) -> Task:
        """The generation's next one-token decode on its session."""
        assert generation.state is not None
        sid = generation.state.sid
        return Task(
            next(self._tids),
            Input(sid, True, 0, 1, (token,), position),
            is_decode=True,
            priority=generation.priority,
        )

    def submit(self, work: list[tuple[Generation, list[Task]]]) -> list[Generation]:
        """Queue each generation's tasks; returns the generations whose tasks the
        scheduler refused. One call for the common case, one per generation to find
        the culprit when the scheduler refuses the lot."""
        if self._accepts([task for _, tasks in work for task in tasks]):
            self._own(work)
            return []
        refused = []
        for generation, tasks in work:
            if len(work) > 1 and self._accepts(tasks):
                self._own([(generation, tasks)])
            else:
                refused.append(generation)
        return refused

    def take(self, tid: TaskId) -> Generation | None:
        """The owner of a task whose step has run; the task leaves the book."""
        return self._owner.pop(tid, None)

    def cancel(self, sid: SessionId) -> None:
        """Drop the session's queued tasks (the scheduler's and the book's)."""
        for task in self._scheduler.cancel(sid):
            self._owner.pop(task.tid, None)

    def clear(self) -> None:
        self._scheduler.clear()
        self._owner.clear()

    def _own(self, work: list[tuple[Generation, list[Task]]]) -> None:
        for generation, tasks in work:
            for task in tasks:
                self._owner[task.tid] = generation

    def _accepts(self, tasks: list[Task]) -> bool:
        try:
            return self._scheduler.submit(tasks)
        except Exception:
            log.exception("scheduler.submit raised")
            return False
