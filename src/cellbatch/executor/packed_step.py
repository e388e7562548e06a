"""A packed step: one batch laid on one token axis, and the rows of its logits each
forward over a slice of that axis returns (docs/design.md#sessiontable).

Owns: `PackedStep` (what `SessionTable.pack` makes of a batch), `SliceRows` and
`select_rows`.
Promises: `select_rows` gives, for any non-empty slice of a step, its output rows (an
input verifying m drafts has m + 1) and its prompt-scoring rows, ascending and relative
to the slice, and at least one row; a slice outside the step is an
InvalidArgumentError.
Never: reads sessions, logits or the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from cellbatch.executor.pooling import PoolingPlan
from cellbatch.executor.step_plan import rows_in_slice
from cellbatch.types import InvalidArgumentError


@dataclass
class PackedStep:
    """One batch on one token axis, inputs in order (all numpy int64).

    tokens/positions/seq_ids have one entry per token; logit_indices has one per
    input: the token-axis row of its last token where it produces output, else -1.
    adapters, when some input's session runs a LoRA adapter, holds each token's adapter
    id (NO_ADAPTER where none); None: no token has one.
    score_ranges [inputs, 2], when some session scores its prompt, holds each input's
    token-axis rows [from, to) whose logits score that prompt (from == to: none); it
    never holds an output row. None: no input scores. drafts, when some input verifies
    drafted tokens, holds per input how many of its last tokens are drafts: their rows
    and the row before them are all output rows (None: none does). `pooling`, when some
    session pools its prompt's hidden states, says which rows it pools and where its
    vector is done (a pooling input's logit index is -1: it samples no token).
    """

    tokens: np.ndarray
    positions: np.ndarray
    seq_ids: np.ndarray
    logit_indices: np.ndarray
    score_ranges: np.ndarray | None = None
    drafts: np.ndarray | None = None
    adapters: np.ndarray | None = None
    pooling: PoolingPlan | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class SliceRows(NamedTuple):
    """The logits rows one forward returns (see `select_rows`)."""

    rows: np.ndarray  # int64, relative to the slice, ascending
    inputs: np.ndarray  # int64 per row: the input whose output it samples; -1: none
    scored: np.ndarray  # bool per row: its logits score its session's prompt


def select_rows(step: PackedStep, offset: int, length: int) -> SliceRows:
    """The logits rows a forward over step tokens [offset, offset + length) must return.

    Rows are relative to the slice (what the forward indexes its own hidden states
    with), ascending: each output row (its input in `inputs`; an input verifying m
    drafts has m + 1, its last token's and the m before it) and each row of the slice in
    the step's score_ranges (`scored`). A slice with no wanted row returns its last row
    with input index -1, so every forward yields some logits.
    """
    if offset < 0 or length < 1 or offset + length > step.num_tokens:
        raise InvalidArgumentError(
            f"select_rows: slice [{offset}, {offset + length}) is not a non-empty part of a "
            f"{step.num_tokens}-token step"
        )
    end = offset + length
    inputs = np.flatnonzero(step.logit_indices >= 0).astype(np.int64)
    rows = step.logit_indices[inputs]
    if step.drafts is not None:
        counts = step.drafts[inputs] + 1
        firsts = rows - counts + 1
        inputs = np.repeat(inputs, counts)
        rows = np.repeat(firsts - (np.cumsum(counts) - counts), counts) + np.arange(
            int(counts.sum()), dtype=np.int64
        )
    inside = (rows >= offset) & (rows < end)
    inputs, rows = inputs[inside], rows[inside]
    scored_rows = np.zeros(0, dtype=np.int64)
    if step.score_ranges is not None:
        scored_rows, _ = rows_in_slice(step.score_ranges, offset, end)
    if rows.size == 0 and scored_rows.size == 0:
        return SliceRows(
            np.array([length - 1], dtype=np.int64),
            np.array([-1], dtype=np.int64),
            np.zeros(1, dtype=bool),
        )
    all_rows = np.concatenate([rows, scored_rows])
    order = np.argsort(all_rows, kind="stable")
    return SliceRows(
        all_rows[order] - offset,
        np.concatenate([inputs, np.full(scored_rows.size, -1, dtype=np.int64)])[order],
        np.concatenate([np.zeros(rows.size, bool), np.ones(scored_rows.size, bool)])[order],
    )
