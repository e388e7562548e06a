"""Quantised products with int8 activations (`cellbatch::int4_matmul_a8` and
`int8_matmul_a8`, kernels/quantized_a8.cpp, and quantized.resolve_activations): the
activations are quantised as documented, the compiled ops and their torch implementations
compute the product of the quantised activations, the choice reaches only the products it
names, and a bad choice fails before anything loads. (That a row's result depends on
neither the other rows nor the thread count is test_quantized.py's test, for every
compiled product.)"""

from __future__ import annotations

import pytest
import torch

from cellbatch.model import ops, quantized, quantized_torch, weights_summary
from cellbatch.model.loading import load_model
from cellbatch.model.quantized import QuantizedLinear, a8_products
from cellbatch.types import InvalidArgumentError


def _int4(rows: int, cols: int, size: float = 0.05) -> quantized.Int4Weight:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=generator) + torch.randn(
        rows, 1, generator=generator
    )
    weight = quantized.from_float(weight * size, "int4")
    assert isinstance(weight, quantized.Int4Weight)
    return weight


def _int8(rows: int, cols: int, size: float = 0.05) -> quantized.Int8Weight:
    generator = torch.Generator().manual_seed(0)
    weight = quantized.from_float(torch.randn(rows, cols, generator=generator) * size, "int8")
    assert isinstance(weight, quantized.Int8Weight)
    return weight


