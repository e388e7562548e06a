"""Batches as the server's database keeps them: each batch's state and each answered line.

Owns: the `batches` table (one row per batch: its status and timestamps, request counts,
token usage, output and error files) and `batch_answers` (one row per answered line of
a batch: whether it succeeded and the line written for it), and the ids
(`batch_` and 32 hex digits).
Promises: a line is answered at most once (`answer` refuses a second answer to the same
line, and counts only the first), in the transaction that counts it, so a server
killed at any moment and restarted knows exactly which lines to run again; a batch's
output and error files become visible in the transaction that ends it (`finish`);
lists run newest first, as OpenAI's do.
Never: runs lines or reads input files (the batch worker does), or knows HTTP.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from cellbatch.server.batch_protocol import (
    TERMINAL_STATUSES,
    BatchErrors,
    BatchObject,
    BatchRequestCounts,
    BatchUsage,
    InputTokensDetails,
    Usage,
)
from cellbatch.server.file_store import FileRecord, FileStore
from cellbatch.server.storage import Storage

FEATURE = "batches"
STEPS = (
    """
    CREATE TABLE batches (
        id TEXT PRIMARY KEY,
        endpoint TEXT NOT NULL,
        model TEXT,
        input_file_id TEXT NOT NULL,
        completion_window TEXT NOT NULL,
        status TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        in_progress_at INTEGER,
        expires_at INTEGER,
        finalizing_at INTEGER,
        completed_at INTEGER,
        failed_at INTEGER,
        expired_at INTEGER,
        cancelling_at INTEGER,
        cancelled_at INTEGER,
        output_file_id TEXT,
        error_file_id TEXT,
        total INTEGER NOT NULL DEFAULT 0,
        completed INTEGER NOT NULL DEFAULT 0,
        failed INTEGER NOT NULL DEFAULT 0,
        input_tokens INTEGER NOT NULL DEFAULT 0,
        cached_tokens INTEGER NOT NULL DEFAULT 0,
        output_tokens INTEGER NOT NULL DEFAULT 0,
        metadata TEXT,
        errors TEXT,
        output_expires_after INTEGER
    );
    CREATE TABLE batch_answers (
        batch_id TEXT NOT NULL,
        line INTEGER NOT NULL,
        ok INTEGER NOT NULL,
        answer TEXT NOT NULL,
        PRIMARY KEY (batch_id, line)
    );
    """,
)

# Each status's timestamp column, set when the batch enters it.
STATUS_TIMES = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "expired": "expired_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}


@dataclass(frozen=True)
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int | None
    model: str | None = None
    times: dict[str, int | None] = field(default_factory=dict)  # STATUS_TIMES' columns
    output_file_id: str | None = None
    error_file_id: str | None = None
    counts: BatchRequestCounts = field(default_factory=BatchRequestCounts)
    usage: Usage = field(default_factory=Usage)
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None  # why a batch failed as a whole
    output_expires_after: int | None = None  # seconds its output files live

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def object(self) -> BatchObject:
        usage = self.usage
        return BatchObject(
            id=self.id,
            endpoint=self.endpoint,
            model=self.model,
            errors=BatchErrors.model_validate({"data": self.errors}) if self.errors else None,
            input_file_id=self.input_file_id,
            completion_window=self.completion_window,
            status=self.status,  # type: ignore[arg-type]  # one of BatchStatus, as stored
            output_file_id=self.output_file_id,
            error_file_id=self.error_file_id,
            created_at=self.created_at,
            expires_at=self.expires_at,
            request_counts=self.counts,
            usage=BatchUsage(
                input_tokens=usage.input_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
                output_tokens=usage.output_tokens,
                total_tokens=usage.input_tokens + usage.output_tokens,
            ),
            metadata=self.metadata,
            **self.times,  # type: ignore[arg-type]  # STATUS_TIMES' columns: int | None
        )


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


class BatchStore:
    def __init__(self, storage: Storage, files: FileStore) -> None:
        self.storage = storage
        self.files = files
        storage.migrate(FEATURE, STEPS)

    def create(self, record: BatchRecord) -> BatchRecord:
        with self.storage.transaction() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, model, input_file_id, completion_window, "
                "status, created_at, expires_at, total, metadata, errors, "
                "output_expires_after) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.endpoint,
                    record.model,
                    record.input_file_id,
                    record.completion_window,
                    record.status,
                    record.created_at,
                    record.expires_at,
                    record.counts.total,
                    json.dumps(record.metadata) if record.metadata is not None else None,
                    json.dumps(record.errors) if record.errors is not None else None,
                    record.output_expires_after,
                ),
            )
            if record.status in STATUS_TIMES:
                self._enter(db, record.id, record.status, record.created_at)
        found = self.get(record.id)
        assert found is not None
        return found

    def get(self, batch_id: str) -> BatchRecord | None:
        with self.storage.transaction() as db:
            row = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else _record(row)

    def page(self, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """Up to `limit` batches, newest first, older than the batch `after`; and
        whether more follow."""
        where, values = "", []
        if after is not None:
            where = "WHERE rowid < (SELECT rowid FROM batches WHERE id = ?)"
            values.append(after)
        with self.storage.transaction() as db:
            rows = db.execute(
                f"SELECT * FROM batches {where} ORDER BY rowid DESC LIMIT ?",
                (*values, limit + 1),
            ).fetchall()
        records = [_record(row) for row in rows]
        return records[:limit], len(records) > limit

    def unfinished(self) -> list[BatchRecord]:
        """The batches still to run or end, oldest first."""
        marks = ", ".join("?" * len(TERMINAL_STATUSES))
        with self.storage.transaction() as db:
            rows = db.execute(
                f"SELECT * FROM batches WHERE status NOT IN ({marks}) ORDER BY rowid",
                TERMINAL_STATUSES,
            ).fetchall()
        return [_record(row) for row in rows]

    def using_file(self, file_id: str) -> str | None:
        """An unfinished batch that reads `file_id`, if any."""
        marks = ", ".join("?" * len(TERMINAL_STATUSES))
        with self.storage.transaction() as db:
            row = db.execute(
                f"SELECT id FROM batches WHERE input_file_id = ? "
                f"AND status NOT IN ({marks}) LIMIT 1",
                (file_id, *TERMINAL_STATUSES),
            ).fetchone()
        return None if row is None else str(row["id"])

    def move(self, batch_id: str, status: str, allowed: tuple[str, ...]) -> bool:
        """Put the batch in `status` (and stamp its time) if it is in one of `allowed`;
        False when it was not."""
        marks = ", ".join("?" * len(allowed))
        with self.storage.transaction() as db:
            moved = (
                db.execute(
                    f"UPDATE batches SET status = ? WHERE id = ? AND status IN ({marks})",
                    (status, batch_id, *allowed),
                ).rowcount
                > 0
            )
            if moved and status in STATUS_TIMES:
                self._enter(db, batch_id, status, int(time.time()))
        return moved

    def answered(self, batch_id: str) -> set[int]:
        with self.storage.transaction() as db:
            rows = db.execute("SELECT line FROM batch_answers WHERE batch_id = ?", (batch_id,))
            return {int(row["line"]) for row in rows}

    def answer(self, batch_id: str, line: int, ok: bool, answer: str, usage: Usage) -> bool:
        """Record the answer to one line and count it; False (nothing changed) when the
        line was answered already."""
        with self.storage.transaction() as db:
            added = (
                db.execute(
                    "INSERT OR IGNORE INTO batch_answers (batch_id, line, ok, answer) "
                    "VALUES (?, ?, ?, ?)",
                    (batch_id, line, int(ok), answer),
                ).rowcount
                > 0
            )
            if added:
                db.execute(
                    "UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                    "input_tokens = input_tokens + ?, cached_tokens = cached_tokens + ?, "
                    "output_tokens = output_tokens + ? WHERE id = ?",
                    (
                        int(ok),
                        int(not ok),
                        usage.input_tokens,
                        usage.cached_tokens,
                        usage.output_tokens,
                        batch_id,
                    ),
                )
        return added

    def answers(self, batch_id: str) -> Iterator[tuple[bool, str]]:
        """(ok, the line written) of every answered line, in the input file's order."""
        with self.storage.transaction() as db:
            rows = db.execute(
                "SELECT ok, answer FROM batch_answers WHERE batch_id = ? ORDER BY line",
                (batch_id,),
            ).fetchall()
        for row in rows:
            yield bool(row["ok"]), str(row["answer"])

    def finish(
        self, batch_id: str, status: str, output: FileRecord | None, errors: FileRecord | None
    ) -> None:
        """End the batch in `status`, its output and error files made visible with it."""
        with self.storage.transaction() as db:
            for record in (output, errors):
                if record is not None:
                    self.files.insert(db, record)
            db.execute(
                "UPDATE batches SET status = ?, output_file_id = ?, error_file_id = ? WHERE id = ?",
                (
                    status,
                    output.id if output else None,
                    errors.id if errors else None,
                    batch_id,
                ),
            )
            self._enter(db, batch_id, status, int(time.time()))

    def fail(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        """End the batch `failed` as a whole, saying why (OpenAI's `errors`)."""
        with self.storage.transaction() as db:
            db.execute(
                "UPDATE batches SET status = 'failed', errors = ? WHERE id = ?",
                (json.dumps(errors), batch_id),
            )
            self._enter(db, batch_id, "failed", int(time.time()))

    def set_total(self, batch_id: str, total: int) -> None:
        with self.storage.transaction() as db:
            db.execute("UPDATE batches SET total = ? WHERE id = ?", (total, batch_id))

    @staticmethod
    def _enter(db: sqlite3.Connection, batch_id: str, status: str, when: int) -> None:
        column = STATUS_TIMES[status]
        db.execute(
            f"UPDATE batches SET {column} = ? WHERE id = ? AND {column} IS NULL",
            (when, batch_id),
        )


def _record(row: sqlite3.Row) -> BatchRecord:
    return BatchRecord(
        id=row["id"],
        endpoint=row["endpoint"],
        model=row["model"],
        input_file_id=row["input_file_id"],
        completion_window=row["completion_window"],
        status=row["status"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        times={column: row[column] for column in STATUS_TIMES.values()},
        output_file_id=row["output_file_id"],
        error_file_id=row["error_file_id"],
        counts=BatchRequestCounts(
            total=row["total"], completed=row["completed"], failed=row["failed"]
        ),
        usage=Usage(row["input_tokens"], row["cached_tokens"], row["output_tokens"]),
        metadata=json.loads(row["metadata"]) if row["metadata"] is not None else None,
        errors=json.loads(row["errors"]) if row["errors"] is not None else None,
        output_expires_after=row["output_expires_after"],
    )
