"""The server's SQLite database: per-feature steps applied once, transactions whole,
a file that survives a reopen, memory that does not."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from cellbatch.server.storage import DATABASE_NAME, Storage

STEPS = ["CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL);"]


def test_a_file_database_survives_a_reopen_and_steps_run_once(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "data")
    assert storage.persistent and storage.path == tmp_path / "data" / DATABASE_NAME
    storage.migrate("notes", STEPS)
    with storage.transaction() as db:
        db.execute("INSERT INTO notes (text) VALUES ('kept')")
    storage.close()
    again = Storage(tmp_path / "data")
    # The first step is not run again (it would fail: the table exists); a new one runs.
    again.migrate("notes", [*STEPS, "ALTER TABLE notes ADD COLUMN seen INTEGER DEFAULT 0;"])
    with again.transaction() as db:
        rows = db.execute("SELECT text, seen FROM notes").fetchall()
    assert [tuple(row) for row in rows] == [("kept", 0)]
    again.close()


def test_a_failed_transaction_leaves_nothing(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    storage.migrate("notes", STEPS)
    with pytest.raises(sqlite3.IntegrityError), storage.transaction() as db:
        db.execute("INSERT INTO notes (text) VALUES ('half')")
        db.execute("INSERT INTO notes (text) VALUES (NULL)")
    with storage.transaction() as db:
        assert db.execute("SELECT COUNT(*) FROM notes").fetchone()[0] == 0


def test_features_keep_their_own_steps_and_memory_is_private() -> None:
    first, second = Storage(None), Storage(None)
    assert not first.persistent
    first.migrate("notes", STEPS)
    first.migrate("other", ["CREATE TABLE other (x INTEGER);"])
    with first.transaction() as db:
        steps = db.execute("SELECT feature, step FROM schema_steps ORDER BY feature").fetchall()
    assert [tuple(row) for row in steps] == [("notes", 0), ("other", 0)]
    second.migrate("notes", STEPS)  # a second in-memory database starts empty
    with second.transaction() as db:
        assert db.execute("SELECT COUNT(*) FROM notes").fetchone()[0] == 0
