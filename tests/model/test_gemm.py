"""Float products whose rows do not depend on the other rows of the call (cellbatch.model.gemm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cellbatch.model.gemm import in_fixed_calls


@pytest.mark.parametrize("count", [1, 5, 32, 33, 64, 100])
def test_every_call_has_the_fixed_row_count_and_the_rows_come_back_in_order(count) -> None:
    weight = torch.randn(7, 5)
    x = torch.randn(count, 5)
    calls: list[int] = []

    def linear(part: torch.Tensor) -> torch.Tensor:
        calls.append(part.shape[0])
        return part @ weight.t()

    out = in_fixed_calls(linear, x, 32)
    assert calls == [32] * -(-count // 32)
    assert torch.allclose(out, x @ weight.t())
    assert out.shape == (count, 7)


def test_leading_dimensions_are_kept_and_zero_rows_means_one_call() -> None:
    x = torch.randn(3, 4, 5)
    calls: list[tuple[int, ...]] = []

    def linear(part: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(part.shape))
        return part.sum(dim=-1, keepdim=True)

    assert in_fixed_calls(linear, x, 8).shape == (3, 4, 1)
    assert calls == [(8, 5), (8, 5)]
    calls.clear()
    assert in_fixed_calls(linear, x, 0).shape == (3, 4, 1)
    assert calls == [(3, 4, 5)]


def test_fp32_products_round_a_row_alike_whatever_the_row_count_from_16_rows() -> None:
    # MKL rounds a row by the call's row count on Intel CPUs unless importing cellbatch
    # made its reproducibility strict (MKL_CBWR), as the torch implementations rely on.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(576, 1536, generator=generator) * 0.05
    rows = torch.randn(300, 1536, generator=generator)
    full = F.linear(rows, weight)
    for count in (16, 33, 64, 100, 128, 200):
        assert torch.equal(F.linear(rows[:count], weight), full[:count]), count
