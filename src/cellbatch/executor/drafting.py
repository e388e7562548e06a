"""Drafters: where a speculative executor's drafted tokens come from
(docs/design.md#speculative-decoding).

Owns: the `Drafter` contract (propose drafts for the sessions a step lets speculate;
follow the target's sessions as they are rewound, truncated, cloned and closed),
`DraftRequest`, and `NgramDrafter`, prompt lookup: the tokens that followed the latest
earlier occurrence of the context's last n tokens.
Promises: a drafter only proposes; whatever it proposes, the target's verification
keeps exactly the tokens one-at-a-time decoding would have produced, so a draft may
be wrong, short or empty, never harmful. A proposal holds at most its request's limit.
N-gram drafting keeps no state beyond what the session table holds (the context).
Never: samples the target's tokens, places the target's cells or keeps generation
state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cellbatch.types import SessionId, Token

Draft = tuple[Token, ...]


@dataclass(frozen=True)
class DraftRequest:
    """Draft up to `limit` tokens to follow `context` (a session's tokens up to and
    including the one the step feeds last, int64)."""

    sid: SessionId
    context: np.ndarray
    limit: int


class Drafter(Protocol):
    """Proposes drafts; the executor calls the session hooks as the target's sessions
    change, so that a drafter with state of its own (a draft model's cells) follows."""

    @property
    def method(self) -> str:
        """Its `SpeculativeConfig.method`."""

    def initialize(self) -> None:
        """Load and allocate, on the engine thread, when the executor initialises."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One draft per request, in order (possibly empty)."""

    def forget(self, sid: SessionId, length: int) -> None:
        """The target session holds only positions [0, length) now, or will write
        there next: nothing the drafter learnt beyond it stands."""

    def accepted(self, sid: SessionId, length: int) -> None:
        """The target verified this session's drafts and holds [0, length) now."""

    def clone(self, source: SessionId, clone: SessionId, upto: int) -> None:
        """The target cloned `source`'s positions [0, upto) as session `clone`."""

    def close(self, sid: SessionId) -> None:
        """The target session is gone."""


class NgramDrafter:
    """Prompt lookup: for n from `high` down to `low`, the latest earlier occurrence of
    the context's last n tokens; the draft is what followed it. No model, no memory
    beyond the context itself, so the session hooks have nothing to follow."""

    method = "ngram"

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high

    def initialize(self) -> None:
        return

    def forget(self, sid: SessionId, length: int) -> None:
        return

    def accepted(self, sid: SessionId, length: int) -> None:
        return

    def clone(self, source: SessionId, clone: SessionId, upto: int) -> None:
        return

    def close(self, sid: SessionId) -> None:
        return

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self.lookup(request.context, request.limit) for request in requests]

    def lookup(self, context: np.ndarray, limit: int) -> Draft:
        size = len(context)
        for n in range(min(self.high, size - 1), self.low - 1, -1):
            start = _latest_match(context, n)
            if start is not None:
                follow = context[start + n : start + n + limit]
                return tuple(int(token) for token in follow)
        return ()


def _latest_match(context: np.ndarray, n: int) -> int | None:
    """The latest start i < len - n of context[i : i + n] == the last n tokens (so that
    a token follows it), or None. A few vector ops per n, whatever the context."""
    size = len(context)
    suffix = context[size - n :]
    candidates = np.flatnonzero(context[: size - n] == suffix[0])
    for offset in range(1, n):
        if not candidates.size:
            return None
        candidates = candidates[context[candidates + offset] == suffix[offset]]
    return int(candidates[-1]) if candidates.size else None
