"""Attention over cells: how a packed step's queries read their own K/V.

Owns: `CellAttention`, which turns a step's `AttentionPlan` into the arguments of the op
`cell_attention` once per step (`prepare`) and calls the op once per layer (`attend`);
and `cell_attention_torch`, the op's pure-torch implementation (gather each sequence's
cells, then two GEMMs and a softmax). The op itself (its schema, the compiled kernel
`kernels/cell_attention.cpp`, the choice between them) belongs to `cellbatch.model.ops`.
Promises: both implementations give each query the attention of transformers' eager
implementation over exactly the cells the plan gives its sequence, limited to a layer's
sliding window, with a result bit-identical whatever else shares the step (other
sequences, the query's place on the token axis, the chunking of its prompt; for the torch
implementation, a prompt chunk of one token rounds as a decode does, not as longer
chunks). Rows that no query names (padding) come out as zeros.
Never: writes the KV pool, or loops in Python over tokens or sequences.

The two implementations agree to rounding (not bit for bit: their sums run in different
orders), so a model uses one of them for its whole life.

The op's arguments (`AttentionArgs`): query i is token row `rows[i]` at position `pos[i]`;
its sequence's cells, in position order (index = position), start at
`cells[cell_offsets[i]]`; a sequence's queries are consecutive, and `block_starts` cuts
them into blocks of at most QUERY_BLOCK queries of one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cellbatch.cache import SCRATCH_CELL, AttentionGroup, AttentionPlan

# The torch implementation sums keys in blocks of this many positions (see _weighted_values).
KEY_BLOCK = 64
# Queries of one sequence go to the op in blocks of at most this many, so the compiled
# kernel reads each K/V row of a prompt chunk once per block rather than once per query.
QUERY_BLOCK = 16
# Fewest rows per GEMM call for which a row's result does not depend on the row count
# (measured on the development CPU). torch's own GEMMs: fp32 rounds calls of < 12 rows
# differently, bf16 only 1-row calls; fp16 is not measured, so it gets fp32's margin.
MIN_GEMM_ROWS: dict[torch.dtype, int] = {torch.float32: 16, torch.bfloat16: 2, torch.float16: 16}


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


@dataclass
class AttentionArgs:
    """A step's queries as the op `cell_attention` takes them (see the module docstring)."""

    cells: torch.Tensor  # every plan group's [G, Tk] cells, flattened and concatenated
    rows: torch.Tensor  # [Q] token row of each query
    positions: torch.Tensor  # [Q]
    cell_offsets: torch.Tensor  # [Q] where the query's sequence starts in `cells`
    block_starts: torch.Tensor  # [blocks + 1] query index at which each block starts
    num_tokens: int


