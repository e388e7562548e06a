"""How a packed step is cut into forwards (docs/design.md#the-step-plan).

Owns: `plan_slices`, which cuts a step's token axis into slices of at most
`max_batch_tokens`, each run by the wide (multi-token) method or as one-token
decode forwards; `pick_width`, the narrowest static method width for a slice; and
`plan_calls`, the calls of an executor with static decode widths (a program's
methods, a CUDA executor's graphs): each wide slice one call, each run of one-token
slices the rows of the narrowest width that holds them; and `rows_in_slice`, the rows
of per-input row ranges that fall in one slice.
Promises: slices cover [0, total) in order, without overlap; a wide slice is at
least `min_prefill_tokens` long and longer than one token; a non-wide slice is
exactly one token; calls cover [0, total) in order, a decode call no longer than
its width, and runs longer than the widest width cut at it.
Never: looks at the tokens themselves; which cells they take is the caller's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cellbatch.types import InvalidArgumentError


@dataclass(frozen=True)
class Slice:
    """Tokens [offset, offset + length) of a packed step, run as one forward."""

    offset: int
    length: int
    wide: bool


def plan_slices(total: int, max_batch_tokens: int, min_prefill_tokens: int) -> list[Slice]:
    """Cut `total` tokens into forwards of at most `max_batch_tokens`.

    A piece at least `min_prefill_tokens` long (and longer than one token) runs wide;
    a shorter piece becomes one-token decode slices. When the tail piece would be too
    short to run wide, it borrows tokens from the piece before it if that one stays
    wide: the same number of wide forwards then replaces several decode forwards.
    """
    if total < 0:
        raise InvalidArgumentError(f"total must be >= 0 tokens, got {total}")
    if max_batch_tokens < 1:
        raise InvalidArgumentError(
            f"max_batch_tokens must be >= 1 (the widest forward), got {max_batch_tokens}"
        )
    if min_prefill_tokens < 1:
        raise InvalidArgumentError(
            f"min_prefill_tokens must be >= 1 (the wide method's lower bound), "
            f"got {min_prefill_tokens}"
        )
    wide_from = max(min_prefill_tokens, 2)
    lengths = [max_batch_tokens] * (total // max_batch_tokens)
    tail = total % max_batch_tokens
    if tail:
        lengths.append(tail)
    if len(lengths) >= 2 and 0 < tail < wide_from <= max_batch_tokens - (wide_from - tail):
        lengths[-2] -= wide_from - tail
        lengths[-1] = wide_from

    slices: list[Slice] = []
    offset = 0
    for length in lengths:
        if length >= wide_from:
            slices.append(Slice(offset, length, wide=True))
        else:
            slices.extend(Slice(offset + i, 1, wide=False) for i in range(length))
        offset += length
    return slices


@dataclass(frozen=True)
class Call:
    """Tokens [offset, offset + length) run as one call: the wide method (width None)
    or the rows of the static decode width `width` (>= length; the rest is padding)."""

    offset: int
    length: int
    width: int | None


def plan_calls(
    total: int, max_batch_tokens: int, min_prefill_tokens: int, widths: Iterable[int]
) -> list[Call]:
    """The calls covering a step of `total` tokens, in order: `plan_slices`' wide slices
    run wide; each run of its one-token slices runs as rows of the narrowest of `widths`
    that holds it (runs longer than the widest are cut at the widest)."""
    available = sorted(widths)
    if not available:
        raise InvalidArgumentError("plan_calls needs at least one static decode width")
    calls: list[Call] = []
    pending: list[int] = []  # the run of one-token slices not yet in a call: [from, to)

    def flush() -> None:
        start, end = pending
        while start < end:
            length = min(end - start, available[-1])
            calls.append(Call(start, length, pick_width(length, available)))
            start += length
        pending.clear()

    for piece in plan_slices(total, max_batch_tokens, min_prefill_tokens):
        if not piece.wide:
            pending[:] = [pending[0] if pending else piece.offset, piece.offset + piece.length]
            continue
        if pending:
            flush()
        calls.append(Call(piece.offset, piece.length, None))
    if pending:
        flush()
    return calls


def pick_width(length: int, widths: Iterable[int]) -> int:
    """The narrowest of `widths` that holds `length` tokens."""
    if length < 1:
        raise InvalidArgumentError(f"a slice holds at least one token, got length {length}")
    available = sorted(widths)
    for width in available:
        if width >= length:
            return width
    raise InvalidArgumentError(
        f"no static width holds {length} tokens (widths {available}); "
        "cut the step into slices no wider than the widest method"
    )


def rows_in_slice(ranges: np.ndarray, offset: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """The token-axis rows of `ranges` ([inputs, 2]: each input's rows [from, to)) that
    lie in [offset, end), ascending, and the input each belongs to."""
    low = np.clip(ranges[:, 0], offset, end)
    high = np.clip(ranges[:, 1], offset, end)
    spans = np.flatnonzero(high > low)
    counts = high[spans] - low[spans]
    # Each span's rows: its low, then one more per row (a ramp restarted per span).
    firsts = np.repeat(low[spans] - (np.cumsum(counts) - counts), counts)
    rows = firsts + np.arange(int(counts.sum()), dtype=np.int64)
    return rows, np.repeat(spans.astype(np.int64), counts)
