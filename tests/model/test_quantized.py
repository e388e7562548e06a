"""Quantised weights (cellbatch.model.quantized): GGUF blocks convert to gguf's own values,
the compiled int4/int8 kernels and their torch fallbacks compute what the weights say, a
row's result never depends on the other rows or the thread count, quantised tiny models
stay near fp32, GGUF files keep their precision class, and a bad choice fails before
anything loads."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch

from cellbatch.model import gguf_blocks, ops, quantized, quantized_torch, weights_summary
from cellbatch.model.cpu import cpu_has_fast_bf16
from cellbatch.model.loading import load_model
from cellbatch.model.quantized import Int4Weight, Int8Weight, QuantizedEmbedding, QuantizedLinear
from cellbatch.model.transformer import PackedLinear
from cellbatch.types import InvalidArgumentError
from tiny_models import make_tiny_checkpoint, write_gguf

STEPS = [
    [(0, [5, 17, 33, 2, 61]), (1, [9, 40, 12, 77, 3, 50, 21, 8, 64, 30, 11])],
    [(1, [70]), (0, [4])],
    [(0, [19]), (1, [6, 44, 90])],
]
# The compiled kernel sums in another order than F.linear: logits (std ~1.25) move by ~1e-6.
ORDER_TOLERANCE = 1e-4


@pytest.fixture(params=["compiled", "torch"])
def kernel(request) -> str:
    """The ops choice a test loads its models with: "compiled" runs the compiled int4/int8
    kernels (required, like `compiled_ops`), "torch" their dequantising fallbacks."""
    if request.param == "compiled":
        request.getfixturevalue("compiled_ops")
    return request.param


@pytest.fixture(params=["compiled", "torch"])
def table(request) -> ops.Ops:
    """Each ops table in turn."""
    return request.getfixturevalue(f"{request.param}_ops")


def _weight(fmt: str, rows: int, cols: int, size: float = 0.05) -> Int4Weight | Int8Weight:
    """Random weights of about `size`: scales that are float16 values (0.05), or too small
    for float16's normal range (1e-7), so that the kernels read them as float32."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=generator) + torch.randn(
        rows, 1, generator=generator
    )
    return quantized.from_float(weight * size, fmt)


