"""The batch worker: runs every batch's lines on the engine, at batch priority, and ends
each batch with its output and error files.

Owns: the tasks that run batches (one per unfinished batch, oldest first, resumed when
the server starts), the lines in flight and the sessions they hold (`Slots`: at most
`concurrency` at once, so that interactive requests always find sessions), and each
batch's life from `validating` to `completed`, `cancelled` or `expired`.
Promises: every line of a batch is answered exactly once, in its own row
(`BatchStore.answer`), whatever happens to the server: a line's answer is stored the
moment it is complete, a server killed at any moment (SIGKILL) runs again, on its next
start, exactly the lines that have no answer, and a server that stops cleanly leaves
the lines in flight unanswered for the same reason (it never stores an answer cut
short by its own stop); a line's outcome, whatever it is, never ends the batch;
cancelling a batch ends its lines in flight within a step and answers every line
without an answer with a `batch_cancelled` error; a batch past its `expires_at` answers
the rest with `batch_expired`. Lines run at BATCH_PRIORITY: an interactive request
starts ahead of them and is never fed behind them (`cellbatch.runner.admission`,
`cellbatch.scheduler`).
Never: answers HTTP (the batches route does) or runs a line itself (`LineRunner` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cellbatch.server.api import ApiError, Interrupted
from cellbatch.server.batch_lines import LineOutcome, LineRunner, failed_line
from cellbatch.server.batch_protocol import OUTPUT_PURPOSE, BatchInputLine
from cellbatch.server.batch_store import BatchRecord, BatchStore
from cellbatch.server.file_store import FileRecord, FileStore
from cellbatch.server.routing import error_body
from cellbatch.types import BATCH_PRIORITY

log = logging.getLogger(__name__)


class Slots:
    """The sessions batch lines may hold at once, taken in turn (first come, first
    served) and given back by count; giving back never waits, so a task's done callback
    can do it whatever ended the task."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def take(self, count: int) -> None:
        if not self._waiting and self.free >= count:
            self.free -= count
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((count, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.give(count)  # granted as the waiter was cancelled: hand it on
            raise

    def give(self, count: int) -> None:
        self.free += count
        while self._waiting:
            wanted, granted = self._waiting[0]
            if granted.done():  # its taker was cancelled while it waited
                self._waiting.popleft()
            elif self.free >= wanted:
                self._waiting.popleft()
                self.free -= wanted
                granted.set_result(None)
            else:
                return


@dataclass
class _Line:
    """One non-blank line of an input file: its number and what reading it gave."""

    number: int
    read: BatchInputLine | LineOutcome


class BatchWorker:
    def __init__(
        self,
        store: BatchStore,
        files: FileStore,
        lines: LineRunner,
        concurrency: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.files = files
        self.lines = lines
        self.concurrency = concurrency
        self.clock = clock
        self._slots: Slots | None = None  # made on the event loop (start)
        self._batches: dict[str, asyncio.Task[None]] = {}
        self._in_flight: dict[str, set[asyncio.Task[None]]] = {}
        self._cancelling: set[str] = set()

    def start(self) -> None:
        """Resume every unfinished batch (on the server's event loop)."""
        self._slots = Slots(self.concurrency)
        for record in self.store.unfinished():
            self.submit(record.id)

    def submit(self, batch_id: str) -> None:
        """Start running a batch (a new one, or one to resume)."""
        task = asyncio.create_task(self._run(batch_id), name=f"cellbatch-{batch_id}")
        self._batches[batch_id] = task
        task.add_done_callback(lambda _: self._batches.pop(batch_id, None))

    def cancel(self, batch_id: str) -> None:
        """The batch was moved to `cancelling`: end its lines in flight."""
        self._cancelling.add(batch_id)
        for task in list(self._in_flight.get(batch_id, ())):
            task.cancel()

    async def stop(self) -> None:
        """End every batch task; lines in flight stay unanswered (they run again when
        the server starts on the same data folder)."""
        tasks = [*self._batches.values()]
        for batch_tasks in self._in_flight.values():
            tasks.extend(batch_tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- one batch -----------------------------------------------------------------

    async def _run(self, batch_id: str) -> None:
        try:
            await self._run_batch(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a bug fails this batch alone, saying so
            log.exception("batch %s failed", batch_id)
            await asyncio.to_thread(
                self.store.fail, batch_id, [{"code": "server_error", "message": repr(error)}]
            )

    async def _run_batch(self, batch_id: str) -> None:
        record = await asyncio.to_thread(self.store.get, batch_id)
        if record is None or record.finished:
            return
        if record.status == "cancelling":
            self._cancelling.add(batch_id)
        lines = await asyncio.to_thread(self._read, record)
        if lines is None:
            return
        if record.status == "validating":
            await asyncio.to_thread(self.store.move, batch_id, "in_progress", ("validating",))
        answered = await asyncio.to_thread(self.store.answered, batch_id)
        pending = [line for line in lines if line.number not in answered]
        if record.status in ("validating", "in_progress"):
            await self._run_lines(record, pending)
        if batch_id in self._cancelling:
            await self._end(record, "cancelled", "batch_cancelled", "the batch was cancelled")
        elif self._expired(record):
            await self._end(record, "expired", "batch_expired", "the batch expired before it ran")
        else:
            await self._end(record, "completed", "", "")

    def _read(self, record: BatchRecord) -> list[_Line] | None:
        """The input file's non-blank lines, each read (None, the batch failed, when
        the file is gone). Reading is the same on every start, so duplicate custom_ids
        are told the same way."""
        file = self.files.get(record.input_file_id)
        if file is None:
            self.store.fail(
                record.id,
                [{"code": "missing_file", "message": f"the input file {record.input_file_id} "
                  "no longer exists"}],
            )  # fmt: skip
            return None
        text = self.files.path(file.id).read_bytes().decode("utf-8")
        seen: set[str] = set()
        return [
            _Line(number, self.lines.read(number, content, seen))
            for number, content in enumerate(text.split("\n"), 1)
            if content.strip()
        ]

    async def _run_lines(self, record: BatchRecord, pending: list[_Line]) -> None:
        slots = self._slots
        assert slots is not None, "BatchWorker.start() runs first"
        flying = self._in_flight.setdefault(record.id, set())
        try:
            for line in pending:
                if record.id in self._cancelling or self._expired(record):
                    break
                if isinstance(line.read, LineOutcome):
                    await self._answer(record.id, line.number, line.read)
                    continue
                weight = min(_sessions(line.read), slots.total)
                await slots.take(weight)
                if record.id in self._cancelling:
                    slots.give(weight)
                    break
                task = asyncio.create_task(self._line(record.id, line, line.read))
                flying.add(task)
                task.add_done_callback(flying.discard)
                task.add_done_callback(functools.partial(_give_back, slots, weight))
            while flying:
                await asyncio.gather(*flying, return_exceptions=True)
        finally:
            self._in_flight.pop(record.id, None)

    async def _line(self, batch_id: str, line: _Line, request: BatchInputLine) -> None:
        cancelled = failed_line(
            request.custom_id, "batch_cancelled", "the batch was cancelled while it ran"
        )
        try:
            outcome = await self.lines.run(request, BATCH_PRIORITY)
        except asyncio.CancelledError:
            if batch_id not in self._cancelling:
                raise  # the worker stops: the line stays unanswered
            outcome = cancelled
        except Interrupted:
            if batch_id not in self._cancelling:
                return  # the engine stopped under it: left for the next start
            outcome = cancelled
        except Exception as error:  # a bug fails this line alone
            log.exception("batch %s, line %d failed", batch_id, line.number)
            failure = ApiError(500, f"internal error: {error!r}", kind="server_error")
            outcome = LineOutcome(request.custom_id, 500, error_body(failure).model_dump())
        await self._answer(batch_id, line.number, outcome)

    async def _answer(self, batch_id: str, number: int, outcome: LineOutcome) -> None:
        await asyncio.to_thread(
            self.store.answer, batch_id, number, outcome.ok, outcome.line(), outcome.usage
        )

    def _expired(self, record: BatchRecord) -> bool:
        return record.expires_at is not None and self.clock() >= record.expires_at

    async def _end(self, record: BatchRecord, status: str, code: str, message: str) -> None:
        """Answer the lines still without one (cancelled or expired: with `code`), then
        write the output and error files and end the batch in `status`."""
        batch_id = record.id
        if code:
            lines = await asyncio.to_thread(self._read, record)
            answered = await asyncio.to_thread(self.store.answered, batch_id)
            for line in lines or ():
                if line.number in answered:
                    continue
                read = line.read  # a malformed line keeps its own error
                outcome = (
                    failed_line(read.custom_id, code, message)
                    if isinstance(read, BatchInputLine)
                    else read
                )
                await self._answer(batch_id, line.number, outcome)
        else:
            finalizing = await asyncio.to_thread(
                self.store.move, batch_id, "finalizing", ("in_progress", "finalizing")
            )
            if not finalizing:  # cancelled after its last line ran: it ends cancelled
                self._cancelling.add(batch_id)
                await self._end(record, "cancelled", "batch_cancelled", "the batch was cancelled")
                return
        output, errors = await asyncio.to_thread(self._write_files, record)
        await asyncio.to_thread(self.store.finish, batch_id, status, output, errors)
        self._cancelling.discard(batch_id)

    def _write_files(self, record: BatchRecord) -> tuple[FileRecord | None, FileRecord | None]:
        """The output file (lines answered 200) and the error file (the others), each
        only when it has lines; their records are committed with the batch's end."""
        good: list[str] = []
        bad: list[str] = []
        for ok, line in self.store.answers(record.id):
            (good if ok else bad).append(line)
        expires = None
        if record.output_expires_after is not None:
            expires = int(self.clock()) + record.output_expires_after
        files = []
        for lines, kind in ((good, "output"), (bad, "error")):
            content = "".join(line + "\n" for line in lines).encode()
            name = f"{record.id}_{kind}.jsonl"
            written = self.files.write(content, name, OUTPUT_PURPOSE, expires) if lines else None
            files.append(written)
        return files[0], files[1]


def _sessions(line: BatchInputLine) -> int:
    """The sessions a line's request holds at once: its choices, or its inputs."""
    body = line.body
    if line.url == "/v1/embeddings":
        inputs = body.get("input")
        many = isinstance(inputs, list) and inputs and not isinstance(inputs[0], int)
        return len(inputs) if many and isinstance(inputs, list) else 1
    n = body.get("n", 1)
    return n if isinstance(n, int) and n > 1 else 1


def _give_back(slots: Slots, count: int, _task: asyncio.Task[None]) -> None:
    """A line task's done callback: its sessions go back however the task ended (also
    when it was cancelled before it ran)."""
    slots.give(count)
