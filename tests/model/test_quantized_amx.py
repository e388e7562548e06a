"""The int8-input products' AMX tile path (kernels/quantized_amx.cpp): the same bits as the
AVX512-VNNI path and the portable loop at every row count and thread count, so that a call
may take either by its width; CELLBATCH_AMX forces or refuses it, and a value it does not
know fails when a model is set up, before the kernels would refuse it mid-step."""

from __future__ import annotations

import pytest
import torch

from cellbatch.model import cpu, quantized
from cellbatch.model.loading import load_model
from cellbatch.types import InvalidArgumentError

needs_amx = pytest.mark.skipif(
    not cpu.cpu_has_amx(), reason="needs AMX (and torch at the AVX512 width)"
)
# Row counts around the tile paths' edges: one tile of 16 rows, part-filled tiles, the
# 4-row runs of the float chain, and passes of 128 rows over a block.
COUNTS = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 100, 127, 128, 129, 150)


def _weight(fmt: str, rows: int, cols: int, size: float) -> quantized.QuantizedWeight:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=generator) + torch.randn(
        rows, 1, generator=generator
    )
    held = quantized.from_float(weight * size, fmt)
    if isinstance(held, quantized.Int8Weight):
        held.codes[::7, ::5] = -128  # GGUF's Q8_0 holds -128, which from_float never makes
    return held


def _packed(weight: quantized.QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(weight, quantized.Int8Weight):
        return quantized.pack_a8(weight)
    return quantized.pack(weight)


def _inputs(count: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(count, cols, generator=torch.Generator().manual_seed(1))
    x[1, :32] = 0.0  # an all-zero group: scale 0, codes 0
    x[2, 5] = 40.0  # an outlier
    x[3] *= 1e-30  # tiny inputs
    return x.to(dtype)


@needs_amx
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "cols", "size"),
    # a part-filled block of panels, fewer groups than a chunk; blocks of 3 and 1 panels;
    # six chunks of groups; scales that are not float16 values (float32 scales)
    [(37, 96, 0.05), (200, 576, 0.05), (1000, 1536, 0.05), (200, 576, 1e-7)],
)
def test_the_tile_path_gives_the_vnni_paths_bits(
    compiled_ops, monkeypatch, fmt, dtype, rows, cols, size
) -> None:
    weight = _weight(fmt, rows, cols, size)
    codes, scales = _packed(weight)
    assert scales.dtype == (torch.float16 if size == 0.05 else torch.float32)
    op = compiled_ops.int4_matmul_a8 if fmt == "int4" else compiled_ops.int8_matmul_a8
    x = _inputs(150, cols, dtype)
    monkeypatch.setenv("CELLBATCH_AMX", "0")
    vnni = op(x, codes, scales, rows)  # whose rows depend on no other row (test_quantized)
    monkeypatch.setenv("CELLBATCH_AMX", "always")
    for threads in (1, 2):
        torch.set_num_threads(threads)  # tests/conftest.py puts it back after the test
        for count in COUNTS:
            assert torch.equal(op(x[:count], codes, scales, rows), vnni[:count]), (threads, count)
        assert torch.equal(op(x[40:73], codes, scales, rows), vnni[40:73]), threads


@needs_amx
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_tile_path_gives_the_portable_loops_bits(compiled_ops, monkeypatch, fmt) -> None:
    """The loop that CPUs without VNNI run (CELLBATCH_A8_PORTABLE=1) and the tiles: the
    same quantised values and chain."""
    weight = _weight(fmt, 200, 576, 0.05)
    codes, scales = _packed(weight)
    op = compiled_ops.int4_matmul_a8 if fmt == "int4" else compiled_ops.int8_matmul_a8
    x = _inputs(40, 576, torch.bfloat16)
    monkeypatch.setenv("CELLBATCH_AMX", "always")
    tiles = op(x, codes, scales, 200)
    monkeypatch.setenv("CELLBATCH_A8_PORTABLE", "1")
    assert torch.equal(op(x, codes, scales, 200), tiles)


@pytest.mark.parametrize("switch", ["auto", "0", "always", ""])
def test_every_amx_switch_gives_the_same_bits(compiled_ops, monkeypatch, switch) -> None:
    """Wherever the suite runs (with AMX, without it, or capped at AVX2 by
    test_kernels_avx2.py), each switch runs and the bits do not move: without AMX,
    "always" falls back to the path the CPU has."""
    weight = _weight("int4", 100, 576, 0.05)
    codes, scales = _packed(weight)
    x = _inputs(40, 576, torch.float32)
    monkeypatch.setenv("CELLBATCH_AMX", "0")
    expected = compiled_ops.int4_matmul_a8(x, codes, scales, 100)
    monkeypatch.setenv("CELLBATCH_AMX", switch)
    for count in (1, 3, 4, 40):
        assert torch.equal(
            compiled_ops.int4_matmul_a8(x[:count], codes, scales, 100), expected[:count]
        )


def test_an_unknown_amx_switch_fails_before_a_model_loads(
    compiled_ops, monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv("CELLBATCH_AMX", "yes")
    with pytest.raises(InvalidArgumentError, match=r"CELLBATCH_AMX='yes' is not a choice"):
        load_model(tmp_path / "no-model-here")
    # The kernels refuse it too, naming the choices, should a process set it later.
    weight = _weight("int4", 100, 576, 0.05)
    with pytest.raises(RuntimeError, match="CELLBATCH_AMX=yes is not a choice: use auto"):
        compiled_ops.int4_matmul_a8(_inputs(16, 576, torch.float32), *_packed(weight), 100)


@pytest.mark.parametrize(("value", "expected"), [("", "auto"), ("auto", "auto"), ("0", "0")])
def test_the_amx_switch_reads_unset_as_auto(monkeypatch, value, expected) -> None:
    monkeypatch.setenv("CELLBATCH_AMX", value)
    assert cpu.amx_switch() == expected
