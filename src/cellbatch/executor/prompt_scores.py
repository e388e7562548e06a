"""Prompt logprobs: a generation's prompt scored across its chunks.

Owns: `PromptScores`, one generation's prompt logprobs gathered across its prompt
chunks, and `plan_scoring`, the token-axis rows of a packed step whose logits score the
prompts of the sessions that ask.
Promises: every prompt token but the first gets its entry once, from the logits of the
position before it, whichever chunk (or step) computed them; a replay (preemption,
rewind) feeds the same tokens again and keeps their entries; an output row never
scores.
Never: samples, or keeps more than one logits row per generation between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from cellbatch.executor.sampling import token_logprobs
from cellbatch.types import TokenLogprob


class PromptScores:
    """One generation's prompt logprobs, gathered across its prompt chunks.

    `entries[i]` scores the token at position `start + i` (the first is None: the
    generation never computed the logits before it). The logits of position q score
    the token at q + 1, which the next chunk may feed only in a later step: until
    then that row waits in `pending`. A replay (preemption, rewind) feeds the same
    tokens again; their entries are kept, not recomputed.
    """

    def __init__(self, top: int) -> None:
        self.top = top
        self.start: int | None = None
        self.entries: list[TokenLogprob | None] = []
        self.pending: tuple[int, torch.Tensor] | None = None

    @property
    def covered(self) -> int:
        """One past the last position with an entry (start + len(entries))."""
        assert self.start is not None
        return self.start + len(self.entries)

    def planned(self, input_start: int) -> int:
        """One past the last position whose entry exists or will come from a row already
        computed (the pending one); rows scoring from here on are new. Before the first
        input (starting at `input_start`), that input's start."""
        if self.start is None:
            return input_start
        return self.covered + (self.pending is not None)

    def reach(self, position: int, history: np.ndarray) -> None:
        """Give the token at `position` its entry if it is next and has none yet."""
        if self.start is None:
            self.start = position
            self.entries.append(None)
        elif self.covered == position and self.pending is not None:
            before, row = self.pending
            if before == position - 1:
                self.entries.extend(token_logprobs(row[None], [int(history[position])], [self.top]))
                self.pending = None

    def add(
        self, positions: np.ndarray, logits: torch.Tensor, history: np.ndarray, fed: int
    ) -> None:
        """Score the tokens after `positions` (ascending, contiguous, planned by
        `SessionTable.pack` so that the first new entry is the next one) from their
        logits rows; the last row, when its next token is not fed yet, waits in
        `pending`."""
        self.reach(int(positions[0]), history)
        known = positions + 1 < fed
        count = int(known.sum())
        if count:
            nexts = positions[:count] + 1
            first = int(nexts[0])
            scored = token_logprobs(logits[:count], history[nexts].tolist(), [self.top] * count)
            self.entries.extend(scored[self.covered - first :])
        if count < len(positions):
            self.pending = (int(positions[-1]), logits[-1].clone())


def plan_scoring(
    prompts: Sequence[PromptScores | None],
    seqs: Sequence[int],
    starts: Sequence[int],
    sizes: Sequence[int],
    produces: np.ndarray,
    ends: np.ndarray,
) -> np.ndarray | None:
    """Per input, the token-axis rows [from, to) whose logits give entries its session's
    prompt (`prompts`, None: it scores none) lacks and no earlier row gives; None when
    none scores. `seqs` are the inputs' cache sequences, `ends` their ends on the token
    axis, `produces` whether each asks for output (its output row samples, never
    scores)."""
    if all(prompt is None for prompt in prompts):
        return None
    ranges = np.zeros((len(prompts), 2), dtype=np.int64)
    reach: dict[int, int] = {}  # per sequence: planned() as the batch advances
    for index, prompt in enumerate(prompts):
        if prompt is None:
            continue
        start, end = starts[index], starts[index] + sizes[index]
        planned = reach.get(seqs[index], prompt.planned(start))
        first = max(start, planned - 1)  # position q scores q + 1
        last = end - 1 if produces[index] else end  # the output row samples
        if first < last:
            to_axis = int(ends[index]) - end
            ranges[index] = (first + to_axis, last + to_axis)
            planned = last + 1
        reach[seqs[index]] = planned
    return ranges