class CellAttention:
    """What every decoder layer calls: `prepare(plan)` once per step, `attend` per layer.
    `op` is `cell_attention` of the model's ops table (`cellbatch.model.ops.Ops`)."""

    def __init__(self, heads: HeadShape, op) -> None:
        self.heads = heads
        self.op = op

    def prepare(self, plan: AttentionPlan) -> AttentionArgs:
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
            return AttentionArgs(empty, empty, empty, empty, torch.zeros(1, dtype=torch.long), 0)
        flags = torch.cat(starts)
        block_starts = torch.cat([torch.nonzero(flags).reshape(-1), torch.tensor([flags.shape[0]])])
        return AttentionArgs(
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
        prepared: AttentionArgs,
        window: int | None,
    ) -> torch.Tensor:
        """q [T, H, D] (rows may be strided) -> [T, H * D] in q's dtype."""
        h = self.heads
        out = q.new_empty(q.shape[0], h.num_heads * h.head_dim)
        out[prepared.num_tokens :].zero_()  # padding rows, which no query names
        self.op(
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


# -- the pure-torch implementation ---------------------------------------------------------


def cell_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cells: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    cell_offsets: torch.Tensor,
    block_starts: torch.Tensor,
    window: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The op `cell_attention` in pure torch: writes out[rows[i]] for every query i.

    The queries are regrouped as `CellCache.attention_plan` groups them (sequences with
    one query, then those with several), each group gathered and multiplied at once, laid
    out KV-head-major: the query heads sharing a KV head are stacked as rows of one
    product, so K/V are never repeated; scale and mask are applied inside the score GEMM
    (baddbmm). `block_starts` is not needed here: a group holds whole sequences.

    Batch invariance needs care that the compiled kernel gets for free: GEMM rounding
    depends on shapes, so keys are padded to whole KEY_BLOCKs aligned on positions,
    multi-query groups to at least MIN_GEMM_ROWS rows, and operands made contiguous so
    every group size takes the same GEMM path. One-query groups (decodes, and one-token
    prompt chunks) keep their fewer rows, so they round as one another, not as chunks.
    """
    if rows.numel() == 0:
        return
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    share = q.shape[1] // kv_heads
    min_query_rows = -(-MIN_GEMM_ROWS.get(q.dtype, 16) // share)
    for group in _groups(cells, rows, pos, cell_offsets):
        g = _group_work(group, window or None, kv_heads, share, min_query_rows, q.dtype)
        num_groups, num_queries = g.rows.shape
        batch = kv_heads * num_groups
        # q[rows]: [G, Tq, kv_heads * share, D] -> [kv_heads * G, share * Tq, D]
        query = (
            q[g.rows]
            .view(num_groups, num_queries, kv_heads, share, head_dim)
            .permute(2, 0, 3, 1, 4)
            .reshape(batch, share * num_queries, head_dim)
        )
        # One row gather each into contiguous [kv_heads * G, Tk, D]; the pool's dtype may
        # differ from q's.
        key, value = (
            cache.view(-1, head_dim)
            .index_select(0, g.key_rows)
            .view(batch, g.keys, head_dim)
            .to(q.dtype)
            for cache in (k_cache, v_cache)
        )
        scores = torch.baddbmm(g.bias, query, key.transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        attended = (
            _weighted_values(probs, value)
            .view(kv_heads, num_groups, share, num_queries, head_dim)
            .permute(1, 3, 0, 2, 4)
            .reshape(num_groups * num_queries, share * kv_heads * head_dim)
        )
        out.index_copy_(0, g.dest, attended if g.valid is None else attended[g.valid])


def _groups(
    cells: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, cell_offsets: torch.Tensor
) -> list[AttentionGroup]:
    """The op's queries as plan groups: one of the sequences with a single query, one of
    those with several (padded to the most queries; keys to the highest position + 1)."""
    device = cells.device
    offsets, counts = torch.unique_consecutive(cell_offsets, return_counts=True)
    first = torch.cumsum(counts, 0) - counts
    single = counts == 1
    groups = []
    for selected in (single, ~single):
        if not bool(selected.any()):
            continue
        seq_first, seq_count, seq_offset = first[selected], counts[selected], offsets[selected]
        query_offsets = torch.arange(int(seq_count.max()), device=device)
        query_valid = query_offsets < seq_count[:, None]
        # Padded queries repeat the sequence's last query: any valid row will do.
        index = seq_first[:, None] + torch.minimum(query_offsets, seq_count[:, None] - 1)
        query_pos = torch.where(query_valid, pos[index], 0)
        key_len = query_pos.max(dim=1).values + 1
        keys = torch.arange(int(key_len.max()), device=device)
        key_valid = keys < key_len[:, None]
        key_index = (seq_offset[:, None] + keys).clamp_(max=cells.shape[0] - 1)
        groups.append(
            AttentionGroup(
                rows=rows[index],
                cells=torch.where(key_valid, cells[key_index], SCRATCH_CELL),
                query_pos=query_pos,
                query_valid=query_valid,
                key_len=key_len,
            )
        )
    return groups


@dataclass
class _GroupWork:
    """One plan group prepared for one window size."""

    rows: torch.Tensor  # [G, Tq] query rows (padded queries repeat a valid row)
    key_rows: torch.Tensor  # [kv_heads * G * Tk] rows of the pool seen as [cells * kv_heads, D]
    keys: int  # Tk: keys per sequence, a multiple of KEY_BLOCK (pad: the scratch cell)
    bias: torch.Tensor  # [kv_heads * G, share * Tq, Tk] 0 where visible, -inf where not
    dest: torch.Tensor  # [N] token rows the valid queries write
    valid: torch.Tensor | None  # [G * Tq] bool, None when every query is valid


def _group_work(
    group: AttentionGroup,
    window: int | None,
    kv_heads: int,
    share: int,
    min_query_rows: int,
    dtype: torch.dtype,
) -> _GroupWork:
    rows, cells, visible, valid = group.rows, group.cells, group.mask(window), group.query_valid
    if window is not None:
        # Blocks of keys wholly at positions <= (lowest query position) - window are
        # invisible to the whole group: leave them out of the gather.
        lowest = int(group.query_pos[valid].min())
        start = max(0, lowest - window + 1) // KEY_BLOCK * KEY_BLOCK
        cells, visible = cells[:, start:], visible[..., start:]
    pad_keys = -cells.shape[1] % KEY_BLOCK
    cells = F.pad(cells, (0, pad_keys), value=SCRATCH_CELL)
    visible = F.pad(visible, (0, pad_keys), value=False)
    num_groups, num_queries = rows.shape
    if 1 < num_queries < min_query_rows:
        extra = min_query_rows - num_queries
        rows = torch.cat([rows, rows[:, -1:].expand(num_groups, extra)], dim=1)
        visible = torch.cat([visible, visible[:, :, -1:].expand(-1, -1, extra, -1)], dim=2)
        valid = F.pad(valid, (0, extra), value=False)
        num_queries = min_query_rows
    keys = cells.shape[1]
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    bias.masked_fill_(~visible, float("-inf"))
    # [G, 1, Tq, Tk] -> [kv_heads * G, share * Tq, Tk], the layout of the score products.
    bias = bias[None].expand(kv_heads, num_groups, share, num_queries, keys)
    # Row h + kv_heads * cell of the pool seen as [cells * kv_heads, D] is head h of that
    # cell: one row gather yields K/V already laid out [kv_heads, G, Tk, D].
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
