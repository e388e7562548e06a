"""Kept responses of the Responses API (`store: true`), in the server's database.

Owns: the `responses` table (each kept response: its object as answered, and the
conversation it answered, as input items, so that `previous_response_id` can go on
from it), and `ResponseStore`'s reads, writes and deletions.
Promises: a response is kept once whole (never half-written); what `get` returns is
what was answered; `history(id)` is the conversation that a request naming `id` as its
previous response continues: that response's conversation, then its output; with a
`--data-dir` all of it survives a restart, without one it lasts as long as the server.
Never: plans or runs requests (the Responses API's routes do).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import TypeAdapter

from cellbatch.server.responses_protocol import InputItem, ResponseObject
from cellbatch.server.storage import Storage

STEPS = (
    """
    CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        created_at INTEGER NOT NULL,
        response TEXT NOT NULL,    -- the response object, JSON
        conversation TEXT NOT NULL -- the input items it answered, history first, JSON
    );
    """,
)

_ITEMS = TypeAdapter(list[InputItem])


class ResponseStore:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        storage.migrate("responses", STEPS)

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        with self.storage.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO responses (id, created_at, response, conversation) "
                "VALUES (?, ?, ?, ?)",
                (
                    response.id,
                    response.created_at,
                    response.model_dump_json(),
                    json.dumps(conversation),
                ),
            )

    def get(self, response_id: str) -> ResponseObject | None:
        row = self._row(response_id, "response")
        return None if row is None else ResponseObject.model_validate_json(row)

    def history(self, response_id: str) -> list[InputItem] | None:
        """The conversation a request continuing `response_id` goes on from (None when
        no such response is kept)."""
        with self.storage.transaction() as db:
            row = db.execute(
                "SELECT response, conversation FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        if row is None:
            return None
        output = json.loads(row["response"])["output"]
        return _ITEMS.validate_python([*json.loads(row["conversation"]), *output])

    def delete(self, response_id: str) -> bool:
        with self.storage.transaction() as db:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def _row(self, response_id: str, column: str) -> str | None:
        with self.storage.transaction() as db:
            row = db.execute(
                f"SELECT {column} FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        return None if row is None else str(row[column])


def conversation_json(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as the store keeps them."""
    return [item.model_dump(mode="json", exclude_none=True) for item in items]
