"""Prompt lookup (n-gram drafting): what it proposes from a context."""

from __future__ import annotations

import numpy as np

from cellbatch.executor.drafting import DraftRequest, NgramDrafter


def _draft(context: list[int], limit: int = 4, low: int = 2, high: int = 4) -> tuple[int, ...]:
    request = DraftRequest(0, np.asarray(context, dtype=np.int64), limit)
    return NgramDrafter(low, high).propose([request])[0]


def test_the_tokens_after_an_earlier_occurrence_of_the_last_n() -> None:
    # ... 7 8 9 10 11 12 ... 7 8 9 -> 10 11 12 13
    context = [1, 7, 8, 9, 10, 11, 12, 13, 2, 3, 7, 8, 9]
    assert _draft(context) == (10, 11, 12, 13)
    assert _draft(context, limit=2) == (10, 11)


def test_the_longest_n_wins_then_the_latest_occurrence() -> None:
    # The last two tokens (5, 6) occur twice; the last three (4, 5, 6) once, earlier.
    context = [4, 5, 6, 30, 31, 9, 5, 6, 40, 41, 4, 5, 6]
    assert _draft(context, limit=2) == (30, 31)
    # Without the 3-gram, the latest 2-gram occurrence.
    context = [1, 5, 6, 30, 31, 9, 5, 6, 40, 41, 2, 5, 6]
    assert _draft(context, limit=2) == (40, 41)


def test_a_draft_stops_at_the_end_of_the_context() -> None:
    # The match runs into the suffix itself: what follows it is all there is.
    assert _draft([3, 3, 3, 3], limit=4, low=2, high=2) == (3,)


def test_nothing_below_the_lowest_n_is_proposed() -> None:
    assert _draft([1, 2, 3, 4, 5, 9, 5], low=2) == ()  # only a 1-gram (5) recurs
    assert _draft([1, 2, 3, 4, 5, 9, 5], low=1, high=1) == (9, 5)
    assert _draft([7], low=1) == ()
