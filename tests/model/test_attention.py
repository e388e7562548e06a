"""Attention over cells: the compiled kernel against a float64 reference and the torch
implementation, and the batch invariance of both, over float and int8 caches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cellbatch.cache import CellCache
from cellbatch.kv_format import head_width, read_heads, store_heads
from cellbatch.model.attention import CellAttention
from tiny_models import head_geometry

HEADS = head_geometry(num_heads=6, num_kv_heads=2, head_dim=32)


@pytest.fixture
def kernel(compiled_ops) -> CellAttention:
    return CellAttention(HEADS, compiled_ops.cell_attention)


@pytest.fixture
def gather(torch_ops) -> CellAttention:
    return CellAttention(HEADS, torch_ops.cell_attention)


@pytest.fixture(params=["compiled", "torch"])
def attention(request) -> CellAttention:
    """Each implementation in turn."""
    return request.getfixturevalue("kernel" if request.param == "compiled" else "gather")


class Cells:
    """A CellCache fed steps of (sequence, token count). The K/V of (sequence, position)
    are fixed random values (int8: quantised per head), whichever cell that position lands
    in."""

    def __init__(
        self, num_sequences: int, kv_dtype: torch.dtype, seed: int = 0, length: int = 512
    ) -> None:
        self.cache = CellCache(4096)
        self.seqs = [self.cache.seq_alloc() for _ in range(num_sequences)]
        generator = torch.Generator().manual_seed(seed)
        shape = (num_sequences, length, HEADS.num_kv_heads, HEADS.head_dim)
        self.k_of = store_heads(torch.randn(shape, generator=generator), kv_dtype)
        self.v_of = store_heads(torch.randn(shape, generator=generator), kv_dtype)
        # Cells never written hold NaN (int8: a NaN scale), so reading one shows in the
        # result; the scratch cell 0, which the torch implementation reads as masked
        # padding, holds zeros as in a pool.
        self.k = store_heads(torch.full((4097, *shape[2:]), float("nan")), kv_dtype)
        self.k[0] = 0
        self.v = self.k.clone()
        assert self.k.shape[-1] == head_width(HEADS.head_dim, kv_dtype)

    def step(self, parts: list[tuple[int, int]]):
        """Places a step; returns (plan, seq index per token, position per token)."""
        ids, positions, owners = [], [], []
        for index, count in parts:
            start = self.cache.seq_length(self.seqs[index])
            ids += [self.seqs[index]] * count
            positions += range(start, start + count)
            owners += [index] * count
        ids_np, pos_np = np.array(ids), np.array(positions)
        assert self.cache.declare_step(ids_np)
        cells = torch.from_numpy(self.cache.place_step(ids_np, pos_np))
        self.k[cells] = self.k_of[owners, positions]
        self.v[cells] = self.v_of[owners, positions]
        return self.cache.attention_plan(ids_np, pos_np, cells.numpy()), owners, positions


def reference(cells: Cells, q: torch.Tensor, owners, positions, window, dtype) -> torch.Tensor:
    """float64 attention of each token over its own sequence's visible cells."""
    out = torch.zeros(q.shape[0], HEADS.num_heads * HEADS.head_dim, dtype=torch.float64)
    for row, (index, pos) in enumerate(zip(owners, positions, strict=True)):
        seq_cells = torch.from_numpy(cells.cache.seq_cells(cells.seqs[index])[: pos + 1])
        low = 0 if window is None else max(0, pos - window + 1)
        keys = read_heads(cells.k[seq_cells[low:]], dtype).double()  # [n, kv_heads, D]
        values = read_heads(cells.v[seq_cells[low:]], dtype).double()
        for head in range(HEADS.num_heads):
            kv = head // HEADS.heads_per_kv_head
            scores = keys[:, kv] @ q[row, head].double() * HEADS.attention_scale
            weights = torch.softmax(scores, dim=0)
            out[row, head * HEADS.head_dim : (head + 1) * HEADS.head_dim] = weights @ values[:, kv]
    return out