def _gguf_tensors(tmp_path, arrays: dict[str, tuple[np.ndarray, str]]) -> dict:
    """Writes (data, kind) tensors with gguf's writer and reads them back."""
    import gguf

    path = tmp_path / "tensors.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for name, (data, kind) in arrays.items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _q4_k_blocks(rows: int, cols: int, generator: np.random.Generator) -> np.ndarray:
    """Random but well-formed Q4_K blocks: positive float16 d and dmin, random 6-bit
    scales and mins, random nibbles (gguf cannot quantise to Q4_K itself)."""
    blocks = generator.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    halves = generator.uniform(1e-4, 1e-2, (rows, cols // 256, 2)).astype(np.float16)
    blocks[..., :4] = halves.view(np.uint8)
    return blocks.reshape(rows, -1)


def test_gguf_blocks_convert_to_gguf_s_own_values(tmp_path) -> None:
    import gguf

    generator = np.random.default_rng(0)
    weight = (generator.normal(0, 0.05, (48, 512)) + generator.normal(0, 0.02, (48, 1))).astype(
        np.float32
    )
    tensors = _gguf_tensors(
        tmp_path,
        {
            f"w.{kind}": (gguf.quants.quantize(weight, gguf.GGMLQuantizationType[kind]), kind)
            for kind in ("Q4_0", "Q4_1", "Q8_0")
        }
        | {"w.Q4_K": (_q4_k_blocks(48, 512, generator), "Q4_K")},
    )
    for kind in ("Q4_0", "Q4_1", "Q4_K", "Q8_0"):
        tensor = tensors[f"w.{kind}"]
        data = np.asarray(tensor.data)
        expected = torch.from_numpy(
            gguf.quants.dequantize(data, tensor.tensor_type).reshape(48, 512)
        )
        if kind == "Q8_0":  # kept as it is: d and the codes
            got = gguf_blocks.from_gguf(data, kind, "int8")
            assert got.format == "int8" and got.scale.shape == (48, 512 // 32)
            assert torch.equal(got.dequantize(), expected)
            continue
        got = gguf_blocks.from_gguf(data, kind, "int4")
        assert got.format == "int4" and got.codes.max() <= 15
        assert torch.equal(got.dequantize(), expected), kind
        # The same blocks asked for as int8 go through gguf's dequantiser and are requantised
        # per group of 32: within half a group's step of the file's values.
        as_int8 = gguf_blocks.from_gguf(data, kind, "int8")
        error = (as_int8.dequantize() - expected).view(48, -1, 32).abs().amax(dim=-1)
        assert (error <= as_int8.scale * 0.5 * (1 + 1e-5)).all()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_panel_layout_holds_the_weight(fmt) -> None:
    """Packing, then the torch fallback's unpacking, gives Int*Weight.dequantize's values,
    with outputs that do not fill the last panel."""
    weight = _weight(fmt, 37, 96)
    codes, scales = quantized.pack(weight)
    assert codes.shape[0] == scales.shape[0] == 3
    fallback = (
        quantized_torch.int4_matmul_torch if fmt == "int4" else quantized_torch.int8_matmul_torch
    )
    assert torch.equal(fallback(torch.eye(96), codes, scales, 37).t(), weight.dequantize())


@pytest.mark.parametrize(
    ("fmt", "rows", "cols"),
    [
        (fmt, *shape)
        for fmt in ("int8", "int4")
        for shape in ((1, 32), (37, 64), (100, 96), (16, 576))
    ]
    + [("int8", 50, 40)],
)
@pytest.mark.parametrize(("size", "scale_dtype"), [(0.05, torch.float16), (1e-7, torch.float32)])
def test_a_quantized_product_is_the_float_product_of_its_weight(
    table, fmt, rows, cols, size, scale_dtype
) -> None:
    """Against float64 products of the dequantised weight, for 1..70 rows, outputs that do
    not fill a panel, (int8) K not a multiple of 32, with one scale per row, and scales
    stored as float16 or float32."""
    weight = _weight(fmt, rows, cols, size)
    assert weight.format == fmt
    codes, scales = quantized.pack(weight)
    assert scales.dtype == scale_dtype
    op = table.int4_matmul if fmt == "int4" else table.int8_matmul
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(70, cols, generator=generator).double()
    dense = weight.dequantize().double()
    reference = x @ dense.t()
    # float32 rounding of each running sum: at most K ulps of the sum of magnitudes.
    bound = cols * torch.finfo(torch.float32).eps * (x.abs() @ dense.abs().t())
    for count in range(1, 71):
        got = op(x[:count].float(), codes, scales, rows)
        assert got.shape == (count, rows) and got.dtype == torch.float32
        assert ((got.double() - reference[:count]).abs() <= bound[:count]).all(), count


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_compiled_and_torch_products_agree(compiled_ops, torch_ops, fmt) -> None:
    """Also through leading dimensions, strided rows and bf16 inputs."""
    weight = _weight(fmt, 200, 576)
    codes, scales = quantized.pack(weight)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 9, 1200, generator=generator)[..., 20:596]
    name = f"{fmt}_matmul"
    got = getattr(compiled_ops, name)(x, codes, scales, 200)
    expected = getattr(torch_ops, name)(x, codes, scales, 200)
    assert got.shape == (3, 9, 200)
    assert (got - expected).abs().max() < 1e-4
    got = getattr(compiled_ops, name)(x.bfloat16(), codes, scales, 200)
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected).abs().max() < 0.05


needs_bf16_products = pytest.mark.skipif(
    not cpu_has_fast_bf16(), reason="needs a CPU with native bf16 products (AVX512-BF16)"
)


@pytest.mark.parametrize(
    "op_name", ["int8_matmul", "int4_matmul", "int4_matmul_a8", "int8_matmul_a8"]
)
@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_products)]
)
def test_a_compiled_product_row_depends_on_neither_the_other_rows_nor_the_threads(
    compiled_ops, op_name, dtype
) -> None:
    """fp32: calls of up to 3 rows over weights in registers, else row blocks of 6 over a
    buffer; bf16 (the bf16 products): up to 3 rows converting the codes in registers, else
    row blocks of 8 over a buffer; int8 activations (the _a8 products, either dtype): up to
    3 rows making the operands in registers, else row blocks of 4 over a buffer; in
    chunks of 64 rows (the bf16 and _a8 products: 256), threads splitting the panels."""
    fmt = op_name.split("_")[0]
    weight = _weight(fmt, 1000, 1536)  # 63 panels, the last part-filled; 6 chunks of inputs
    a8_int8 = op_name == "int8_matmul_a8"
    codes, scales = quantized.pack_a8(weight) if a8_int8 else quantized.pack(weight)
    op = getattr(compiled_ops, op_name)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(300, 1536, generator=generator).to(dtype)
    threads = torch.get_num_threads()  # tests/conftest.py puts it back after the test
    torch.set_num_threads(1)
    alone = torch.cat([op(x[i : i + 1], codes, scales, 1000) for i in range(300)])
    for count in (2, 3, 4, 5, 6, 7, 8, 9, 13, 64, 65, 150, 300):
        assert torch.equal(op(x[:count], codes, scales, 1000), alone[:count]), count
    torch.set_num_threads(max(2, threads))
    for count in (1, 7, 70, 300):
        assert torch.equal(op(x[:count], codes, scales, 1000), alone[:count]), count
    assert torch.equal(op(x[40:73], codes, scales, 1000), alone[40:73])


