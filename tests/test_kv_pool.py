"""KVPool: growth, bit-identical copies, all-or-nothing failures, int8 rows
(docs/design.md#cell-kv-cache-and-kv-pool; BEHAVIOURS "Cell cache and KV pool")."""

from __future__ import annotations

import pytest
import torch

from cellbatch import kv_pool as kv_pool_module
from cellbatch.kv_format import kv_bytes_per_cell, read_heads, store_heads
from cellbatch.kv_pool import SCRATCH_CELL, KVPool
from cellbatch.types import InvalidArgumentError, OutOfResourcesError


def test_the_pool_grows_geometrically_up_to_capacity() -> None:
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=4, capacity=20, initial_cells=3)
    assert (pool.rows, pool.growth_count, pool.scratch_cell) == (3, 0, SCRATCH_CELL)
    assert pool.bytes_per_cell == 2 * 2 * 2 * 4 * 4
    assert pool.allocated_bytes == 3 * pool.bytes_per_cell
    pool.ensure(3)
    assert pool.growth_count == 0
    pool.ensure(4)
    assert pool.rows == 6 and pool.k[0].shape == (6, 2, 4) and pool.growth_count == 1
    pool.ensure(13)
    assert pool.rows == 21 and pool.v[1].shape == (21, 2, 4) and pool.growth_count == 2
    assert pool.allocated_bytes == sum(t.numel() * t.element_size() for t in pool.k + pool.v)
    with pytest.raises(OutOfResourcesError, match="at most 21"):
        pool.ensure(22)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_the_pool_keeps_live_kv_bit_identical_across_growth(dtype: torch.dtype) -> None:
    pool = KVPool(2, 3, 8, capacity=100, dtype=dtype, initial_cells=5)
    generator = torch.Generator().manual_seed(0)
    written = [store_heads(torch.randn(5, 3, 8, generator=generator), dtype) for _ in range(4)]
    for tensor, values in zip(pool.k + pool.v, written, strict=True):
        tensor.copy_(values)
    pool.ensure(50)
    assert pool.rows == 80 and pool.growth_count == 1
    for tensor, values in zip(pool.k + pool.v, written, strict=True):
        assert tensor.dtype == dtype
        assert torch.equal(tensor[:5].view(torch.uint8), values.view(torch.uint8))


def test_a_failed_growth_leaves_the_pool_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = KVPool(3, 2, 4, capacity=64, initial_cells=4)
    pool.k[2][3] = 7.0
    before = (pool.rows, pool.growth_count, pool.allocated_bytes, list(pool.k), list(pool.v))
    real_zeros = torch.zeros
    calls = {"count": 0}

    def zeros_failing_on_the_fourth_call(*args, **kwargs) -> torch.Tensor:
        calls["count"] += 1
        if calls["count"] == 4:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(kv_pool_module.torch, "zeros", zeros_failing_on_the_fourth_call)
    with pytest.raises(OutOfResourcesError, match="could not allocate 8 rows"):
        pool.ensure(5)
    monkeypatch.undo()
    assert (pool.rows, pool.growth_count, pool.allocated_bytes) == before[:3]
    assert all(a is b for a, b in zip(pool.k + pool.v, before[3] + before[4], strict=True))
    pool.ensure(5)
    assert pool.rows == 8 and pool.growth_count == 1
    assert float(pool.k[2][3, 0, 0]) == 7.0


def test_the_pool_refuses_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="dtype"):
        KVPool(1, 1, 4, capacity=8, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match="head_dim"):
        KVPool(1, 1, 0, capacity=8)
    assert KVPool(1, 2, 4, capacity=8, dtype=torch.bfloat16).bytes_per_cell == 2 * 2 * 4 * 2


def test_an_int8_pool_holds_each_head_with_its_scale_in_about_half_of_bf16s_bytes() -> None:
    """int8 rows: head_dim codes and a float32 scale per (cell, head); at head_dim 64,
    68 bytes against bf16's 128 (0.53x), at 128, 0.52x."""
    pool = KVPool(3, 2, 64, capacity=8, dtype=torch.int8, initial_cells=4)
    assert pool.k[0].shape == (4, 2, 68) and pool.k[0].dtype == torch.int8
    assert pool.bytes_per_cell == 2 * 3 * 2 * 68
    bf16 = KVPool(3, 2, 64, capacity=8, dtype=torch.bfloat16).bytes_per_cell
    assert pool.bytes_per_cell / bf16 == 68 / 128
    assert kv_bytes_per_cell(32, 8, 128, torch.int8) / kv_bytes_per_cell(
        32, 8, 128, torch.bfloat16
    ) == pytest.approx(0.516, abs=1e-3)
    # An unwritten row reads as zeros, never NaN.
    assert torch.equal(read_heads(pool.k[1], torch.float32), torch.zeros(4, 2, 64))
