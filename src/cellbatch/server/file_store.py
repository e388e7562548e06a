"""Files: what clients upload (`/v1/files`) and what batches write, on disk under the
data folder, with their records in the server's database.

Owns: the `files` table, the folder that holds the files' bytes (one file per id), the
ids (`file-` and 24 hex digits), expiry and the sweep that removes what no record names.
Promises: a file's bytes are complete on disk (written aside, flushed, renamed into
place) before its record is committed, so a server killed at any moment never lists a
file it cannot serve whole; an expired file is gone (its record and bytes) the next
time anything reads it or the store starts; `sweep` removes bytes without a record
(what a kill between the rename and the commit left behind).
Never: parses a file's content (the batch worker reads batch files), or knows HTTP.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from cellbatch.server.batch_protocol import FileObject
from cellbatch.server.storage import Storage

FEATURE = "files"
STEPS = (
    """
    CREATE TABLE files (
        id TEXT PRIMARY KEY,
        bytes INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        expires_at INTEGER,
        filename TEXT NOT NULL,
        purpose TEXT NOT NULL
    );
    """,
)
_COPY_CHUNK = 1 << 20


class FileTooLarge(Exception):
    """An upload went past the size limit (the message says by how much)."""


@dataclass(frozen=True)
class FileRecord:
    id: str
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: str

    def object(self) -> FileObject:
        return FileObject(
            id=self.id,
            bytes=self.bytes,
            created_at=self.created_at,
            expires_at=self.expires_at,
            filename=self.filename,
            purpose=self.purpose,
        )


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


class FileStore:
    def __init__(self, storage: Storage, folder: Path) -> None:
        self.storage = storage
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        storage.migrate(FEATURE, STEPS)
        self.sweep()

    def path(self, file_id: str) -> Path:
        return self.folder / file_id

    def save_upload(
        self,
        source: BinaryIO,
        filename: str,
        purpose: str,
        expires_at: int | None,
        limit: int,
    ) -> FileRecord:
        """Copy an upload into the store (blocking: run it off the event loop);
        FileTooLarge past `limit` bytes, nothing kept."""
        file_id = new_file_id()
        aside = self.folder / f"{file_id}.part"
        size = 0
        try:
            with aside.open("wb") as target:
                while chunk := source.read(_COPY_CHUNK):
                    size += len(chunk)
                    if size > limit:
                        raise FileTooLarge(
                            f"the file is above the {limit}-byte limit (--max-file-bytes); "
                            "split it into smaller files"
                        )
                    target.write(chunk)
                target.flush()
                os.fsync(target.fileno())
            aside.rename(self.path(file_id))
        finally:
            aside.unlink(missing_ok=True)
        record = FileRecord(file_id, size, int(time.time()), expires_at, filename, purpose)
        with self.storage.transaction() as db:
            self.insert(db, record)
        return record

    def write(
        self, content: bytes, filename: str, purpose: str, expires_at: int | None
    ) -> FileRecord:
        """Put `content` on disk under a new id; the caller commits its record
        (`insert`), in the transaction that makes it visible."""
        file_id = new_file_id()
        aside = self.folder / f"{file_id}.part"
        with aside.open("wb") as target:
            target.write(content)
            target.flush()
            os.fsync(target.fileno())
        aside.rename(self.path(file_id))
        return FileRecord(file_id, len(content), int(time.time()), expires_at, filename, purpose)

    @staticmethod
    def insert(db: sqlite3.Connection, record: FileRecord) -> None:
        db.execute(
            "INSERT INTO files (id, bytes, created_at, expires_at, filename, purpose) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (
                record.id,
                record.bytes,
                record.created_at,
                record.expires_at,
                record.filename,
                record.purpose,
            ),
        )

    def get(self, file_id: str) -> FileRecord | None:
        """The file's record, unless there is none or it has expired (then it is removed)."""
        with self.storage.transaction() as db:
            row = db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            return None
        record = _record(row)
        if record.expires_at is not None and record.expires_at <= time.time():
            self.delete(file_id)
            return None
        return record

    def page(
        self, purpose: str | None, limit: int, ascending: bool, after: str | None
    ) -> tuple[list[FileRecord], bool]:
        """Up to `limit` files (of `purpose`, when given), by creation, after the file
        `after`; and whether more follow."""
        self._expire()
        clauses, values = [], []
        if purpose is not None:
            clauses.append("purpose = ?")
            values.append(purpose)
        if after is not None:
            clauses.append(
                f"rowid {'>' if ascending else '<'} (SELECT rowid FROM files WHERE id = ?)"
            )
            values.append(after)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        order = "ASC" if ascending else "DESC"
        with self.storage.transaction() as db:
            rows = db.execute(
                f"SELECT * FROM files {where} ORDER BY rowid {order} LIMIT ?",
                (*values, limit + 1),
            ).fetchall()
        records = [_record(row) for row in rows]
        return records[:limit], len(records) > limit

    def delete(self, file_id: str) -> bool:
        """Remove the file's record, then its bytes; False when there was none."""
        with self.storage.transaction() as db:
            gone = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0
        self.path(file_id).unlink(missing_ok=True)
        return gone

    def sweep(self) -> None:
        """Remove expired files, and bytes that no record names (or half-written ones)."""
        self._expire()
        with self.storage.transaction() as db:
            known = {row["id"] for row in db.execute("SELECT id FROM files")}
        for entry in self.folder.iterdir():
            if entry.is_file() and entry.name not in known:
                entry.unlink(missing_ok=True)

    def _expire(self) -> None:
        with self.storage.transaction() as db:
            expired = [
                row["id"]
                for row in db.execute(
                    "SELECT id FROM files WHERE expires_at IS NOT NULL AND expires_at <= ?",
                    (int(time.time()),),
                )
            ]
        for file_id in expired:
            self.delete(file_id)

    def remove_folder(self) -> None:
        """Remove the folder and everything in it (a store in a temporary folder, at the
        end of the server's life)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def _record(row: sqlite3.Row) -> FileRecord:
    return FileRecord(
        row["id"],
        row["bytes"],
        row["created_at"],
        row["expires_at"],
        row["filename"],
        row["purpose"],
    )