MIXED_STEPS = [
    [(0, 5), (1, 40), (2, 1)],  # prompt chunks beside a 1-token prompt
    [(2, 1), (0, 1), (1, 1)],  # decodes
    [(1, 1), (0, 23), (2, 1)],  # a chunk beside decodes
]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "tolerance"),
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.bfloat16, torch.bfloat16, 3e-2),
        (torch.bfloat16, torch.float32, 3e-2),
        (torch.float32, torch.bfloat16, 1e-5),
        (torch.float16, torch.float16, 3e-3),
        (torch.float32, torch.int8, 1e-5),
        (torch.bfloat16, torch.int8, 3e-2),
    ],
)
def test_kernel_matches_a_float64_reference_and_the_torch_implementation(
    kernel, gather, window, dtype, kv_dtype, tolerance
) -> None:
    cells = Cells(3, kv_dtype)
    generator = torch.Generator().manual_seed(1)
    for parts in MIXED_STEPS:
        plan, owners, positions = cells.step(parts)
        q = torch.randn(len(owners) + 3, HEADS.num_heads, HEADS.head_dim, generator=generator)
        q = q.to(dtype)  # 3 padding rows that no query names
        prepared = kernel.prepare(plan)
        got = kernel.attend(q, cells.k, cells.v, prepared, window)
        assert got.dtype == dtype and got.shape == (q.shape[0], HEADS.num_heads * HEADS.head_dim)
        assert torch.equal(got[len(owners) :], torch.zeros_like(got[len(owners) :]))
        expected = reference(cells, q, owners, positions, window, dtype)
        assert (got[: len(owners)].double() - expected[: len(owners)]).abs().max() < tolerance
        gathered = gather.attend(q, cells.k, cells.v, prepared, window)
        assert torch.equal(gathered[len(owners) :], torch.zeros_like(got[len(owners) :]))
        assert (got.float() - gathered.float()).abs().max() < tolerance


# (compute dtype, KV dtype) of the batch-invariance tests.
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.int8),
]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPE_PAIRS)
def test_a_query_gives_the_same_bits_whatever_shares_its_step(
    attention, window, dtype, kv_dtype
) -> None:
    """Sequence 0 (a 37-token prompt, then decodes) alone, chunked in different sizes,
    beside other sequences in either order, and fed one token a step as decodes are: each
    of its rows is bit-identical (what a speculative step's verified rows rely on)."""
    generator = torch.Generator().manual_seed(2)
    queries = torch.randn(45, HEADS.num_heads, HEADS.head_dim, generator=generator).to(dtype)
    extra = torch.randn(200, HEADS.num_heads, HEADS.head_dim, generator=generator).to(dtype)

    def run(schedule: list[list[tuple[int, int]]]) -> torch.Tensor:
        cells = Cells(3, kv_dtype, seed=7)
        rows = []
        fed = 0
        for parts in schedule:
            plan, owners, _ = cells.step(parts)
            mine = [i for i, owner in enumerate(owners) if owner == 0]
            q = extra[: len(owners)].clone()
            q[mine] = queries[fed : fed + len(mine)]
            out = attention.attend(q, cells.k, cells.v, attention.prepare(plan), window)
            rows.append(out[mine])
            fed += len(mine)
        return torch.cat(rows)

    alone = run([[(0, 37)]] + [[(0, 1)]] * 8)
    schedules = [
        [[(0, 16)], [(0, 16)], [(0, 5)]] + [[(0, 1)]] * 8,
        [[(1, 30), (0, 20), (2, 3)], [(2, 9), (0, 17)]] + [[(1, 1), (0, 1), (2, 1)]] * 8,
        [[(0, 1)]] * 45,
        [[(0, 1)]] * 37 + [[(0, 2)], [(0, 1)], [(0, 5)]],
    ]
    for schedule in schedules:
        assert torch.equal(run(schedule), alone), schedule


