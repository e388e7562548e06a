"""Kept responses of the Responses API (`store: true`), in the server's database.

Owns: the `responses` table (each kept response: its object as answered, and the
conversation it answered, as input items with their ids, so that `previous_response_id`
can go on from it and `input_items` can list it), and `ResponseStore`'s reads, writes
and deletions.
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

from cellbatch.server.responses_protocol import InputItem, ResponseObject, new_id
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

    def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        """The input items `response_id` answered, history first, each with its id (None
        when no such response is kept)."""
        row = self._row(response_id, "conversation")
        return None if row is None else list(json.loads(row))

    def delete(self, response_id: str) -> bool:
        with self.storage.transaction() as db:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def _row(self, response_id: str, column: str) -> str | None:
        with self.storage.transaction() as db:
            row = db.execute(
                f"SELECT {column} FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        return None if row is None else str(row[column])


# The id prefix OpenAI gives each kind of item.
_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def conversation_json(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as the store keeps them: an item given without an id gets one, so that
    `input_items` can page through them, and a message's text is a list of parts."""
    kept = []
    for item in items:
        fields = item.model_dump(mode="json", exclude_none=True)
        fields.setdefault("id", new_id(_ID_PREFIXES[item.type]))
        if isinstance(fields.get("content"), str):  # an easy message: listed as OpenAI lists it
            part = "output_text" if fields["role"] == "assistant" else "input_text"
            fields["content"] = [{"type": part, "text": fields["content"]}]
        kept.append(fields)
    return kept
