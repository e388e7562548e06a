"""The cell KV cache: which cell holds which position of which sequences
(docs/design.md#cell-kv-cache-and-kv-pool).

Owns: `CellCache`, the bookkeeping of cells (one cell = the K/V of one position) and
sequences, and the attention pattern of a step (`AttentionPlan`, and its flat tensor form
`FlatAttentionPlan`). The K/V tensors over cells are `cellbatch.kv_pool.KVPool`'s.
Promises: a sequence's cells are kept in position order (index = position), so a token's
attention is a gather over its own cells and costs O(its own context); a clone shares
cells (refcount per cell, no K/V copied); free cells are handed out lowest-numbered
first; a refused or invalid call changes nothing.
Never: runs a model, holds or touches K/V, or loops in Python over the pool's cells.

Cell 0 is the scratch cell (`SCRATCH_CELL`): never handed out, it pads attention
gathers (padded keys are masked) and absorbs writes of padding tokens. Real cells are
1..capacity, so the pool holds at most capacity + 1 rows, and because the scratch sits
at a fixed index inside every pool size, `pool.k[layer][cells]` works for real and
scratch cells alike whether or not the pool has grown.

A step is declared, then placed: `declare_step(seq_ids)` checks the cells are there
(False, nothing changed, if not) and records the step's sequences; `place_step` must be
given the same sequences, consumes the declaration on success, and leaves it in force
when it refuses bad positions, so a retry with correct positions needs no new
declaration. Placing without a declaration is an error. Only `place_step` takes cells,
so a declaration stays true however long it waits.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from cellbatch.kv_pool import SCRATCH_CELL
from cellbatch.types import InvalidArgumentError

_INITIAL_SEQ_CELLS = 16


@dataclass
class AttentionGroup:
    """Sequences of one step batched together: Tq queries against Tk keys each.

    A key at index k of a `cells` row has position k, so visibility is a function
    of positions alone.
    """

    rows: torch.Tensor  # [G, Tq] long: token-axis row of each query (pad: a valid row)
    cells: torch.Tensor  # [G, Tk] long: the sequence's cells in position order (pad: scratch)
    query_pos: torch.Tensor  # [G, Tq] long: each query's position (pad: 0)
    query_valid: torch.Tensor  # [G, Tq] bool
    key_len: torch.Tensor  # [G] long: valid keys (= sequence length after the step)
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def mask(self, window: int | None) -> torch.Tensor:
        """[G, 1, Tq, Tk] bool: key k is visible to query q iff k <= query_pos[q] and,
        for a sliding window w, k > query_pos[q] - w. A padded query sees key 0 only,
        so softmax never meets an all-masked row. Cached per window."""
        cached = self._masks.get(window)
        if cached is not None:
            return cached
        if window is not None and (isinstance(window, bool) or window < 1):
            raise InvalidArgumentError(
                f"sliding window must be a positive number of positions or None, got {window}"
            )
        keys = torch.arange(self.cells.shape[1], device=self.cells.device)
        query_pos = self.query_pos[:, :, None]
        visible = keys <= query_pos
        if window is not None:
            visible &= keys > query_pos - window
        visible = torch.where(self.query_valid[:, :, None], visible, keys == 0)
        mask = visible[:, None]
        self._masks[window] = mask
        return mask


@dataclass
class AttentionPlan:
    """The attention pattern of one step, as gathers over each sequence's cells."""

    groups: list[AttentionGroup]  # every token of the step is in exactly one group, once
    num_tokens: int


