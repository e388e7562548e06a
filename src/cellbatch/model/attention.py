"""Attention over cells: the two ways a packed step's queries read their own K/V.

Owns: `KernelAttention` (one compiled op per layer, `cellbatch.model.kernels`) and
`GatherAttention` (pure torch: gather each plan group's cells, then two GEMMs and a softmax).
Promises: both give each query the attention of transformers' eager implementation over
exactly the cells the `AttentionPlan` gives its sequence, limited to a layer's sliding window,
with a result bit-identical whatever else shares the step (other sequences, the query's place
on the token axis, the chunking of its prompt). `prepare(plan)` runs once per step;
`attend(...)` once per layer. Rows that are not in the plan (padding) come out as zeros.
Never: writes the KV pool, or loops in Python over tokens or sequences.

The two agree to rounding (not bit for bit: their sums run in different orders), so a model
uses one of them for its whole life.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from cellbatch.cache import AttentionPlan

# GatherAttention sums keys in blocks of this many positions (see _weighted_values).
KEY_BLOCK = 64
# KernelAttention hands out queries of one sequence in blocks of at most this many, so a
# prompt chunk reads each K/V row once per block rather than once per query.
QUERY_BLOCK = 16


@dataclass(frozen=True)
class HeadShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def share(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


class CellAttention(Protocol):
    """What a decoder layer calls; see the module docstring for the promises."""

    kind: str

    def prepare(self, plan: AttentionPlan, scratch_cell: int) -> object: ...

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        prepared: object,
        window: int | None,
    ) -> torch.Tensor: ...


# -- the compiled kernel -----------------------------------------------------------------


@dataclass
class KernelPlan:
    """The step's queries in blocks of one sequence, as the op takes them."""

    cells: torch.Tensor  # every group's [G, Tk] cells, flattened and concatenated
    rows: torch.Tensor  # [Q] token row of each query
    positions: torch.Tensor  # [Q]
    cell_offsets: torch.Tensor  # [Q] where the query's sequence starts in `cells`
    block_starts: torch.Tensor  # [blocks + 1] query index at which each block starts
    num_tokens: int


class KernelAttention:
    kind = "kernel"

    def __init__(self, heads: HeadShape, ops: Any) -> None:
        self.heads = heads
        self._op = ops.cell_attention

    def prepare(self, plan: AttentionPlan, scratch_cell: int) -> KernelPlan:
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
            # Valid queries are a prefix of each row, so this marks every QUERY_BLOCK-th
            # query of each sequence, its first included.
            starts.append(query_index[valid] % QUERY_BLOCK == 0)
            base += num_groups * keys
        if not cells:
            empty = torch.zeros(0, dtype=torch.long)
            return KernelPlan(empty, empty, empty, empty, torch.zeros(1, dtype=torch.long), 0)
        flags = torch.cat(starts)
        block_starts = torch.cat([torch.nonzero(flags).reshape(-1), torch.tensor([flags.shape[0]])])
        return KernelPlan(
            cells=torch.cat(cells).contiguous(),
            rows=torch.cat(rows),
            positions=torch.cat(positions),
            cell_offsets=torch.cat(offsets),
            block_starts=block_starts,
            num_tokens=plan.num_tokens,
        )

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        prepared: KernelPlan,
        window: int | None,
    ) -> torch.Tensor:
        h = self.heads
        out = q.new_empty(q.shape[0], h.num_heads * h.head_dim)
        out[prepared.num_tokens :].zero_()  # padding rows, which no query names
        self._op(
            q if q.stride(-1) == 1 and q.stride(-2) == h.head_dim else q.contiguous(),
            k_cache,
            v_cache,
            prepared.cells,
            prepared.rows,
            prepared.positions,
            prepared.cell_offsets,
            prepared.block_starts,
            window or 0,
            h.scale,
            out,
        )
        return out


# -- the pure-torch gather path ------------------------------------------------------------


@dataclass
class _GroupWork:
    """One plan group prepared for one window size: what every layer of that window reads."""

    rows: torch.Tensor  # [G, Tq] query rows (padded queries repeat a valid row)
    key_rows: torch.Tensor  # [kv_heads * G * Tk] rows of the pool seen as [cells * kv_heads, D]
    keys: int  # Tk: keys per sequence, a multiple of KEY_BLOCK (pad: the scratch cell)
    bias: torch.Tensor  # [kv_heads * G, share * Tq, Tk] 0 where visible, -inf where not
    dest: torch.Tensor  # [N] token rows the valid queries write
    valid: torch.Tensor | None  # [G * Tq] bool, None when every query is valid


@dataclass
class _GatherPlan:
    plan: AttentionPlan
    scratch_cell: int
    by_window: dict[int | None, list[_GroupWork]] = field(default_factory=dict)


