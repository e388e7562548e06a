"""Which queued tasks run in the next forward (docs/design.md#scheduler).

Owns: the queue of submitted tasks (decodes in arrival order, prompt chunks per
session) and the rotation of sessions that have prompt chunks waiting.
Promises: `submit` is all-or-nothing; every accepted task leaves exactly once,
through `get_work`, `cancel` or `clear`; a batch never exceeds the token budget,
holds at most `max_decode_sequences` decodes and at most one output-producing
input per session; while a prompt chunk of some priority waits (`Task.priority`,
lower first), no task of a less urgent priority joins a batch (they keep their
places), so a more urgent prompt is fed in steps of its own kind of work only;
every public method takes one lock. `get_work` costs what it
hands out plus the sessions and held-back decodes it passes over (and entries
left stale by `cancel`), never a scan of everything queued.
Never: touches tensors, models, payloads or callbacks, and does no I/O.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from cellbatch.types import InvalidArgumentError, SessionId, Task, TaskId


@runtime_checkable
class Scheduler(Protocol):
    """What the runner needs from a scheduler; every method is thread-safe."""

    def submit(self, tasks: Sequence[Task]) -> bool: ...

    def get_work(self) -> list[Task]: ...

    def cancel(self, sid: SessionId) -> list[Task]: ...

    def clear(self) -> list[Task]: ...

    def has_work(self) -> bool: ...

    @property
    def max_prefill_chunk(self) -> int: ...

    @property
    def max_batch_tokens(self) -> int: ...


@dataclass(eq=False)
class _Entry:
    """One accepted submission of a task. Compared by identity: a stale entry left
    behind by `cancel` is told apart from a later submission of the same tid."""

    task: Task


@dataclass(eq=False)
class _PromptQueue:
    """A session's waiting prompt chunks, in submission order; its place in the
    rotation. Compared by identity: a queue dropped by `cancel` stays in the
    rotation as a stale entry and is skipped, never mistaken for a new one."""

    sid: SessionId
    chunks: deque[Task] = field(default_factory=deque)


class DecodeFirstScheduler:
    """Decodes first (arrival order, one per session), then prompt chunks in fair
    passes over a rotation of sessions, up to `max_batch_tokens` tokens."""

    def __init__(
        self,
        max_batch_tokens: int = 544,
        max_decode_sequences: int = 32,
        max_prefill_chunk: int = 256,
    ) -> None:
        for name, value in (
            ("max_batch_tokens", max_batch_tokens),
            ("max_decode_sequences", max_decode_sequences),
            ("max_prefill_chunk", max_prefill_chunk),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
        if max_decode_sequences >= max_batch_tokens:
            raise InvalidArgumentError(
                f"max_decode_sequences ({max_decode_sequences}) must be below max_batch_tokens "
                f"({max_batch_tokens}) so that prompt chunks can run; raise max_batch_tokens "
                "or lower max_decode_sequences"
            )
        room = max_batch_tokens - max_decode_sequences
        if max_prefill_chunk > room:
            # Otherwise a full chunk beside a saturated decode set never fits and
            # an admitted prompt could wait forever.
            raise InvalidArgumentError(
                f"max_prefill_chunk ({max_prefill_chunk}) must fit beside a full "
                f"decode set: at most max_batch_tokens - max_decode_sequences = {room}; "
                f"lower it to {room} or raise max_batch_tokens to "
                f"{max_decode_sequences + max_prefill_chunk}"
            )
        self._max_batch_tokens = max_batch_tokens
        self._max_decode_sequences = max_decode_sequences
        self._max_prefill_chunk = max_prefill_chunk
        self._lock = threading.Lock()
        # Invariant: a tid is in _queued iff its task is waiting; _session_tasks
        # holds the same entries grouped by session, in submission order.
        self._queued: dict[TaskId, _Entry] = {}
        self._session_tasks: dict[SessionId, dict[TaskId, _Entry]] = {}
        # Decode entries in arrival order; an entry no longer in _queued is stale.
        self._decodes: deque[_Entry] = deque()
        # Invariant: a session is in _prompt_queues iff it has waiting chunks, and
        # then its queue is in _rotation exactly once; other rotation entries are stale.
        self._prompt_queues: dict[SessionId, _PromptQueue] = {}
        self._rotation: deque[_PromptQueue] = deque()

    @classmethod
    def create(
        cls,
        max_batch_tokens: int = 544,
        max_decode_sequences: int = 32,
        max_prefill_chunk: int = 256,
    ) -> DecodeFirstScheduler:
        """Raises InvalidArgumentError for a limit that is not positive, a decode
        cap not below the budget, or a chunk that cannot fit beside full decodes."""
        return cls(max_batch_tokens, max_decode_sequences, max_prefill_chunk)

    @property
    def max_batch_tokens(self) -> int:
        return self._max_batch_tokens

    @property
    def max_decode_sequences(self) -> int:
        return self._max_decode_sequences

    @property
    def max_prefill_chunk(self) -> int:
        return self._max_prefill_chunk

    def submit(self, tasks: Sequence[Task]) -> bool:
        """Queue every task, or none (False) if any is empty, a decode wider than
        one token, a chunk wider than `max_prefill_chunk`, or reuses a tid
        that is queued or repeated in this call."""
        with self._lock:
            seen: set[TaskId] = set()
            for task in tasks:
                widest = 1 if task.is_decode else self._max_prefill_chunk
                if not 0 < task.input.size <= widest:
                    return False
                if task.tid in self._queued or task.tid in seen:
                    return False
                seen.add(task.tid)
            for task in tasks:
                entry = _Entry(task)
                self._queued[task.tid] = entry
                self._session_tasks.setdefault(task.sid, {})[task.tid] = entry
                if task.is_decode:
                    self._decodes.append(entry)
                    continue
                queue = self._prompt_queues.get(task.sid)
                if queue is None:
                    # The only place a session joins the rotation: one place per queue.
                    queue = self._prompt_queues[task.sid] = _PromptQueue(task.sid)
                    self._rotation.append(queue)
                queue.chunks.append(task)
            return True

    def get_work(self) -> list[Task]:
        """The next batch: decodes first, then prompt chunks; empty when idle. While a
        prompt chunk waits, only tasks at least as urgent as the most urgent such chunk
        are taken."""
        with self._lock:
            limit = min(
                (queue.chunks[0].priority for queue in self._prompt_queues.values()),
                default=None,
            )
            batch = self._take_decodes(limit)
            decode_sids = {task.sid for task in batch}
            self._take_chunks(batch, decode_sids, self._max_batch_tokens - len(batch), limit)
            return batch

    def cancel(self, sid: SessionId) -> list[Task]:
        """Remove the session's waiting tasks and return them marked cancelled, in
        submission order; tasks already handed out are not returned."""
        with self._lock:
            entries = self._session_tasks.pop(sid, {})
            for tid in entries:
                del self._queued[tid]
            # Its decode and rotation entries go stale and are skipped when reached.
            self._prompt_queues.pop(sid, None)
            return [replace(entry.task, cancelled=True) for entry in entries.values()]

    def clear(self) -> list[Task]:
        """Remove and return every waiting task, in submission order."""
        with self._lock:
            removed = [entry.task for entry in self._queued.values()]
            self._queued.clear()
            self._session_tasks.clear()
            self._decodes.clear()
            self._prompt_queues.clear()
            self._rotation.clear()
            return removed

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._queued)

    def _dequeue(self, task: Task) -> None:
        del self._queued[task.tid]
        session = self._session_tasks[task.sid]
        del session[task.tid]
        if not session:
            del self._session_tasks[task.sid]

    def _take_decodes(self, limit: int | None) -> list[Task]:
        batch: list[Task] = []
        taken_sids: set[SessionId] = set()
        # A session's second decode waits for the next batch; so do decodes less urgent
        # than `limit`.
        held_back: list[_Entry] = []
        while self._decodes and len(batch) < self._max_decode_sequences:
            entry = self._decodes.popleft()
            task = entry.task
            if self._queued.get(task.tid) is not entry:
                continue
            if task.sid in taken_sids or (limit is not None and task.priority > limit):
                held_back.append(entry)
                continue
            taken_sids.add(task.sid)
            self._dequeue(task)
            batch.append(task)
        self._decodes.extendleft(reversed(held_back))
        return batch

    def _take_chunks(
        self, batch: list[Task], decode_sids: set[SessionId], budget: int, limit: int | None
    ) -> None:
        passed_over: list[_PromptQueue] = []  # rejoin the front, in their order
        done_for_batch: list[_PromptQueue] = []  # output already in this batch; rejoin the back
        left_in_pass = len(self._rotation)
        served_in_pass = False
        while budget > 0 and left_in_pass > 0:
            queue = self._rotation.popleft()
            left_in_pass -= 1
            if self._prompt_queues.get(queue.sid) is queue:
                chunk = queue.chunks[0]
                less_urgent = limit is not None and chunk.priority > limit
                if queue.sid in decode_sids or chunk.input.size > budget or less_urgent:
                    # Budget only shrinks, so this session is out for the rest of the batch.
                    passed_over.append(queue)
                else:
                    queue.chunks.popleft()
                    self._dequeue(chunk)
                    batch.append(chunk)
                    budget -= chunk.input.size
                    served_in_pass = True
                    if not queue.chunks:
                        del self._prompt_queues[queue.sid]
                    elif chunk.input.produce_output:
                        # At most one output-producing input per session per batch.
                        done_for_batch.append(queue)
                    else:
                        self._rotation.append(queue)
            if left_in_pass == 0 and served_in_pass:
                # The next pass visits exactly the sessions served in this one.
                left_in_pass = len(self._rotation)
                served_in_pass = False
        self._rotation.extendleft(reversed(passed_over))
        self._rotation.extend(done_for_batch)
