"""Attention over cells for a model on a torch device (a CUDA GPU above all), in plain
torch: the candidates a CUDA executor chooses between by measurement
(docs/design.md#attention-on-a-device).

Owns: `CellGroup` and `CellRows` (a step's attention as groups of queries over their
keys' cells: the form both candidates take, on the model's device), building them from a
cache's `AttentionPlan` (`group_rows` for a wide step; `row_table` for a decode width,
one group of W one-query rows whose key tables a graph keeps in static buffers), and
`DeviceAttention`, what a model's layers call: `attend` per layer over one of
ATTENTION_KINDS:
- "sdpa": each group's K/V gathered from the pool ([G, kv_heads, Tk, D], one row gather),
  then torch's scaled_dot_product_attention with a boolean mask (positions and window);
  the query heads sharing a KV head are folded into the query length, so K/V are never
  repeated per head;
- "flex": FlexAttention over the pool itself, not a gathered copy: each group is a batch
  element over every pool row, with a block mask built from its key table (the blocks of
  KV_BLOCK rows holding its cells) and a mask_mod that keeps a row only when the group's
  sequence holds that cell at a position its query sees. It reads a per-cell position
  mirror (`place`, written by each forward, so graphs update it too).
Promises: both give each query transformers' attention over exactly its sequence's cells
at positions <= its own (within a sliding window when the layer has one), in the query's
dtype, with softmax in float32; neither syncs with the host in a decode step (no .item(),
no boolean indexing, no data-dependent shapes), so a CUDA graph can capture it; both run
on the CPU too (slowly: FlexAttention unfused), where tests hold them to the reference.
A padded query (a graph's padding row, or `valid` False) sees one key and is never read.
Never: writes the KV pool (the model's rope_store does), or promises bits equal to the
CPU kernel's (their sums run in another order).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from cellbatch.cache import AttentionPlan
from cellbatch.kv_pool import SCRATCH_CELL
from cellbatch.types import InvalidArgumentError, ModelGeometry

ATTENTION_KINDS = ("sdpa", "flex")
# Key tables are padded to a multiple of this many positions (masked scratch cells): the
# GPU kernels want aligned mask rows, and a graph's key bucket starts here.
KEY_ALIGN = 64
# FlexAttention's blocks of pool rows (its default sparse block size).
KV_BLOCK = 128


@dataclass
class CellGroup:
    """G sequences' queries (Tq each, padded) over their keys (Tk each, padded)."""

    rows: torch.Tensor  # [G, Tq] long: token row of each query (padded: a valid row)
    cells: torch.Tensor  # [G, Tk] long: key k is the sequence's cell of position k (pad: scratch)
    positions: torch.Tensor  # [G, Tq] long: each query's position (padded: 0)
    valid: torch.Tensor | None  # [G, Tq] bool; None: every query is real


@dataclass
class CellRows:
    """A step's attention on the model's device: every token is one query of one group."""

    groups: list[CellGroup]
    num_tokens: int


def group_rows(plan: AttentionPlan, device: torch.device) -> CellRows:
    """The plan's groups on `device`, key tables padded to a multiple of KEY_ALIGN."""
    groups = []
    for group in plan.groups:
        keys = group.cells.shape[1]
        pad = -keys % KEY_ALIGN
        cells = F.pad(group.cells, (0, pad), value=SCRATCH_CELL) if pad else group.cells
        valid = None if bool(group.query_valid.all()) else group.query_valid.to(device)
        groups.append(
            CellGroup(
                rows=group.rows.to(device),
                cells=cells.to(device),
                positions=group.query_pos.to(device),
                valid=valid,
            )
        )
    return CellRows(groups, plan.num_tokens)


def key_bucket(plan: AttentionPlan) -> int:
    """The key-table width a decode call over `plan` takes: its longest sequence's key
    count rounded up to a power of two, at least KEY_ALIGN (so a graph is captured per
    bucket, not per length)."""
    longest = max((group.cells.shape[1] for group in plan.groups), default=1)
    return max(KEY_ALIGN, 1 << (longest - 1).bit_length())


