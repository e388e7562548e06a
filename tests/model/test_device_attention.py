"""Attention over cells on a device (docs/design.md#attention-on-a-device), run on the CPU:
SDPA over gathered cells and FlexAttention over the pool, each as a wide step's groups and
as a decode width's rows (with padding rows), against a float64 reference of each token
over its own sequence's visible cells; clones, rewinds and sliding windows included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cellbatch.cache import CellCache
from cellbatch.kv_pool import SCRATCH_CELL
from cellbatch.model.device_attention import (
    KEY_ALIGN,
    CellGroup,
    CellRows,
    DeviceAttention,
    group_rows,
    key_bucket,
    row_table,
)
from tiny_models import head_geometry

HEADS = head_geometry(num_heads=6, num_kv_heads=2, head_dim=16)
CPU = torch.device("cpu")
ROWS = 600  # pool rows: not a multiple of FlexAttention's block


class Scene:
    """A cell cache with sequences grown, cloned and rewound, K/V random per cell (rows
    never written stay zero, as in a pool)."""

    def __init__(self, seed: int) -> None:
        self.cache = CellCache(ROWS - 1)
        self.generator = torch.Generator().manual_seed(seed)
        shape = (ROWS, HEADS.num_kv_heads, HEADS.head_dim)
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)
        self.seqs = [self.cache.seq_alloc() for _ in range(3)]

    def place(self, parts: list[tuple[int, int]]):
        ids = np.array([seq for seq, count in parts for _ in range(count)])
        positions = np.concatenate(
            [
                np.arange(self.cache.seq_length(seq), self.cache.seq_length(seq) + n)
                for seq, n in parts
            ]
        )
        assert self.cache.declare_step(ids)
        cells = self.cache.place_step(ids, positions)
        fresh = torch.randn((len(cells), *self.k.shape[1:]), generator=self.generator)
        self.k[cells] = fresh
        self.v[cells] = torch.randn(fresh.shape, generator=self.generator)
        return self.cache.attention_plan(ids, positions, cells), ids, positions

    def history(self) -> None:
        a, b, c = self.seqs
        self.place([(a, 70), (b, 33)])
        for _ in range(5):
            self.place([(a, 1), (b, 1), (c, 2)])
        self.cache.seq_rewind(b, 30)  # b's last positions freed, refilled below
        self.seqs.append(self.cache.seq_clone(a, 50))  # shares a's first 50 cells
        self.place([(b, 4), (self.seqs[3], 3)])


def reference(scene: Scene, q, ids, positions, window) -> torch.Tensor:
    out = torch.zeros(q.shape[0], HEADS.num_heads * HEADS.head_dim, dtype=torch.float64)
    share = HEADS.num_heads // HEADS.num_kv_heads
    for row, (seq, pos) in enumerate(zip(ids.tolist(), positions.tolist(), strict=True)):
        cells = torch.from_numpy(scene.cache.seq_cells(seq)[: pos + 1])
        low = 0 if window is None else max(0, pos - window + 1)
        keys, values = scene.k[cells[low:]].double(), scene.v[cells[low:]].double()
        for head in range(HEADS.num_heads):
            scores = keys[:, head // share] @ q[row, head].double() * HEADS.attention_scale
            out[row, head * HEADS.head_dim : (head + 1) * HEADS.head_dim] = (
                torch.softmax(scores, 0) @ values[:, head // share]
            )
    return out


def attention(kind: str, scene: Scene) -> DeviceAttention:
    made = DeviceAttention(HEADS, CPU, kind)
    made.fit_pool(ROWS)
    if made.cell_positions is not None:  # what earlier forwards recorded
        every = np.arange(ROWS)
        made.cell_positions.copy_(torch.from_numpy(scene.cache.cell_positions(every)))
        made.cell_positions[SCRATCH_CELL] = 0
    return made


@pytest.mark.parametrize("kind", ["sdpa", "flex"])
@pytest.mark.parametrize("window", [None, 8])
def test_a_wide_step_attends_each_token_over_its_own_cells(kind, window) -> None:
    scene = Scene(seed=1)
    scene.history()
    a, b, c, clone = scene.seqs
    plan, ids, positions = scene.place([(a, 1), (c, 9), (b, 1), (clone, 12)])
    q = torch.randn(len(ids), HEADS.num_heads, HEADS.head_dim, generator=scene.generator)
    prepared = group_rows(plan, CPU)
    assert all(group.cells.shape[1] % KEY_ALIGN == 0 for group in prepared.groups)
    got = attention(kind, scene).attend(q, scene.k, scene.v, prepared, window)
    torch.testing.assert_close(
        got.double(), reference(scene, q, ids, positions, window), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("kind", ["sdpa", "flex"])
@pytest.mark.parametrize("window", [None, 8])
def test_decode_rows_attend_like_the_reference_and_padding_sees_scratch(kind, window) -> None:
    scene = Scene(seed=2)
    scene.history()
    a, b, c, clone = scene.seqs
    # Five rows of width 8: four sequences' decodes and a short chunk of c run as rows.
    plan, ids, positions = scene.place([(a, 1), (b, 1), (c, 2), (clone, 1)])
    width, keys = 8, key_bucket(plan)
    assert keys == 128  # a's 77 keys, rounded up to a power of two
    table = torch.from_numpy(row_table(plan, width, keys))
    assert (table[len(ids) :] == SCRATCH_CELL).all()
    tokens = len(ids)
    q = torch.randn(width, HEADS.num_heads, HEADS.head_dim, generator=scene.generator)
    query_pos = torch.zeros(width, dtype=torch.long)
    query_pos[:tokens] = torch.from_numpy(positions)
    rows = CellRows(
        [CellGroup(torch.arange(width)[:, None], table, query_pos[:, None], None)], width
    )
    got = attention(kind, scene).attend(q, scene.k, scene.v, rows, window)
    torch.testing.assert_close(
        got[:tokens].double(),
        reference(scene, q[:tokens], ids, positions, window),
        atol=1e-5,
        rtol=1e-5,
    )
    # A padding row attends to the scratch cell alone: its value row, per head.
    share = HEADS.num_heads // HEADS.num_kv_heads
    scratch = scene.v[SCRATCH_CELL].repeat_interleave(share, dim=0).reshape(-1)
    torch.testing.assert_close(got[tokens:], scratch.expand(width - tokens, -1))