@needs_bf16_products
@pytest.mark.parametrize(
    ("fmt", "rows", "cols"),
    [(fmt, *shape) for fmt in ("int8", "int4") for shape in ((37, 64), (200, 96), (1000, 576))],
)
@pytest.mark.parametrize(("size", "scale_dtype"), [(0.05, torch.float16), (1e-7, torch.float32)])
def test_bf16_products_are_the_product_of_the_weight_in_bf16(
    compiled_ops, fmt, rows, cols, size, scale_dtype
) -> None:
    """bf16 activations take the bf16 dot products: within the result's bf16 rounding
    (and fp32 sums) of the float64 product, for 1..70 rows (the few-row path, the buffered
    one and their remainders), outputs in a part-filled block of panels, both scale dtypes."""
    weight = _weight(fmt, rows, cols, size)
    codes, scales = quantized.pack(weight)
    assert scales.dtype == scale_dtype
    op = compiled_ops.int4_matmul if fmt == "int4" else compiled_ops.int8_matmul
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(1)).bfloat16()
    dense = weight.dequantize().double()
    reference = x.double() @ dense.t()
    magnitude = x.double().abs() @ dense.abs().t()
    bound = reference.abs() * 2.0**-8 + 2 * cols * torch.finfo(torch.float32).eps * magnitude
    for count in (1, 2, 3, 4, 8, 9, 31, 32, 33, 64, 70):
        got = op(x[:count], codes, scales, rows)
        assert got.shape == (count, rows) and got.dtype == torch.bfloat16
        assert ((got.double() - reference[:count]).abs() <= bound[:count]).all(), count


def test_a_quantized_embedding_gathers_its_head_s_rows(table) -> None:
    weight = _weight("int8", 100, 64)
    head = QuantizedLinear(weight, None, table)
    embedding = QuantizedEmbedding(head, torch.float32)
    assert embedding.codes is head.codes
    tokens = torch.tensor([[0, 99, 16], [15, 17, 50]])
    assert torch.equal(embedding(tokens), weight.dequantize()[tokens])