@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPE_PAIRS)
def test_a_step_gives_the_same_bits_at_any_thread_count(attention, dtype, kv_dtype) -> None:
    """Fewer sequences than threads (a single stream's decode) split each sequence's KV
    heads between the threads in the compiled kernel; more take a sequence each. Neither
    changes a bit, and nothing is left unwritten."""
    generator = torch.Generator().manual_seed(4)
    schedule = [[(0, 37), (1, 20)], [(0, 1)], [(0, 1), (1, 1)], [(1, 1)]] + [[(0, 1)]] * 3
    queries = [
        torch.randn(
            sum(count for _, count in parts), HEADS.num_heads, HEADS.head_dim, generator=generator
        ).to(dtype)
        for parts in schedule
    ]

    def run(threads: int) -> list[torch.Tensor]:
        torch.set_num_threads(threads)
        cells = Cells(2, kv_dtype, seed=9)
        outputs = []
        for parts, q in zip(schedule, queries, strict=True):
            plan, _, _ = cells.step(parts)
            outputs.append(attention.attend(q, cells.k, cells.v, attention.prepare(plan), None))
        return outputs

    one = run(1)
    assert not any(out.isnan().any() for out in one)
    for threads in (2, 3, 5):
        for got, expected in zip(run(threads), one, strict=True):
            assert torch.equal(got, expected), threads


# A 1,000-token prompt beside a shorter one, then decodes: many key tiles, with windows that
# start and end inside them.
LONG_STEPS = [
    [(0, 300), (1, 70)],
    [(1, 1), (0, 700)],
    [(0, 1), (1, 1)],
]


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_long_contexts_match_a_float64_reference(attention, window, kv_dtype) -> None:
    cells = Cells(2, kv_dtype, length=1024)
    generator = torch.Generator().manual_seed(3)
    for parts in LONG_STEPS:
        plan, owners, positions = cells.step(parts)
        q = torch.randn(len(owners), HEADS.num_heads, HEADS.head_dim, generator=generator)
        got = attention.attend(q, cells.k, cells.v, attention.prepare(plan), window)
        # The float64 reference is slow: every 7th row, and the last (a tile's edge or not).
        sample = [*range(0, len(owners), 7), len(owners) - 1]
        expected = reference(
            cells,
            q[sample],
            [owners[i] for i in sample],
            [positions[i] for i in sample],
            window,
            torch.float32,
        )
        assert (got[sample].double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("window", [None, 100])
def test_a_long_prompt_gives_the_same_bits_in_any_chunking(attention, window) -> None:
    """A 1,000-token prompt, then decodes: alone in one chunk, in chunks of 64 or 333,
    and beside another sequence's chunks and decodes."""
    generator = torch.Generator().manual_seed(4)
    queries = torch.randn(1004, HEADS.num_heads, HEADS.head_dim, generator=generator)
    extra = torch.randn(1100, HEADS.num_heads, HEADS.head_dim, generator=generator)

    def run(schedule: list[list[tuple[int, int]]]) -> torch.Tensor:
        cells = Cells(2, torch.float32, seed=8, length=1024)
        rows, fed = [], 0
        for parts in schedule:
            plan, owners, _ = cells.step(parts)
            mine = [i for i, owner in enumerate(owners) if owner == 0]
            q = extra[: len(owners)].clone()
            q[mine] = queries[fed : fed + len(mine)]
            out = attention.attend(q, cells.k, cells.v, attention.prepare(plan), window)
            rows.append(out[mine])
            fed += len(mine)
        return torch.cat(rows)

    decodes = [[(0, 1)]] * 4
    alone = run([[(0, 1000)], *decodes])
    for schedule in (
        [[(0, 64)]] * 15 + [[(0, 40)]] + decodes,
        [[(0, 333)], [(1, 90), (0, 333)], [(0, 334), (1, 1)]] + [[(1, 1), (0, 1)]] * 4,
    ):
        assert torch.equal(run(schedule), alone), [len(step) for step in schedule]
