"""The runner's automatic prefix cache: finished submissions kept as snapshots.

Owns: `common_prefix_length`, the one prefix-matching rule; a least-recently-used
table of idle sessions, each keyed by the LoRA adapter its cells were computed under
and exactly the tokens they hold (a finished submission's prompt and answer).
Promises: `longest_prefix` finds the snapshot of the prompt's adapter sharing the
longest prefix with it (ties: the most recently used; a prefix computed under one
adapter, or none, never serves another), capped one token short of the prompt so
that its last token always runs through the model (its logits give the first new
token), and only when the match is at least `MIN_MATCH` tokens; a key is held by at
most one snapshot; the table never holds more than its capacity (what it lets go
is handed back for the caller to close).
Never: opens, copies or closes sessions itself (the session book does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from cellbatch.runner.generation import SessionRecord
from cellbatch.types import NO_ADAPTER, Token

# (the adapter id the cells were computed under, the tokens they hold)
Key = tuple[int, tuple[Token, ...]]

# A shorter match saves less than the copy and bookkeeping cost.
MIN_MATCH = 4


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two int64 token arrays share: the one prefix-matching
    rule (snapshots here, the Engine's shared prompt prefix)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class SnapshotCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Key, SessionRecord] = OrderedDict()
        self._arrays: dict[Key, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, state: SessionRecord) -> bool:
        return any(entry is state for entry in self._entries.values())

    def keep(self, state: SessionRecord) -> list[SessionRecord]:
        """Add an idle session holding exactly `state.context[:state.computed]`, computed
        under `state.adapter`; returns the sessions to close: the new one if its key is
        held already (that entry is refreshed instead), or the least recently used
        beyond capacity."""
        tokens = tuple(state.context[: state.computed])
        key = (state.adapter, tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return [state]
        self._entries[key] = state
        self._arrays[key] = np.asarray(tokens, dtype=np.int64)
        evicted = []
        while len(self._entries) > self.capacity:
            evicted.append(self._pop_oldest())
        return evicted

    def longest_prefix(
        self, prompt: Sequence[Token], adapter: int = NO_ADAPTER
    ) -> tuple[SessionRecord, int] | None:
        """The snapshot computed under `adapter` sharing the longest prefix with
        `prompt`, and that length."""
        if not self._entries or len(prompt) <= MIN_MATCH:
            return None
        query = np.asarray(prompt, dtype=np.int64)
        best: tuple[Key, int] | None = None
        for key in reversed(self._entries):  # most recent first: it wins ties
            if key[0] != adapter:
                continue
            matched = common_prefix_length(self._arrays[key], query[:-1])
            if matched >= MIN_MATCH and (best is None or matched > best[1]):
                best = (key, matched)
        if best is None:
            return None
        self._entries.move_to_end(best[0])
        return self._entries[best[0]], best[1]

    def remove(self, state: SessionRecord) -> bool:
        for key, entry in self._entries.items():
            if entry is state:
                del self._entries[key]
                del self._arrays[key]
                return True
        return False

    def pop_oldest(self) -> SessionRecord | None:
        return self._pop_oldest() if self._entries else None

    def oldest(self) -> SessionRecord | None:
        return next(iter(self._entries.values()), None)

    def _pop_oldest(self) -> SessionRecord:
        key, state = self._entries.popitem(last=False)
        del self._arrays[key]
        return state