def test_torch_export_traces_a_quantized_product(table) -> None:
    linear = QuantizedLinear(_weight("int4", 40, 64), torch.randn(40), table)
    x = torch.randn(5, 64)
    exported = torch.export.export(linear, (x,))
    namespace = ops.NAMESPACE if table.kind == "compiled" else ops.TORCH_NAMESPACE
    assert f"{namespace}.int4_matmul" in str(exported.graph)
    assert torch.equal(exported.module()(x), linear(x))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_product_row_does_not_depend_on_the_other_rows(table, fmt) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(576, 1536, generator=generator) * 0.05
    rows = torch.randn(300, 1536, generator=generator)
    linear = QuantizedLinear(quantized.from_float(weight, fmt), None, table)
    assert linear.kernel == ("compiled" if table.kind == "compiled" else "dequantize")
    full = linear(rows)
    reference = rows @ quantized.from_float(weight, fmt).dequantize().t()
    assert (full - reference).abs().max() < 1e-3
    for count in (1, 2, 3, 15, 16, 33, 128):
        assert torch.equal(linear(rows[:count]), full[:count]), count
    for start in (1, 7, 40):
        assert torch.equal(linear(rows[start : start + 32]), full[start : start + 32]), start


def _dequantized_twin(hf_model, folder, kind: str, fmt: str, overrides: dict):
    """A float checkpoint holding exactly the weights `fmt` quantisation keeps."""
    twin, twin_folder = make_tiny_checkpoint(kind, folder, **overrides)
    state = {}
    for key, value in hf_model.state_dict().items():
        role = "embedding" if "embed" in key else "lm_head" if "lm_head" in key else "projection"
        if re.search(r"(_proj|embed_tokens|lm_head)\.weight$", key):
            target = quantized.target_format(fmt, role, None)
            value = quantized.from_float(value, target).dequantize()
        state[key] = value
    twin.load_state_dict(state)
    twin.save_pretrained(twin_folder)
    return twin_folder


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {})],
    ids=["llama-tied", "qwen2", "qwen3"],
)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_model_computes_its_weights_and_stays_near_fp32(
    tmp_path, packed_steps, kernel, kind, overrides, fmt
) -> None:
    hf_model, folder = make_tiny_checkpoint(kind, tmp_path / "model", **overrides)
    # Float inputs: `auto` gives a float32 model int8 inputs on CPUs whose speed dtype it
    # is (AVX2), and this compares the weights' products alone.
    _, model = load_model(folder, "float32", kernel, fmt, activations="float")
    assert {m.format for m in model.modules() if isinstance(m, QuantizedLinear)} == (
        {"int4", "int8"} if fmt == "int4" else {"int8"}
    )
    got = torch.cat(packed_steps(model, STEPS, 2))
    twin = _dequantized_twin(hf_model, tmp_path / "twin", kind, fmt, overrides)
    _, twin_model = load_model(twin, "float32", kernel, "none")
    expected = torch.cat(packed_steps(twin_model, STEPS, 2))
    if kernel == "torch":
        assert torch.equal(got, expected)
    else:
        assert (got - expected).abs().max() < ORDER_TOLERANCE
    _, fp32 = load_model(folder, "float32", kernel, "none")
    reference = torch.cat(packed_steps(fp32, STEPS, 2))
    relative = ((got - reference).norm() / reference.norm()).item()
    # Random tiny weights are the worst case for 4 bits (the default model: see the notes).
    assert relative < (0.05 if fmt == "int8" else 0.5)


@pytest.mark.parametrize(
    ("dtype", "activations"),
    [("float32", "float"), ("bfloat16", "float"), ("bfloat16", "int8")],
)
def test_a_layer_run_as_one_op_gives_the_bits_of_its_steps(
    compiled_ops, tiny_checkpoint, packed_steps, dtype, activations
) -> None:
    """The compiled `decoder_layer` against the same layers run step by step from
    Python, over prompt chunks beside decodes."""
    _, folder = tiny_checkpoint("llama")
    _, model = load_model(folder, dtype, "compiled", "int4", activations=activations)
    kv_dtype = model.dtype
    assert model.fuse_layers() == model.config.num_layers  # load_model fused them already
    fused = packed_steps(model, STEPS, 2, kv_dtype)
    assert model.fuse_layers(False) == 0
    stepwise = packed_steps(model, STEPS, 2, kv_dtype)
    for one_op, steps in zip(fused, stepwise, strict=True):
        assert torch.equal(one_op, steps)