def _inputs(count: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(count, cols, generator=torch.Generator().manual_seed(1))
    x[1, :32] = 0.0  # an all-zero group: scale 0, codes 0
    x[2, 5] = 40.0  # an outlier: its group's other inputs get few levels
    return x.to(dtype)


def test_activations_are_quantised_per_group_of_32() -> None:
    x = _inputs(3, 96)
    codes, scales, sums = quantized_torch.quantize_activations(x)
    assert codes.shape == (3, 3, 32) and scales.shape == sums.shape == (3, 3)
    assert torch.equal(codes, codes.round()) and codes.abs().max() == 127
    groups = x.unflatten(-1, (3, 32))
    assert torch.equal(scales, groups.abs().amax(-1) / 127)
    assert scales[1, 0] == 0 and not codes[1, 0].any()
    # Each input is its code times the group's scale, to half a step.
    assert ((codes * scales[..., None] - groups).abs() <= scales[..., None] / 2 + 1e-7).all()
    # The sums are the quantised inputs' (llama.cpp's Q8_1 s), not x's.
    assert torch.equal(sums, scales * codes.sum(-1))
    assert not torch.equal(sums, groups.sum(-1))


def test_int8_panels_for_int8_activations_hold_four_inputs_per_lane() -> None:
    weight = _int8(37, 64)
    codes, scales = quantized.pack_a8(weight)
    assert codes.shape == (3, 16, 16, 4) and codes.dtype == torch.int8
    # Output 16 p + c's codes for inputs 4j .. 4j + 3 lie at [p, j, c].
    assert torch.equal(codes[1, 5, 3], weight.codes[19, 20:24])
    assert not codes[2, :, 5:].any()  # outputs 37.. pad the last panel
    assert torch.equal(scales, quantized.pack(weight)[1])
    with pytest.raises(ValueError, match="groups of 32"):
        quantized.pack_a8(quantized.from_float(torch.randn(4, 40), "int8"))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize(("rows", "cols"), [(37, 64), (200, 96), (1000, 576)])
@pytest.mark.parametrize(("size", "scale_dtype"), [(0.05, torch.float16), (1e-7, torch.float32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_is_that_of_the_quantised_activations(
    compiled_ops, torch_ops, fmt, rows, cols, size, scale_dtype, dtype
) -> None:
    """Both implementations, for 1..70 rows (the few-row path, the buffered one and their
    remainders) and outputs in a part-filled block of panels: within float32 sums (and
    the result's bf16 rounding) of the float64 product of the dequantised activations and
    weights (int4, w = q s + o: the offsets too multiply the quantised activations, as
    llama.cpp's Q8_1 sums do)."""
    weight = _int4(rows, cols, size) if fmt == "int4" else _int8(rows, cols, size)
    codes, scales = quantized.pack(weight) if fmt == "int4" else quantized.pack_a8(weight)
    assert scales.dtype == scale_dtype
    x = _inputs(70, cols, dtype)
    x_codes, x_scales, _ = quantized_torch.quantize_activations(x)
    dequantised = (x_codes.double() * x_scales.double()[..., None]).flatten(-2)
    dense = weight.dequantize().double()
    reference = dequantised @ dense.t()
    magnitude = x.double().abs() @ dense.abs().t()
    rounding = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    bound = reference.abs() * rounding + 4 * cols * torch.finfo(torch.float32).eps * magnitude
    for table in (compiled_ops, torch_ops):
        op = table.int4_matmul_a8 if fmt == "int4" else table.int8_matmul_a8
        for count in (1, 2, 3, 4, 5, 8, 31, 64, 65, 70):
            got = op(x[:count], codes, scales, rows)
            assert got.shape == (count, rows) and got.dtype == dtype
            assert ((got.double() - reference[:count]).abs() <= bound[:count]).all(), count


def test_int8_activations_stay_near_the_float_product(compiled_ops) -> None:
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(4))
    int4, int8 = _int4(576, 1536), _int8(576, 1536)
    for weight, op, packed in (
        (int4, compiled_ops.int4_matmul_a8, quantized.pack(int4)),
        (int8, compiled_ops.int8_matmul_a8, quantized.pack_a8(int8)),
    ):
        got = op(x, *packed, 576)
        expected = x @ weight.dequantize().t()
        assert ((got - expected).norm() / expected.norm()).item() < 0.02


def test_the_compiled_ops_refuse_what_they_cannot_multiply(compiled_ops) -> None:
    int4 = quantized.pack(_int4(40, 64))
    int8 = quantized.pack_a8(_int8(40, 64))
    for op, (codes, scales) in (
        (compiled_ops.int4_matmul_a8, int4),
        (compiled_ops.int8_matmul_a8, int8),
    ):
        with pytest.raises(RuntimeError, match=r"x must be \[\.\.\., 64\]"):
            op(torch.randn(2, 63), codes, scales, 40)
        with pytest.raises(RuntimeError, match="float32 or bfloat16"):
            op(torch.randn(2, 64).double(), codes, scales, 40)
        with pytest.raises(RuntimeError, match="cannot hold 100 outputs"):
            op(torch.randn(2, 64), codes, scales, 100)
    # The int8 product's own layout, not int8_matmul's.
    with pytest.raises(
        RuntimeError, match=r"codes must be contiguous int8 \[panels, K / 4, 16, 4\]"
    ):
        compiled_ops.int8_matmul_a8(torch.randn(2, 64), *quantized.pack(_int8(40, 64)), 40)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_torch_export_traces_the_product(compiled_ops, fmt) -> None:
    weight = _int4(40, 64) if fmt == "int4" else _int8(40, 64)
    linear = QuantizedLinear(weight, torch.randn(40), compiled_ops, "int8")
    x = torch.randn(5, 64)
    exported = torch.export.export(linear, (x,))
    assert f"{ops.NAMESPACE}.{fmt}_matmul_a8" in str(exported.graph)
    assert torch.equal(exported.module()(x), linear(x))


def test_an_int8_weight_without_groups_of_32_keeps_float_activations(compiled_ops) -> None:
    weight = quantized.from_float(torch.randn(40, 48), "int8")  # one scale per row
    linear = QuantizedLinear(weight, None, compiled_ops, "int8")
    assert linear.activations == "float" and linear.matmul == compiled_ops.int8_matmul


def test_a_tied_head_with_int8_activations_still_embeds_exactly(compiled_ops) -> None:
    weight = _int8(100, 64)
    linear = QuantizedLinear(weight, None, compiled_ops, "int8")
    embedding = quantized.QuantizedEmbedding(linear, torch.float32)
    tokens = torch.tensor([[0, 17, 99], [5, 16, 31]])
    assert torch.equal(embedding(tokens), weight.dequantize()[tokens])


@pytest.mark.parametrize("speed_dtype", [torch.bfloat16, torch.float32])
def test_auto_takes_int8_only_for_compiled_products_in_the_cpus_speed_dtype(
    monkeypatch, speed_dtype
) -> None:
    """The speed dtype is what `auto` picks: bf16 on CPUs with native bf16, else float32."""
    resolve = quantized.resolve_activations
    other = torch.float32 if speed_dtype == torch.bfloat16 else torch.bfloat16
    monkeypatch.setattr(quantized, "cpu_dtype", lambda: speed_dtype)
    monkeypatch.setattr(quantized, "cpu_has_int8_products", lambda: True)
    assert resolve("auto", "compiled", speed_dtype) == "int8"
    assert resolve("auto", "compiled", other) == "float"  # another dtype was asked for
    assert resolve("auto", "torch", speed_dtype) == "float"
    monkeypatch.setattr(quantized, "cpu_has_int8_products", lambda: False)
    assert resolve("auto", "compiled", speed_dtype) == "float"
    # Asked for, either holds on any CPU and with either ops table.
    assert resolve("int8", "torch", torch.float32) == "int8"
    assert resolve("float", "compiled", torch.bfloat16) == "float"


def test_a_bad_activations_choice_fails_before_loading(tmp_path) -> None:
    from cellbatch.cli import main
    from cellbatch.engine import Engine

    missing = tmp_path / "no-such-model"
    with pytest.raises(InvalidArgumentError, match=r"int4.*auto, float, int8"):
        load_model(missing, activations="int4")
    with pytest.raises(InvalidArgumentError, match="fp8"):
        Engine.from_pretrained(missing, activations="fp8")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--model", str(missing), "--activations", "int4", "hello"])
    assert exit_info.value.code == 2


# Which products take int8 inputs, by the model's dtype (the perplexity each set cost).
INT8_INPUTS = {
    "bfloat16": ("qkv", "o_proj", "gate_up", "lm_head"),
    "float32": ("gate_up", "lm_head"),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["compiled", "torch"])
def test_int8_activations_reach_only_their_projections(
    tiny_checkpoint, packed_steps, first_sequence_logits, request, kernel, dtype
) -> None:
    if kernel == "compiled":
        request.getfixturevalue("compiled_ops")
    _, folder = tiny_checkpoint("llama")
    _, model = load_model(folder, dtype, kernel, "int4", activations="int8")
    chosen = INT8_INPUTS[dtype]
    assert a8_products(model.dtype) == chosen
    table = model.ops
    for layer in model.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            linear = getattr(layer, name)
            assert linear.activations == ("int8" if name in chosen else "float"), name
            expected = table.int4_matmul_a8 if name in chosen else table.int4_matmul
            assert linear.matmul == expected, name
    assert model.lm_head.format == "int8" and model.lm_head.matmul == table.int8_matmul_a8
    words = f"({', '.join(chosen)} with int8 activations)"
    assert words in weights_summary.describe(model).format
    _, floats = load_model(folder, dtype, kernel, "int4", activations="float")
    assert "int8 activations" not in weights_summary.describe(floats).format
    steps = [[(0, [5, 17, 33, 2, 61]), (1, [9, 40, 12, 77, 3])], [(1, [70]), (0, [4])]]
    got = torch.cat(packed_steps(model, steps, 2))
    expected = torch.cat(packed_steps(floats, steps, 2))
    assert not torch.equal(got, expected)
    assert ((got - expected).norm() / expected.norm()).item() < 0.05
    # Batch invariant: sequence 0's logits alone, chunked and beside others.
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=generator).tolist() for n in (70, 3, 40)]
    alone = first_sequence_logits(model, prompts, [7, 31], [0], 256)
    for order, chunk in (([0, 1, 2], 256), ([2, 1, 0], 16)):
        assert torch.equal(first_sequence_logits(model, prompts, [7, 31], order, chunk), alone)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_portable_loop_gives_the_vector_products_results(
    compiled_ops, monkeypatch, fmt, dtype
) -> None:
    """CPUs without AVX512-VNNI run the portable loop (CELLBATCH_A8_PORTABLE=1 asks for it
    here): the same quantised values and chain, so the same bits, for the few-row and the
    buffered row counts."""
    weight = _int4(200, 576) if fmt == "int4" else _int8(200, 576)
    packed = quantized.pack(weight) if fmt == "int4" else quantized.pack_a8(weight)
    op = compiled_ops.int4_matmul_a8 if fmt == "int4" else compiled_ops.int8_matmul_a8
    x = _inputs(9, 576, dtype)
    vector = [op(x[:count], *packed, 200) for count in (1, 3, 9)]
    monkeypatch.setenv("CELLBATCH_A8_PORTABLE", "1")
    for count, expected in zip((1, 3, 9), vector, strict=True):
        assert torch.equal(op(x[:count], *packed, 200), expected), count
