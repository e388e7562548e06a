"""Pooled hidden states: a prompt's last hidden states as one vector (an embedding).

Owns: `Pooler`, one generation's pooled hidden states gathered across its prompt chunks;
`plan_pooling`, the token-axis rows of a packed step whose hidden states the pooling
sessions need and the rows where each pooling generation's vector is done;
`slice_pooling`, the part of that plan one forward's slice holds; and `pool_slice`,
which hands a slice's hidden states to their poolers.
Promises: "last" pools the final-norm hidden state of the prompt's last token, "mean"
the mean over every position the generation feeds, each position counted once however
often a preempted generation feeds it again; a pooling generation's last prompt chunk
asks for its vector, never for a sampled token; the vector is float32 and not
normalised (the caller normalises, and shortens where the model allows).
Never: runs the model, samples, or keeps vocabulary-sized state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from cellbatch.executor.step_plan import rows_in_slice
from cellbatch.types import InvalidArgumentError


class Pooler:
    """One generation's prompt hidden states, pooled as its chunks run."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.start: int | None = None  # the first position the generation fed
        self.next_position = 0  # positions below it are pooled already
        self.total: torch.Tensor | None = None  # float32 [hidden]: the sum, or the last row
        self.count = 0

    def planned(self, input_start: int) -> int:
        """The first position whose hidden state is still to pool, for an input starting
        at `input_start` (the generation's first: that start)."""
        return input_start if self.start is None else self.next_position

    def add(self, positions: np.ndarray, hidden: torch.Tensor) -> None:
        """Pool the hidden states [len(positions), H] of `positions` (ascending and
        contiguous, from `planned`)."""
        if self.start is None:
            self.start = int(positions[0])
        rows = hidden.float()
        if self.mode == "last":
            self.total, self.count = rows[-1].clone(), 1
        else:
            added = rows.sum(0)
            self.total = added if self.total is None else self.total + added
            self.count += len(positions)
        self.next_position = int(positions[-1]) + 1

    def vector(self) -> tuple[float, ...]:
        if self.total is None:
            raise InvalidArgumentError("a pooling generation asked for its vector before any row")
        pooled = self.total if self.mode == "last" else self.total / self.count
        return tuple(pooled.tolist())


@dataclass(frozen=True)
class PoolingPlan:
    """Per input of a packed step (all int64 numpy): the token-axis rows [from, to) whose
    hidden states its session pools (from == to: none), and the row after which its
    generation's vector is done (-1: it asks for none)."""

    ranges: np.ndarray  # [inputs, 2]
    done_rows: np.ndarray  # [inputs]
    poolers: tuple[Pooler | None, ...]  # per input: its session's pooler (None: it pools not)


def plan_pooling(
    poolers: Sequence[Pooler | None],
    starts: Sequence[int],
    sizes: Sequence[int],
    produces: np.ndarray,
    ends: np.ndarray,
) -> PoolingPlan | None:
    """The pooling rows of a step whose inputs' sessions have `poolers` (None: that
    session does not pool); None when no input pools. `ends` are the inputs' ends on the
    token axis, `produces` whether each asks for output (a pooling session's last prompt
    chunk, which then asks for its vector)."""
    if all(pooler is None for pooler in poolers):
        return None
    ranges = np.zeros((len(poolers), 2), dtype=np.int64)
    done_rows = np.full(len(poolers), -1, dtype=np.int64)
    reach: dict[int, int] = {}  # per pooler (by id): planned() as the step advances
    for index, pooler in enumerate(poolers):
        if pooler is None:
            continue
        start, end = starts[index], starts[index] + sizes[index]
        to_axis = int(ends[index]) - end
        planned = reach.get(id(pooler), pooler.planned(start))
        first = end - 1 if pooler.mode == "last" else max(start, planned)
        if (pooler.mode == "mean" or produces[index]) and first < end:
            ranges[index] = (first + to_axis, end + to_axis)
            planned = end
        if produces[index]:
            done_rows[index] = end - 1 + to_axis
        reach[id(pooler)] = planned
    return PoolingPlan(ranges, done_rows, tuple(poolers))


class SlicePooling(NamedTuple):
    """What one forward over a slice of a step pools."""

    rows: np.ndarray  # int64, relative to the slice, ascending: hidden states to return
    inputs: np.ndarray  # int64 per row: the input (of the step) whose session pools it
    done: np.ndarray  # int64: the inputs whose vector is complete after this slice


def slice_pooling(plan: PoolingPlan, offset: int, length: int) -> SlicePooling:
    end = offset + length
    rows, inputs = rows_in_slice(plan.ranges, offset, end)
    done = np.flatnonzero((plan.done_rows >= offset) & (plan.done_rows < end)).astype(np.int64)
    return SlicePooling(rows - offset, inputs, done)


def pool_slice(
    plan: PoolingPlan,
    picked: SlicePooling,
    positions: np.ndarray,
    hidden: torch.Tensor,
) -> None:
    """Pool the final-norm hidden states [len(picked.rows), H] of a slice, whose
    positions are `positions` (the slice's, one per token), into their poolers."""
    for index in np.unique(picked.inputs).tolist():
        pooler = plan.poolers[index]
        if pooler is None:
            raise InvalidArgumentError(
                f"pool_slice: input {index}'s session pools nothing; pass only the rows "
                "slice_pooling picks"
            )
        mine = np.flatnonzero(picked.inputs == index)
        pooler.add(positions[picked.rows[mine]], hidden[mine])