@pytest.mark.parametrize(
    ("kind", "quantize", "kernels", "why"),
    [
        ("qwen2", "int4", "compiled", "a bias on qkv"),
        ("qwen3", "int4", "compiled", "q/k norms"),
        ("llama", "none", "compiled", "float products"),
        ("llama", "int4", "torch", "the torch ops"),
    ],
)
def test_other_layers_keep_their_steps(
    tmp_path, compiled_ops, kind, quantize, kernels, why
) -> None:
    _, folder = make_tiny_checkpoint(kind, tmp_path / kind)
    _, model = load_model(folder, "float32", kernels, quantize)
    assert model.fuse_layers() == 0, why


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_sequence_is_batch_invariant(
    tiny_checkpoint, first_sequence_logits, kernel, fmt
) -> None:
    """Sequence 0's logits are bit-identical alone, chunked, beside others, first or last."""
    _, folder = tiny_checkpoint("llama")
    _, model = load_model(folder, "float32", kernel, fmt)
    # The compiled kernel's rows need no padding: a decode alone is a 1-row product.
    assert (model.min_rows == 1) == (kernel == "compiled")
    generator = torch.Generator().manual_seed(5)
    lengths = [70, 3, 100, 17, 40, 9]
    prompts = [torch.randint(0, 96, (n,), generator=generator).tolist() for n in lengths]
    decodes = [7, 31, 64]
    alone = first_sequence_logits(model, prompts, decodes, [0], 256)
    for order, chunk in (([0], 16), ([0, 1, 2, 3, 4, 5], 256), ([5, 4, 3, 2, 1, 0], 16)):
        got = first_sequence_logits(model, prompts, decodes, order, chunk)
        assert torch.equal(got, alone), (order, chunk)


def _gguf_kind(name: str) -> str | None:
    """Q4_1 projections, except one Q5_0 tensor; Q8_0 embedding and output."""
    if name == "blk.1.ffn_down.weight":
        return "Q5_0"
    if name in ("token_embd.weight", "output.weight"):
        return "Q8_0"
    return "Q4_1" if name.endswith(".weight") and "norm" not in name else None


