"""The pure-torch ops' own promises (cellbatch.model.ops); the compiled kernels are checked
against them in test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from cellbatch.model.ops import silu_mul_torch


@pytest.fixture
def two_threads() -> None:
    torch.set_num_threads(2)  # tests/conftest.py puts the count back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_gives_a_row_the_same_result_whatever_the_row_count(two_threads, dtype) -> None:
    """On two threads ATen would cut a large call's rows between them; each piece's end
    then runs the scalar exp, which rounds differently from the vector one."""
    generator = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(1200, 192, generator=generator) * 4).to(dtype)
    whole = silu_mul_torch(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up).to(dtype)
    torch.testing.assert_close(whole, expected, rtol=1.6e-2, atol=1e-5)
    for rows in (1, 341, 513, 777, 1199):
        assert torch.equal(silu_mul_torch(gate_up[:rows]), whole[:rows]), rows
        assert torch.equal(silu_mul_torch(gate_up[1 : rows + 1]), whole[1 : rows + 1]), rows