def row_table(plan: AttentionPlan, width: int, keys: int) -> np.ndarray:
    """[width, keys] int64: row i's sequence's cells in position order (scratch past its
    length), for the tokens of `plan` (rows 0 .. num_tokens - 1); rows past them (a
    graph's padding rows) hold only the scratch cell."""
    if plan.num_tokens > width:
        raise InvalidArgumentError(
            f"row_table: {plan.num_tokens} tokens do not fit a width of {width}"
        )
    table = np.full((width, keys), SCRATCH_CELL, dtype=np.int64)
    for group in plan.groups:
        valid = group.query_valid.numpy()
        if group.cells.shape[1] > keys:
            raise InvalidArgumentError(
                f"row_table: a sequence of {group.cells.shape[1]} keys does not fit {keys}"
            )
        which = np.nonzero(valid)[0]  # the group of each valid query
        table[group.rows.numpy()[valid], : group.cells.shape[1]] = group.cells.numpy()[which]
    return table


# -- the candidates ---------------------------------------------------------------------


def _visible(group: CellGroup, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[G, Tq, keys] bool: key k (position k) is visible to its query; a padded query
    sees key 0 only, so softmax never meets an all-masked row."""
    key_pos = torch.arange(keys, device=device)
    query_pos = group.positions[..., None]
    visible = key_pos <= query_pos
    if window is not None:
        visible = visible & (key_pos > query_pos - window)
    if group.valid is not None:
        visible = torch.where(group.valid[..., None], visible, key_pos == 0)
    return visible


def sdpa_over_cells(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: CellGroup,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D] over one group's gathered cells -> [G * Tq, H * D], query (g, t) at
    row g * Tq + t."""
    num_groups, num_queries = group.rows.shape
    keys = group.cells.shape[1]
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    heads = q.shape[1]
    share = heads // kv_heads
    query = (
        q.index_select(0, group.rows.reshape(-1))
        .view(num_groups, num_queries, kv_heads, share, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(num_groups, kv_heads, share * num_queries, head_dim)
    )
    # Row h + kv_heads * cell of the pool seen as [cells * kv_heads, D] is KV head h of that
    # cell: one gather lays K/V out [G, kv_heads, Tk, D].
    head = torch.arange(kv_heads, device=q.device)[None, :, None]
    pool_rows = (group.cells[:, None, :] * kv_heads + head).reshape(-1)
    key, value = (
        cache.view(-1, head_dim)
        .index_select(0, pool_rows)
        .view(num_groups, kv_heads, keys, head_dim)
        .to(q.dtype)
        for cache in (k_cache, v_cache)
    )
    visible = _visible(group, keys, window, q.device)
    mask = (
        visible[:, None, None]
        .expand(num_groups, 1, share, num_queries, keys)
        .reshape(num_groups, 1, share * num_queries, keys)
    )
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return (
        out.view(num_groups, kv_heads, share, num_queries, head_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(num_groups * num_queries, heads * head_dim)
    )


_FlexFn = Callable[..., torch.Tensor]
_COMPILED_FLEX: dict[str, _FlexFn] = {}


def _flex_function(device: torch.device) -> _FlexFn:
    """flex_attention compiled for a GPU (its fused kernel); on the CPU the unfused one."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cpu":
        return flex_attention
    compiled = _COMPILED_FLEX.get(device.type)
    if compiled is None:
        compiled = torch.compile(flex_attention, dynamic=False)
        _COMPILED_FLEX[device.type] = compiled
    return compiled


def flex_over_pool(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: CellGroup,
    cell_positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D] over the pool rows its group's sequences hold -> [G * Tq, H * D], as
    `sdpa_over_cells`. `cell_positions` [pool rows]: the position each row last stored."""
    from torch.nn.attention.flex_attention import BlockMask

    num_groups, num_queries = group.rows.shape
    keys = group.cells.shape[1]
    rows, _, head_dim = k_cache.shape
    heads = q.shape[1]
    device = q.device
    query = (
        q.index_select(0, group.rows.reshape(-1))
        .view(num_groups, num_queries, heads, head_dim)
        .transpose(1, 2)
    )
    key = k_cache.permute(1, 0, 2).unsqueeze(0).to(q.dtype)  # [1, kv_heads, rows, D]
    value = v_cache.permute(1, 0, 2).unsqueeze(0).to(q.dtype)
    table, positions = group.cells, group.positions
    # The pool blocks each group reads: those holding a cell it may see (up to its last
    # query's position); the rest of the table maps to the block of its first cell.
    limit = positions.amax(dim=1, keepdim=True)
    in_reach = torch.arange(keys, device=device) <= limit
    blocks = torch.where(in_reach, table, table[:, :1]) // KV_BLOCK
    num_blocks = -(-rows // KV_BLOCK)
    held = torch.zeros(num_groups, num_blocks, dtype=torch.bool, device=device)
    held.scatter_(1, blocks, True)
    count = held.sum(dim=1, dtype=torch.int32)
    order = torch.argsort((~held).to(torch.int8), dim=1, stable=True).to(torch.int32)
    query_blocks = -(-num_queries // KV_BLOCK)
    kv_num_blocks = count[:, None, None].expand(num_groups, 1, query_blocks).contiguous()
    kv_indices = order[:, None, None, :].expand(num_groups, 1, query_blocks, num_blocks)
    valid = group.valid

    def mask_mod(b: Any, h: Any, q_index: Any, kv_index: Any) -> Any:
        held_at = cell_positions[kv_index]
        query_at = positions[b, q_index]
        at = torch.clamp(held_at, 0, keys - 1)
        seen = (held_at >= 0) & (held_at <= query_at) & (table[b, at] == kv_index)
        if window is not None:
            seen = seen & (held_at > query_at - window)
        if valid is not None:
            seen = torch.where(valid[b, q_index], seen, kv_index == table[b, 0])
        return seen

    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices.contiguous(),
        BLOCK_SIZE=(KV_BLOCK, KV_BLOCK),
        mask_mod=mask_mod,
        seq_lengths=(num_queries, rows),
        compute_q_blocks=False,
    )
    with warnings.catch_warnings():  # the CPU's unfused FlexAttention says it is slow
        warnings.simplefilter("ignore", UserWarning)
        out = _flex_function(device)(
            query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True
        )
    return out.transpose(1, 2).reshape(num_groups * num_queries, heads * head_dim)


class DeviceAttention:
    """What every decoder layer of a model on a device calls (`attend`), over one kind
    of ATTENTION_KINDS. "flex" keeps the position of every pool row on the device:
    `fit_pool` sizes that mirror (after the pool grows); each attend records the cells
    its queries wrote."""

    def __init__(self, geometry: ModelGeometry, device: torch.device, kind: str = "sdpa") -> None:
        if kind not in ATTENTION_KINDS:
            raise InvalidArgumentError(
                f"unknown attention {kind!r}; use one of {', '.join(ATTENTION_KINDS)}"
            )
        self.geometry = geometry
        self.device = device
        self.kind = kind
        self.cell_positions: torch.Tensor | None = None

    def prepare(self, plan: AttentionPlan) -> CellRows:
        """A wide step's plan on the device (`group_rows`)."""
        return group_rows(plan, self.device)

    def fit_pool(self, rows: int) -> None:
        """Makes the position mirror cover `rows` pool rows (kept positions copied over;
        new rows hold -1, no position). Only "flex" keeps one."""
        if self.kind != "flex":
            return
        mirror = self.cell_positions
        if mirror is not None and mirror.shape[0] >= rows:
            return
        grown = torch.full((rows,), -1, dtype=torch.long, device=self.device)
        if mirror is not None:
            grown[: mirror.shape[0]] = mirror
        self.cell_positions = grown

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        prepared: CellRows,
        window: int | None,
    ) -> torch.Tensor:
        """q [T, H, D] -> [T, H * D] in q's dtype."""
        width = self.geometry.num_heads * self.geometry.head_dim
        out = q.new_zeros(q.shape[0], width)
        for group in prepared.groups:
            found = self._attend_group(q, k_cache, v_cache, group, window)
            dest = group.rows.reshape(-1)
            if group.valid is not None:  # a wide step's padded queries: not a graph
                keep = group.valid.reshape(-1)
                dest, found = dest[keep], found[keep]
            out.index_copy_(0, dest, found)
        return out

    def _attend_group(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: CellGroup,
        window: int | None,
    ) -> torch.Tensor:
        scale = self.geometry.attention_scale
        if self.kind == "sdpa":
            return sdpa_over_cells(q, k_cache, v_cache, group, window, scale)
        if self.cell_positions is None or self.cell_positions.shape[0] < k_cache.shape[0]:
            raise RuntimeError(
                "flex attention's cell positions do not cover the pool: call fit_pool "
                "after the pool grows"
            )
        positions = self.cell_positions[: k_cache.shape[0]]
        # Each query's own cell is its sequence's cell at its position: record what the
        # step wrote there (a padded query rewrites its sequence's position 0, unchanged).
        own = group.cells.gather(1, group.positions)
        positions.scatter_(0, own.reshape(-1), group.positions.reshape(-1))
        return flex_over_pool(q, k_cache, v_cache, group, positions, window, scale)
