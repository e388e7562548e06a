"""The compiled per-layer ops (`cellbatch.model.kernels`: rms_norm, rope_store, silu_mul)
against the torch chains they replace, row by row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cellbatch.model.transformer import RMSNorm, _rotate

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def ops(compiled_ops):
    return compiled_ops


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable values of a's dtype lie between a and b."""
    spacing = torch.finfo(a.dtype).eps * torch.maximum(a.float().abs(), b.float().abs())
    return (a.float() - b.float()).abs() / spacing.clamp_min(torch.finfo(a.dtype).tiny)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_torch_module_to_two_ulps(ops, dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5, dtype, "cpu", None)
    norm.weight.data = torch.randn(96, generator=generator).to(dtype)
    x = (torch.randn(37, 96, generator=generator) * 3).to(dtype)
    got = ops.rms_norm(x, norm.weight, 1e-5)
    expected = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    # The mean of squares is summed in another order than torch's reduction.
    assert ulps_apart(got, expected).max() <= 2.0
    # A strided view of heads (as q/k norms get) and a row alone give the same bits.
    heads = torch.randn(5, 40, generator=generator).to(dtype)[:, :32].unflatten(1, (2, 16))
    weight = torch.randn(16, generator=generator).to(dtype)
    whole = ops.rms_norm(heads, weight, 1e-6)
    assert whole.shape == heads.shape
    assert torch.equal(ops.rms_norm(heads[3:4], weight, 1e-6), whole[3:4])
    assert torch.equal(ops.rms_norm(x[5:6], norm.weight, 1e-5), got[5:6])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_q_and_stores_k_v_like_the_torch_chain(ops, dtype, cache_dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, dim = 6, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (t.view(tokens, -1, dim) for t in (q, k, v))
    angles = torch.rand(tokens, dim // 2, generator=generator) * 50
    cos, sin = angles.cos(), angles.sin()
    cells = torch.tensor([7, 3, 9, 1])  # the last two tokens are padding: not stored
    expected_q = _rotate(q, cos.to(dtype)[:, None], sin.to(dtype)[:, None])
    expected_k = _rotate(k, cos.to(dtype)[:, None], sin.to(dtype)[:, None])
    k_cache = torch.full((10, kv_heads, dim), -7.0, dtype=cache_dtype)
    v_cache = k_cache.clone()
    ops.rope_store(q, k, v, cos, sin, cells, k_cache, v_cache)
    assert torch.equal(q, expected_q)  # rotated in place, through the strided view
    assert torch.equal(k_cache[cells], expected_k[:4].to(cache_dtype))
    assert torch.equal(v_cache[cells], v[:4].to(cache_dtype))
    untouched = torch.tensor([0, 2, 4, 5, 6, 8])
    assert (k_cache[untouched] == -7).all() and (v_cache[untouched] == -7).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_silu_times_up(ops, dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(9, 2 * 72, generator=generator) * 4).to(dtype)  # 72: a ragged tail
    gate, up = gate_up.chunk(2, dim=-1)
    got = ops.silu_mul(gate_up)
    expected = F.silu(gate) * up
    assert got.dtype == dtype and got.shape == (9, 72)
    assert ulps_apart(got, expected).max() <= 1.0
    assert torch.equal(ops.silu_mul(gate_up[4:5]), got[4:5])


def test_the_ops_refuse_bad_shapes_with_a_message(ops) -> None:
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        ops.silu_mul(torch.ones(2, 7))
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.silu_mul(torch.ones(2, 8, dtype=torch.float64))