class GatherAttention:
    """Batch invariance here needs care that the kernel gets for free: GEMM rounding depends
    on shapes, so keys are padded to whole KEY_BLOCKs aligned on positions, multi-token
    groups to at least `min_rows` query rows, and operands made contiguous so every group
    size takes the same GEMM path."""

    kind = "gather"

    def __init__(self, heads: HeadShape, dtype: torch.dtype, min_rows: int) -> None:
        self.heads = heads
        self.dtype = dtype
        # Attention products stack `share` heads per query: this many queries fill min_rows.
        self.min_query_rows = -(-min_rows // heads.share)

    def prepare(self, plan: AttentionPlan, scratch_cell: int) -> _GatherPlan:
        return _GatherPlan(plan, scratch_cell)

    def _work(self, prepared: _GatherPlan, window: int | None) -> list[_GroupWork]:
        work = prepared.by_window.get(window)
        if work is None:
            work = [
                self._group_work(group, window, prepared.scratch_cell)
                for group in prepared.plan.groups
            ]
            prepared.by_window[window] = work
        return work

    def _group_work(self, group, window: int | None, scratch_cell: int) -> _GroupWork:
        kv_heads, share = self.heads.num_kv_heads, self.heads.share
        rows, cells, visible, valid = group.rows, group.cells, group.mask(window), group.query_valid
        if window is not None:
            # Blocks of keys wholly at positions <= (lowest query position) - window are
            # invisible to the whole group: leave them out of the gather.
            lowest = int(group.query_pos[valid].min())
            start = max(0, lowest - window + 1) // KEY_BLOCK * KEY_BLOCK
            cells, visible = cells[:, start:], visible[..., start:]
        pad_keys = -cells.shape[1] % KEY_BLOCK
        cells = F.pad(cells, (0, pad_keys), value=scratch_cell)
        visible = F.pad(visible, (0, pad_keys), value=False)
        num_groups, num_queries = rows.shape
        if 1 < num_queries < self.min_query_rows:
            extra = self.min_query_rows - num_queries
            rows = torch.cat([rows, rows[:, -1:].expand(num_groups, extra)], dim=1)
            visible = torch.cat([visible, visible[:, :, -1:].expand(-1, -1, extra, -1)], dim=2)
            valid = F.pad(valid, (0, extra), value=False)
            num_queries = self.min_query_rows
        keys = cells.shape[1]
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=visible.device)
        bias.masked_fill_(~visible, float("-inf"))
        # [G, 1, Tq, Tk] -> [kv_heads * G, share * Tq, Tk], the layout of the score products.
        bias = bias[None].expand(kv_heads, num_groups, share, num_queries, keys)
        # Row h + kv_heads * cell of the pool seen as [cells * kv_heads, D] is head h of
        # that cell: one row gather yields K/V already laid out [kv_heads, G, Tk, D].
        heads = torch.arange(kv_heads, device=cells.device)[:, None]
        all_valid = bool(valid.all())
        return _GroupWork(
            rows=rows,
            key_rows=(cells.reshape(1, -1) * kv_heads + heads).reshape(-1),
            keys=keys,
            bias=bias.reshape(kv_heads * num_groups, share * num_queries, keys),
            dest=rows.reshape(-1) if all_valid else rows[valid],
            valid=None if all_valid else valid.reshape(-1),
        )

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        prepared: _GatherPlan,
        window: int | None,
    ) -> torch.Tensor:
        """Laid out KV-head-major: the query heads sharing a KV head are stacked as rows of
        one product, so K/V are never repeated; scale and mask are applied inside the score
        GEMM (baddbmm)."""
        h = self.heads
        kv_heads, head_dim, share = h.num_kv_heads, h.head_dim, h.share
        out = q.new_zeros(q.shape[0], h.num_heads * head_dim)
        for g in self._work(prepared, window):
            num_groups, num_queries = g.rows.shape
            batch = kv_heads * num_groups
            # q[rows]: [G, Tq, kv_heads * share, D] -> [kv_heads * G, share * Tq, D]
            query = (
                q[g.rows]
                .view(num_groups, num_queries, kv_heads, share, head_dim)
                .permute(2, 0, 3, 1, 4)
                .reshape(batch, share * num_queries, head_dim)
            )
            # One row gather each into contiguous [kv_heads * G, Tk, D]; the pool's dtype
            # may differ from ours.
            key, value = (
                cache.view(-1, head_dim)
                .index_select(0, g.key_rows)
                .view(batch, g.keys, head_dim)
                .to(q.dtype)
                for cache in (k_cache, v_cache)
            )
            scores = torch.baddbmm(g.bias, query, key.transpose(1, 2), alpha=h.scale)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            attended = (
                _weighted_values(probs, value)
                .view(kv_heads, num_groups, share, num_queries, head_dim)
                .permute(1, 3, 0, 2, 4)
                .reshape(num_groups * num_queries, h.num_heads * head_dim)
            )
            out.index_copy_(0, g.dest, attended if g.valid is None else attended[g.valid])
        return out


def _weighted_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [B, M, Tk] @ values [B, Tk, D] -> [B, M, D], batch-invariantly.

    fp32 GEMMs choose how to split the Tk sum from Tk itself, so a padded Tk changed the
    rounding; there the sum runs as fixed KEY_BLOCK-key products added in block order
    (masked keys add exact zeros). bf16/fp16 GEMMs proved invariant to Tk in one call,
    which also keeps their fp32 accumulation over all keys.
    """
    if probs.dtype != torch.float32:
        return torch.bmm(probs, values)
    batch, rows, keys = probs.shape
    blocks = keys // KEY_BLOCK
    per_block = torch.matmul(
        probs.view(batch, rows, blocks, KEY_BLOCK).transpose(1, 2),
        values.view(batch, blocks, KEY_BLOCK, values.shape[-1]),
    )
    return per_block.sum(dim=1)
