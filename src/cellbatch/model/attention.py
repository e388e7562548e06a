"""Attention over cells: how a packed step's queries read their own K/V.

Owns: `CellAttention`, which turns a step's `AttentionPlan` into the arguments of the op
`cell_attention` once per step (`prepare`) and calls the op once per layer (`attend`);
and `cell_attention_torch`, the op's pure-torch implementation (blockwise: waves of a
sequence's queries, each against its own context, gathered, then two GEMMs and a
softmax). The op itself (its schema, the compiled kernel `kernels/cell_attention.cpp`,
the choice between them) belongs to `cellbatch.model.ops`.
Promises: both implementations give each query the attention of transformers' eager
implementation over exactly the cells the plan gives its sequence, limited to a layer's
sliding window, with a result bit-identical whatever else shares the step (other
sequences, the query's place on the token axis, the chunking of its prompt; for the torch
implementation, a prompt chunk of one token rounds as a decode does, not as longer
chunks). Rows that no query names (padding) come out as zeros.
Never: writes the KV pool, or loops in Python over tokens or sequences.

The two implementations agree to rounding (not bit for bit: their sums run in different
orders), so a model uses one of them for its whole life.

The op's arguments (`FlatAttentionPlan`, the plan in flat form: `cellbatch.cache.flatten_plan`,
which an exported program's runtime builds too): query i is token row `rows[i]` at
position `pos[i]`; its sequence's cells, in position order (index = position), start at
`cells[cell_offsets[i]]`; a sequence's queries are consecutive, and `block_starts` cuts
them into blocks of at most QUERY_BLOCK queries of one sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cellbatch.cache import AttentionPlan, FlatAttentionPlan, flatten_plan
from cellbatch.kv_format import read_heads
from cellbatch.kv_pool import SCRATCH_CELL
from cellbatch.types import ModelGeometry

# The torch implementation sums keys in blocks of this many positions (see _weighted_values).
KEY_BLOCK = 64
# It takes a sequence's queries in waves of at most this many, each against the keys up to
# its own last position, and batches waves while their scores fit in this many elements.
QUERY_WAVE = 128
SCORE_BUDGET = 1 << 22
# Queries of one sequence go to the op in blocks of at most this many, so the compiled
# kernel reads each K/V row of a prompt chunk once per block rather than once per query.
QUERY_BLOCK = 16
# Fewest rows per GEMM call for which a row's result does not depend on the row count
# (measured on the development CPU). torch's own GEMMs: fp32 rounds calls of < 12 rows
# differently, bf16 only 1-row calls; fp16 is not measured, so it gets fp32's margin.
MIN_GEMM_ROWS: dict[torch.dtype, int] = {torch.float32: 16, torch.bfloat16: 2, torch.float16: 16}


class CellAttention:
    """What every decoder layer calls: `prepare(plan)` once per step, `attend` per layer.
    `op` is `cell_attention` of the model's ops table (`cellbatch.model.ops.Ops`)."""

    def __init__(self, geometry: ModelGeometry, op: Callable[..., None]) -> None:
        self.geometry = geometry
        self.op = op

    def prepare(self, plan: AttentionPlan) -> FlatAttentionPlan:
        return flatten_plan(plan, QUERY_BLOCK)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        prepared: FlatAttentionPlan,
        window: int | None,
    ) -> torch.Tensor:
        """q [T, H, D] (rows may be strided) -> [T, H * D] in q's dtype."""
        h = self.geometry
        out = q.new_empty(q.shape[0], h.num_heads * h.head_dim)
        if prepared.num_tokens < out.shape[0]:
            out[prepared.num_tokens :].zero_()  # padding rows, which no query names
        self.op(
            q if q.stride(-1) == 1 and q.stride(-2) == h.head_dim else q.contiguous(),
            k_cache,
            v_cache,
            *prepared.tensors,
            window or 0,
            h.attention_scale,
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

    Blockwise: each sequence's queries are cut into waves of at most QUERY_WAVE, and a
    wave reads only the keys up to its own last position (from the first its window
    needs), so a long prompt chunk costs causal attention over its own context and never
    holds its whole score matrix. Waves of similar context length are batched into one
    product while their scores fit SCORE_BUDGET (`_batches`). A batch is laid out
    KV-head-major: the query heads sharing a KV head are stacked as rows of one product,
    so K/V are never repeated; scale and mask are applied inside the score GEMM (baddbmm).
    `block_starts` is not needed here.

    Batch invariance needs care that the compiled kernel gets for free: GEMM rounding
    depends on shapes, so keys are padded to whole KEY_BLOCKs aligned on positions, every
    wave to at least MIN_GEMM_ROWS rows, and operands made contiguous so every batch takes
    the same GEMM path; a query's result then depends neither on its wave's other queries
    nor on how far its batch's keys reach. A decode's one query is padded too: it must
    round as the same query in a chunk does (a speculative step's verified rows stand for
    decodes), and fp32 GEMMs of one query's rows round differently from those of 16 on
    some CPUs (an AVX512 AMD EPYC).
    """
    if rows.numel() == 0:
        return
    kv_heads, head_dim = k_cache.shape[1], q.shape[2]
    share = q.shape[1] // kv_heads
    min_query_rows = -(-MIN_GEMM_ROWS.get(q.dtype, 16) // share)
    waves = _waves(pos, cell_offsets, window or None)
    for batch in _batches(waves, kv_heads * share, min_query_rows):
        g = _batch_work(
            batch, cells, rows, pos, window or None, kv_heads, share, min_query_rows, q.dtype
        )
        num_waves, num_queries = g.rows.shape
        size = kv_heads * num_waves
        # q[rows]: [W, Tq, kv_heads * share, D] -> [kv_heads * W, share * Tq, D]
        query = (
            q[g.rows]
            .view(num_waves, num_queries, kv_heads, share, head_dim)
            .permute(2, 0, 3, 1, 4)
            .reshape(size, share * num_queries, head_dim)
        )
        # One row gather each into contiguous [kv_heads * W, Tk, D]; the pool's dtype may
        # differ from q's (int8 rows carry their scale).
        key, value = (
            read_heads(cache.view(-1, cache.shape[2]).index_select(0, g.key_rows), q.dtype).view(
                size, g.keys, head_dim
            )
            for cache in (k_cache, v_cache)
        )
        scores = torch.baddbmm(g.bias, query, key.transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        attended = (
            _weighted_values(probs, value)
            .view(kv_heads, num_waves, share, num_queries, head_dim)
            .permute(1, 3, 0, 2, 4)
            .reshape(num_waves * num_queries, share * kv_heads * head_dim)
        )
        out.index_copy_(0, g.dest, attended if g.valid is None else attended[g.valid])


@dataclass
class _Waves:
    """Each sequence's queries cut into waves of at most QUERY_WAVE (one entry per wave)."""

    first: torch.Tensor  # index of the wave's first query
    offset: torch.Tensor  # where its sequence's cells start in the op's `cells`
    count: torch.Tensor  # its number of queries
    lowest: torch.Tensor  # the lowest key position any of its queries sees
    keys: torch.Tensor  # keys it spans: KEY_BLOCK-aligned, from `lowest`'s block to its last


def _waves(pos: torch.Tensor, cell_offsets: torch.Tensor, window: int | None) -> _Waves:
    offsets, counts = torch.unique_consecutive(cell_offsets, return_counts=True)
    per_sequence = -(-counts // QUERY_WAVE)
    sequence = torch.repeat_interleave(torch.arange(len(counts)), per_sequence)
    before = torch.cumsum(per_sequence, 0) - per_sequence
    rank = torch.arange(len(sequence)) - before[sequence]
    first = (torch.cumsum(counts, 0) - counts)[sequence] + rank * QUERY_WAVE
    count = torch.clamp(counts[sequence] - rank * QUERY_WAVE, max=QUERY_WAVE)
    highest = pos[first + count - 1]
    lowest = torch.zeros_like(highest) if window is None else (pos[first] - window + 1).clamp(0)
    start = lowest // KEY_BLOCK * KEY_BLOCK
    keys = (highest + 1 - start + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK
    return _Waves(first, offsets[sequence], count, lowest, keys)


def _batches(waves: _Waves, heads: int, min_query_rows: int) -> list[_Waves]:
    """The waves in batches of similar key counts, each holding about SCORE_BUDGET scores
    (a wave alone may hold more)."""
    query_rows = waves.count.clamp(min=min_query_rows)
    order = torch.argsort(waves.keys, stable=True)
    cost = (heads * query_rows * waves.keys)[order]
    # Consecutive waves share a batch while their running cost stays in one budget's worth.
    running = torch.cumsum(cost, 0) - cost
    label = running // SCORE_BUDGET
    _, sizes = torch.unique_consecutive(label, return_counts=True)
    fields = [getattr(waves, field.name) for field in dataclasses.fields(_Waves)]
    return [
        _Waves(*(field[part] for field in fields)) for part in torch.split(order, sizes.tolist())
    ]


@dataclass
class _BatchWork:
    """One batch of waves, prepared for the products."""

    rows: torch.Tensor  # [W, Tq] query rows (padded queries repeat a valid row)
    key_rows: torch.Tensor  # [kv_heads * W * Tk] rows of the pool seen as [cells * kv_heads, D]
    keys: int  # Tk: keys per wave, a multiple of KEY_BLOCK (pad: the scratch cell)
    bias: torch.Tensor  # [kv_heads * W, share * Tq, Tk] 0 where visible, -inf where not
    dest: torch.Tensor  # [N] token rows the valid queries write
    valid: torch.Tensor | None  # [W * Tq] bool, None when every query is valid


def _batch_work(
    batch: _Waves,
    cells: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    window: int | None,
    kv_heads: int,
    share: int,
    min_query_rows: int,
    dtype: torch.dtype,
) -> _BatchWork:
    device = cells.device
    num_queries = max(int(batch.count.max()), min_query_rows)
    query_offsets = torch.arange(num_queries, device=device)
    valid = query_offsets < batch.count[:, None]
    # Padded queries repeat the wave's last query: any valid row will do.
    index = batch.first[:, None] + torch.minimum(query_offsets, batch.count[:, None] - 1)
    query_pos = pos[index]
    # Key k of the batch is position start + k; start is KEY_BLOCK-aligned so that every
    # wave's keys sit in the same blocks whatever batch it is in.
    start = int(batch.lowest.min()) // KEY_BLOCK * KEY_BLOCK
    keys = int((batch.lowest // KEY_BLOCK * KEY_BLOCK + batch.keys).max()) - start
    key_pos = start + torch.arange(keys, device=device)
    wanted = key_pos <= query_pos.max(dim=1).values[:, None]  # [W, Tk]
    key_index = (batch.offset[:, None] + key_pos).clamp(max=cells.shape[0] - 1)
    key_cells = torch.where(wanted, cells[key_index], SCRATCH_CELL)
    visible = key_pos <= query_pos[:, :, None]
    if window is not None:
        visible &= key_pos > query_pos[:, :, None] - window
    # A padded query sees its wave's first key only, so softmax never meets an all-masked
    # row (its result is dropped).
    visible = torch.where(valid[:, :, None], visible, key_pos == key_pos[0])
    bias = torch.zeros(visible.shape, dtype=dtype, device=device)
    bias.masked_fill_(~visible, float("-inf"))
    num_waves = index.shape[0]
    # [W, Tq, Tk] -> [kv_heads * W, share * Tq, Tk], the layout of the score products.
    bias = bias[None, :, None].expand(kv_heads, num_waves, share, num_queries, keys)
    # Row h + kv_heads * cell of the pool seen as [cells * kv_heads, D] is head h of that
    # cell: one row gather yields K/V already laid out [kv_heads, W, Tk, D].
    heads = torch.arange(kv_heads, device=device)[:, None]
    all_valid = bool(valid.all())
    wave_rows = rows[index]
    return _BatchWork(
        rows=wave_rows,
        key_rows=(key_cells.reshape(1, -1) * kv_heads + heads).reshape(-1),
        keys=keys,
        bias=bias.reshape(kv_heads * num_waves, share * num_queries, keys),
        dest=wave_rows.reshape(-1) if all_valid else wave_rows[valid],
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