@dataclass
class FlatAttentionPlan:
    """A step's attention pattern as five flat long tensors (`flatten_plan`): the form the
    attention op of the model and an exported program's methods take.

    Query i is token row `rows[i]` at position `positions[i]`; its sequence's cells, in
    position order (index = position), start at `cells[cell_offsets[i]]`; a sequence's
    queries are consecutive, and block b holds queries [block_starts[b], block_starts[b+1])
    of one sequence.
    """

    cells: torch.Tensor  # every plan group's [G, Tk] cells, flattened and concatenated
    rows: torch.Tensor  # [Q] token row of each query
    positions: torch.Tensor  # [Q]
    cell_offsets: torch.Tensor  # [Q] where the query's sequence starts in `cells`
    block_starts: torch.Tensor  # [blocks + 1] query index at which each block starts
    num_tokens: int

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The five tensors in the order the ops take them (cell_attention, decoder_layer)."""
        return self.cells, self.rows, self.positions, self.cell_offsets, self.block_starts


def flatten_plan(plan: AttentionPlan, query_block: int) -> FlatAttentionPlan:
    """The plan's queries and cells as flat tensors, each sequence's queries cut into
    blocks of at most `query_block`. Tensor work only: no model code, no per-token loop."""
    cells, rows, positions, offsets, starts = [], [], [], [], []
    base = 0
    for group in plan.groups:
        num_groups, keys = group.cells.shape
        valid = group.query_valid
        query_index = torch.arange(valid.shape[1]).expand_as(valid)
        sequence_start = base + torch.arange(num_groups)[:, None] * keys
        cells.append(group.cells.reshape(-1))
        rows.append(group.rows[valid])
        positions.append(group.query_pos[valid])
        offsets.append(sequence_start.expand_as(valid)[valid])
        # Valid queries are a prefix of each row, so this marks every query_block-th
        # query of each sequence, its first included.
        starts.append(query_index[valid] % query_block == 0)
        base += num_groups * keys
    if not cells:
        empty = torch.zeros(0, dtype=torch.long)
        return FlatAttentionPlan(empty, empty, empty, empty, torch.zeros(1, dtype=torch.long), 0)
    flags = torch.cat(starts)
    block_starts = torch.cat([torch.nonzero(flags).reshape(-1), torch.tensor([flags.shape[0]])])
    return FlatAttentionPlan(
        cells=torch.cat(cells).contiguous(),
        rows=torch.cat(rows),
        positions=torch.cat(positions),
        cell_offsets=torch.cat(offsets),
        block_starts=block_starts,
        num_tokens=plan.num_tokens,
    )


@dataclass(frozen=True)
class _StepGrouping:
    """A step's tokens grouped by sequence: order[starts[i] : starts[i] + counts[i]] are
    the rows of sequence seqs[i], in input order."""

    order: np.ndarray
    seqs: np.ndarray
    starts: np.ndarray
    counts: np.ndarray


def _group_by_sequence(seq_ids: np.ndarray) -> _StepGrouping:
    order = np.argsort(seq_ids, kind="stable")
    sorted_ids = seq_ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    counts = np.diff(np.r_[starts, len(seq_ids)])
    return _StepGrouping(order=order, seqs=sorted_ids[starts], starts=starts, counts=counts)


class CellCache:
    """Cells 1..capacity shared by growable, cloneable, rewindable sequences."""

    # Set by clear(), which __init__ calls.
    _cells: list[np.ndarray | None]  # per sequence id; None: a released id
    _lengths: np.ndarray  # int64 per sequence id: its next position
    _live: np.ndarray  # bool per sequence id
    _released_ids: list[int]
    _declared: np.ndarray | None

    def __init__(self, capacity: int) -> None:
        if (
            isinstance(capacity, bool)
            or not isinstance(capacity, (int, np.integer))
            or capacity < 1
        ):
            raise InvalidArgumentError(
                f"capacity must be a positive number of cells, got {capacity}"
            )
        self.capacity = int(capacity)
        self.scratch_cell = SCRATCH_CELL
        # Per cell (index 0 is the scratch cell and stays at refcount 0, position -1).
        # Invariant: refcount[c] = number of live sequences whose cell list holds c, and
        # every owner holds c at position[c]; refcount 0 <=> position -1 <=> free.
        self._refcount = np.zeros(capacity + 1, dtype=np.int32)
        self._position = np.full(capacity + 1, -1, dtype=np.int64)
        self._high_water = SCRATCH_CELL + 1
        self.clear()

    # -- sequences ---------------------------------------------------------------

    def seq_alloc(self) -> int:
        """A new empty sequence: the lowest released id, else the next unused one."""
        if self._released_ids:
            seq = heapq.heappop(self._released_ids)
        else:
            seq = len(self._cells)
            self._cells.append(None)
            if seq >= len(self._lengths):
                self._lengths = np.concatenate([self._lengths, np.zeros_like(self._lengths)])
                self._live = np.concatenate([self._live, np.zeros_like(self._live)])
        self._cells[seq] = np.empty(_INITIAL_SEQ_CELLS, dtype=np.int64)
        self._lengths[seq] = 0
        self._live[seq] = True
        return seq

    def seq_release(self, seq: int) -> None:
        """Drops every cell of the sequence; its id is handed out again later."""
        self._check_live(seq)
        self._drop(seq, 0)
        self._cells[seq] = None
        self._live[seq] = False
        heapq.heappush(self._released_ids, seq)

    def seq_clone(self, src: int, upto: int) -> int:
        """A new sequence sharing src's cells for positions [0, upto); no K/V copied."""
        self._check_live(src)
        length = int(self._lengths[src])
        if not 0 <= upto <= length:
            raise InvalidArgumentError(
                f"cannot clone sequence {src} up to position {upto}: it holds [0, {length}); "
                f"pass 0 <= upto <= {length}"
            )
        shared = self._live_cells(src)[:upto]
        seq = self.seq_alloc()
        self._reserve(seq, upto)
        self._live_cells(seq)[:upto] = shared
        self._refcount[shared] += 1  # a sequence's cells are distinct, so no repeats
        self._lengths[seq] = upto
        return seq

    def seq_rewind(self, seq: int, pos: int) -> None:
        """Drops the sequence's positions >= pos (nothing if it holds none)."""
        self._check_live(seq)
        if pos < 0:
            raise InvalidArgumentError(f"cannot rewind sequence {seq} to position {pos} (< 0)")
        if pos < self._lengths[seq]:
            self._drop(seq, pos)

    def seq_length(self, seq: int) -> int:
        """The sequence's next position (it holds positions [0, length))."""
        self._check_live(seq)
        return int(self._lengths[seq])

    def seq_cells(self, seq: int) -> np.ndarray:
        """A copy of the sequence's cells; index = position."""
        self._check_live(seq)
        return np.array(self._live_cells(seq)[: self._lengths[seq]])  # a copy

    def cell_positions(self, cells: np.ndarray) -> np.ndarray:
        """The position each cell holds (-1: free)."""
        return self._position[np.asarray(cells, dtype=np.int64)]

    def live_sequences(self) -> int:
        return int(np.count_nonzero(self._live))

    # -- cells -------------------------------------------------------------------

    def free_cells(self) -> int:
        return self.capacity - self._used

    def used_cells(self) -> int:
        return self._used

    def high_water(self) -> int:
        """1 + the highest cell index ever handed out (1 before any: the scratch row);
        a KV pool must hold rows [0, high_water())."""
        return self._high_water

    def clear(self) -> None:
        """Returns every cell and sequence; ids start again from 0. The high-water mark
        is kept: it records what the pool has had to hold."""
        self._refcount[:] = 0
        self._position[:] = -1
        self._used = 0
        self._cells = []
        self._lengths = np.zeros(64, dtype=np.int64)
        self._live = np.zeros(64, dtype=bool)
        self._released_ids = []
        self._declared = None

    # -- steps -------------------------------------------------------------------

    def declare_step(self, seq_ids: np.ndarray) -> bool:
        """Checks a step of len(seq_ids) tokens fits; False (nothing changed, an earlier
        declaration kept) if fewer cells are free. True records the declaration."""
        ids = self._check_seq_ids(seq_ids)
        if len(ids) > self.free_cells():
            return False
        self._declared = ids.copy()
        return True

    def place_step(self, seq_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Gives each token of the declared step a free cell (lowest first) and returns
        the cells in token order. Each token's position must be its sequence's next one
        (a sequence's tokens in one step are consecutive positions, in order)."""
        ids, pos = self._check_step_arrays(seq_ids, positions)
        if self._declared is None:
            raise InvalidArgumentError("place_step without declare_step: declare the step first")
        if not np.array_equal(ids, self._declared):
            raise InvalidArgumentError(
                "place_step's sequences differ from the declared step; "
                "declare exactly the sequences being placed"
            )
        if len(ids) == 0:
            self._declared = None
            return np.empty(0, dtype=np.int64)
        grouping = _group_by_sequence(ids)
        self._check_next_positions(ids, pos, grouping)
        cells = self._take_free_cells(len(ids))
        self._refcount[cells] = 1
        self._position[cells] = pos
        cells_by_sequence = cells[grouping.order]
        for seq, start, count in zip(
            grouping.seqs.tolist(), grouping.starts.tolist(), grouping.counts.tolist(), strict=True
        ):
            length = int(self._lengths[seq])
            self._reserve(seq, length + count)
            self._live_cells(seq)[length : length + count] = cells_by_sequence[
                start : start + count
            ]
        self._lengths[grouping.seqs] += grouping.counts
        self._declared = None
        return cells

    def attention_plan(
        self,
        seq_ids: np.ndarray,
        positions: np.ndarray,
        cells: np.ndarray,
        device: str | torch.device = "cpu",
    ) -> AttentionPlan:
        """The attention pattern of a step just placed: one group for the sequences with
        one token in the step (Tq = 1), one for those with several (padded to the
        longest); keys are each sequence's cells up to its length after the step."""
        ids, pos = self._check_step_arrays(seq_ids, positions)
        cells = np.asarray(cells, dtype=np.int64)
        if cells.shape != ids.shape:
            raise InvalidArgumentError(
                f"attention_plan needs one cell per token: {len(ids)} tokens, "
                f"cells of shape {cells.shape}"
            )
        if len(ids) == 0:
            return AttentionPlan(groups=[], num_tokens=0)
        if (
            (cells < 1).any()
            or (cells > self.capacity).any()
            or (self._position[cells] != pos).any()
        ):
            raise InvalidArgumentError(
                "attention_plan's cells do not hold the step's positions; "
                "build the plan from place_step's result for the same step"
            )
        grouping = _group_by_sequence(ids)
        single = grouping.counts == 1
        groups = [
            self._attention_group(grouping, selected, pos, device)
            for selected in (single, ~single)
            if selected.any()
        ]
        return AttentionPlan(groups=groups, num_tokens=len(ids))

    # -- internals ---------------------------------------------------------------

    def _attention_group(
        self,
        grouping: _StepGrouping,
        selected: np.ndarray,
        positions: np.ndarray,
        device: str | torch.device,
    ) -> AttentionGroup:
        seqs = grouping.seqs[selected]
        starts = grouping.starts[selected]
        counts = grouping.counts[selected]
        query_offsets = np.arange(counts.max())
        query_valid = query_offsets < counts[:, None]
        # Padded queries repeat the sequence's last row: any valid row will do.
        rows = grouping.order[starts[:, None] + np.minimum(query_offsets, counts[:, None] - 1)]
        query_pos = np.where(query_valid, positions[rows], 0)
        key_len = self._lengths[seqs]
        key_valid = np.arange(key_len.max()) < key_len[:, None]
        key_cells = np.full(key_valid.shape, SCRATCH_CELL, dtype=np.int64)
        key_cells[key_valid] = np.concatenate(
            [
                self._cells[seq][:length]
                for seq, length in zip(seqs.tolist(), key_len.tolist(), strict=True)
            ]
        )
        return AttentionGroup(
            rows=torch.from_numpy(rows).to(device),
            cells=torch.from_numpy(key_cells).to(device),
            query_pos=torch.from_numpy(query_pos).to(device),
            query_valid=torch.from_numpy(query_valid).to(device),
            key_len=torch.from_numpy(key_len.copy()).to(device),
        )

    def _check_live(self, seq: int) -> None:
        if not (0 <= seq < len(self._cells) and self._live[seq]):
            raise InvalidArgumentError(f"sequence {seq} is not allocated (use seq_alloc)")

    def _check_seq_ids(self, seq_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(seq_ids, dtype=np.int64)
        if ids.ndim != 1:
            raise InvalidArgumentError(f"seq_ids must be 1-D (one per token), got {ids.shape}")
        if len(ids) == 0:
            return ids
        inside = (ids >= 0) & (ids < len(self._cells))
        live = np.zeros(len(ids), dtype=bool)
        live[inside] = self._live[ids[inside]]
        if not live.all():
            unknown = sorted(set(ids[~live].tolist()))
            raise InvalidArgumentError(f"sequences {unknown} are not allocated (use seq_alloc)")
        return ids

    def _check_step_arrays(
        self, seq_ids: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        ids = self._check_seq_ids(seq_ids)
        pos = np.asarray(positions, dtype=np.int64)
        if pos.shape != ids.shape:
            raise InvalidArgumentError(
                f"one position per token: {len(ids)} sequence ids, positions of shape {pos.shape}"
            )
        return ids, pos

    def _check_next_positions(
        self, ids: np.ndarray, pos: np.ndarray, grouping: _StepGrouping
    ) -> None:
        # The k-th token of a sequence in this step must sit at its length + k.
        first_of_group = np.zeros(len(ids), dtype=np.int64)
        first_of_group[grouping.starts] = grouping.starts
        rank = np.arange(len(ids)) - np.maximum.accumulate(first_of_group)
        expected = np.empty(len(ids), dtype=np.int64)
        expected[grouping.order] = self._lengths[ids[grouping.order]] + rank
        wrong = np.flatnonzero(pos != expected)
        if len(wrong):
            token = int(wrong[0])
            seq = int(ids[token])
            raise InvalidArgumentError(
                f"sequence {seq}: token {token} has position {int(pos[token])}, expected "
                f"{int(expected[token])}; its positions in this step are "
                f"{pos[ids == seq].tolist()} but it holds [0, {int(self._lengths[seq])}), so "
                f"they must be {int(self._lengths[seq])}, {int(self._lengths[seq]) + 1}, ... "
                "in order (rewind the sequence first to overwrite positions)"
            )

    def _take_free_cells(self, count: int) -> np.ndarray:
        # Lowest first: holes below the high-water mark, then fresh cells above it.
        holes_below = self._high_water - 1 - self._used
        cells = np.empty(0, dtype=np.int64)
        if holes_below > 0:
            in_range = self._refcount[1 : self._high_water] == 0
            cells = np.flatnonzero(in_range)[:count] + 1
        fresh = count - len(cells)
        if fresh:
            cells = np.concatenate([cells, np.arange(self._high_water, self._high_water + fresh)])
            self._high_water += fresh
        self._used += count
        return cells

    def _live_cells(self, seq: int) -> np.ndarray:
        """The cell array of a live sequence (its callers checked that it is one)."""
        cells = self._cells[seq]
        assert cells is not None, f"sequence {seq} is released"
        return cells

    def _reserve(self, seq: int, length: int) -> None:
        cells = self._live_cells(seq)
        if length > len(cells):
            grown = np.empty(max(2 * len(cells), length), dtype=np.int64)
            grown[: self._lengths[seq]] = cells[: self._lengths[seq]]
            self._cells[seq] = grown

    def _drop(self, seq: int, pos: int) -> None:
        dropped = self._live_cells(seq)[pos : self._lengths[seq]]
        self._refcount[dropped] -= 1
        freed = dropped[self._refcount[dropped] == 0]
        self._position[freed] = -1
        self._used -= len(freed)
        self._lengths[seq] = pos