def test_a_gguf_file_keeps_its_precision_class(
    tiny_checkpoint, packed_steps, tmp_path, caplog, kernel
) -> None:
    hf_model, _ = tiny_checkpoint("llama")
    file = tmp_path / "q.gguf"
    write_gguf(hf_model, file, "llama", kinds=_gguf_kind)
    with caplog.at_level(logging.WARNING):
        _, model = load_model(file, "float32", kernel, activations="float")
    notes = [r.getMessage() for r in caplog.records if "quantised" in r.getMessage()]
    assert len(notes) == 1 and "Q5_0" in notes[0], notes
    summary = weights_summary.describe(model)
    assert summary.formats == {"projections": "int4", "embedding": "int8", "lm_head": "int8"}
    assert summary.kernel == ("compiled" if kernel == "compiled" else "dequantize")
    assert isinstance(model.layers[1].down, PackedLinear)  # the Q5_0 tensor, as float
    assert model.layers[0].down.format == "int4" and model.layers[1].qkv.format == "int4"
    # The same file dequantised to float32: the int4 and int8 blocks are the file's own (the
    # int4 zeros rounded once), so only the roundings of the products differ.
    _, dequantised = load_model(file, "float32", kernel, "none")
    assert not any(isinstance(m, QuantizedLinear) for m in dequantised.modules())
    got = torch.cat(packed_steps(model, STEPS, 2))
    expected = torch.cat(packed_steps(dequantised, STEPS, 2))
    assert (got - expected).abs().max() < ORDER_TOLERANCE
    # With int8 inputs (what "auto" takes where the CPU has them, as llama.cpp's products
    # do) the Q4_1 and Q5_0 blocks are kept as they are, in the file's bytes.
    _, kept = load_model(file, "float32", kernel, activations="int8")
    kept_summary = weights_summary.describe(kept)
    assert kept_summary.formats == {"projections": "Q4_1", "embedding": "int8", "lm_head": "int8"}
    assert kept.layers[0].down.format == "Q4_1" and kept.layers[1].down.format == "Q5_0"
    assert kept_summary.bytes_by_format["Q4_1"] > 0 and kept_summary.bytes_by_format["Q5_0"] > 0
    assert "(qkv, o_proj, gate_up, down, lm_head with int8 activations)" in kept_summary.format
    # Every product's inputs rounded to int8 (a random model amplifies it); a layout read
    # wrong would be wrong by about 100%.
    kept_got = torch.cat(packed_steps(kept, STEPS, 2))
    assert (kept_got - expected).norm() < 0.08 * expected.norm()
    # "auto" keeps them so only where the inputs resolve to int8: a model whose products
    # keep float inputs (float32 on a bf16 CPU, or no vector int8 path) holds them as int4.
    _, auto = load_model(file, "float32", kernel)
    a8 = quantized.resolve_activations("auto", auto.ops.kind, torch.float32)
    assert auto.layers[0].down.format == ("Q4_1" if a8 == "int8" else "int4")
    # Asked for int8, the Q4_1 projections become int8 too.
    _, as_int8 = load_model(file, "float32", kernel, "int8", activations="float")
    assert weights_summary.describe(as_int8).format == "int8"


@pytest.mark.parametrize(
    ("kinds", "activations", "a8", "expected"),
    [
        (["Q4_0"], "auto", "int8", "kquant"),
        (["Q4_1"], "auto", "float", "int4"),  # int4 holds Q4_0/Q4_1 exactly
        (["Q4_1", "Q5_0"], "auto", "float", "kquant"),  # Q5_0 would be float otherwise
        (["Q4_K", "Q6_K"], "auto", "float", "kquant"),
        (["Q4_K", "Q6_K"], "float", "float", "none"),
        (["Q4_0", "Q4_K"], "float", "float", "int4"),
        (["Q8_0"], "auto", "int8", "int8"),
    ],
)
def test_auto_keeps_gguf_blocks_where_their_int8_inputs_are_chosen(
    kinds, activations, a8, expected
) -> None:
    assert quantized.target_format("auto", "projection", kinds, activations, a8) == expected


def test_a_bad_quantize_choice_fails_before_loading(tmp_path) -> None:
    from cellbatch.cli import main
    from cellbatch.engine import Engine

    missing = tmp_path / "no-such-model"
    with pytest.raises(InvalidArgumentError, match=r"int3.*auto, none, int8, int4"):
        load_model(missing, quantize="int3")
    with pytest.raises(InvalidArgumentError, match="fp4"):
        Engine.from_pretrained(missing, quantize="fp4")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--model", str(missing), "--quantize", "int3", "hello"])
    assert exit_info.value.code == 2


def test_the_engine_says_which_weight_format_ran(tiny_checkpoint) -> None:
    from cellbatch.engine import Engine

    _, folder = tiny_checkpoint("llama")
    with Engine.from_pretrained(
        folder, dtype="float32", quantize="int8", activations="float"
    ) as engine:
        assert engine.weight_format == "int8"
        assert engine.dtype == torch.float32
        by_format = engine.weights.bytes_by_format
        assert by_format["int8"] > 0 and sum(by_format.values()) == engine.weights_bytes
    with Engine.from_pretrained(folder, dtype="float32") as engine:
        assert engine.weight_format == "float32" and engine.weights.kernel == "none"
