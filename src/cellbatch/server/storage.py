"""The server's one SQLite database, under `--data-dir`: what must survive a restart.

Owns: `Storage`, which opens the database (`DATABASE_NAME` in the data folder, made if
missing; without a folder, a private in-memory database that lives as long as the
server), brings each feature's tables up to date at start (`migrate`: numbered steps
per feature, each applied once, recorded in `schema_steps`), and lends its connection
for one transaction at a time (`transaction`).
Promises: a step is applied in the transaction that records it, so a crash leaves a
feature at a whole step; one database serves every feature (each names its own
tables); the connection is used by one thread at a time (a lock), from any thread;
a file database is in WAL mode with synchronous=FULL, so a committed transaction
survives the process being killed (SIGKILL) and a reader never waits for a writer.
Never: knows any feature's tables or rows (each feature's module does).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

DATABASE_NAME = "cellbatch.sqlite3"


class Storage:
    def __init__(self, data_dir: Path | None) -> None:
        """The database in `data_dir` (None: in memory, for the life of this object)."""
        self.path: Path | None = None
        if data_dir is not None:
            data_dir.mkdir(parents=True, exist_ok=True)
            self.path = data_dir / DATABASE_NAME
        self._lock = threading.Lock()
        self._connection = sqlite3.connect(
            str(self.path) if self.path else ":memory:",
            check_same_thread=False,  # the lock keeps it to one thread at a time
            isolation_level=None,  # transactions are begun and ended here, explicitly
        )
        self._connection.row_factory = sqlite3.Row
        if self.path is not None:
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute("PRAGMA synchronous=FULL")
        self._connection.execute(
            "CREATE TABLE IF NOT EXISTS schema_steps ("
            "feature TEXT NOT NULL, step INTEGER NOT NULL, PRIMARY KEY (feature, step))"
        )

    @property
    def persistent(self) -> bool:
        return self.path is not None

    def migrate(self, feature: str, steps: Sequence[str]) -> None:
        """Brings `feature`'s tables up to date: `steps[i]` (an SQL script) runs once in
        the database's life, in order; a step once released is never edited, a change
        is a new step at the end."""
        with self.transaction() as db:
            done = {
                row["step"]
                for row in db.execute("SELECT step FROM schema_steps WHERE feature = ?", (feature,))
            }
            for number, script in enumerate(steps):
                if number in done:
                    continue
                for statement in _statements(script):
                    db.execute(statement)
                db.execute(
                    "INSERT INTO schema_steps (feature, step) VALUES (?, ?)", (feature, number)
                )

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection, for one transaction: committed when the block ends, rolled
        back when it raises."""
        with self._lock:
            self._connection.execute("BEGIN IMMEDIATE")
            try:
                yield self._connection
            except BaseException:
                self._connection.execute("ROLLBACK")
                raise
            self._connection.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._connection.close()


def _statements(script: str) -> list[str]:
    """An SQL script's statements (executescript would commit the transaction)."""
    statements, current = [], ""
    for line in script.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            statements.append(current.strip())
            current = ""
    if current.strip():
        raise ValueError(f"an SQL script ends inside a statement: {current.strip()!r}")
    return statements
