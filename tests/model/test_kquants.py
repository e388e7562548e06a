"""GGUF block kinds kept as they are (cellbatch.model.kquants, `kquant_matmul_a8`,
kernels/quantized_kq*.cpp): the layout holds gguf's own values bit for bit, the compiled
products are the product of those values with the inputs quantised to int8 (the VNNI path,
the AVX2 one and the portable loop alike, bit for bit), a row's result depends on neither the
other rows nor the thread count, and a file of K-quant tensors loads each in its own kind and
computes what its dequantised model computes."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from cellbatch.model import cpu, kquants, ops, quantized_torch, weights_summary
from cellbatch.model.gguf_blocks import from_gguf
from cellbatch.model.loading import load_model
from cellbatch.model.quantized import QuantizedLinear
from tiny_models import K_QUANT_ENCODERS, write_gguf

KINDS = kquants.KINDS


@pytest.fixture(params=["compiled", "torch"])
def kernel(request) -> str:
    """The ops choice a test loads its models with (the compiled kernels required)."""
    if request.param == "compiled":
        request.getfixturevalue("compiled_ops")
    return request.param


@pytest.fixture
def table(request, kernel) -> ops.Ops:
    """The ops table of `kernel`."""
    return request.getfixturevalue(f"{kernel}_ops")


def _blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A weight's GGUF blocks of `kind`: encoded from a normal weight with per-row sizes."""
    import gguf

    generator = np.random.default_rng(seed)
    weight = generator.normal(0, 0.05, (rows, cols)) * generator.uniform(0.2, 2, (rows, 1))
    weight = weight.astype(np.float32)
    if kind in K_QUANT_ENCODERS:
        return K_QUANT_ENCODERS[kind](weight)
    return gguf.quants.quantize(weight, gguf.GGMLQuantizationType[kind])


def _expected(blocks: np.ndarray, kind: str, rows: int) -> torch.Tensor:
    import gguf

    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(values.reshape(rows, -1))


def _weight(kinds: tuple[str, ...], rows: tuple[int, ...], cols: int) -> kquants.KQuantWeight:
    parts = [
        kquants.from_blocks(_blocks(kind, n, cols, seed), kind)
        for seed, (kind, n) in enumerate(zip(kinds, rows, strict=True))
    ]
    return kquants.KQuantWeight.cat(parts)


@pytest.mark.parametrize("kind", KINDS)
def test_the_layout_holds_gguf_s_own_values(kind) -> None:
    """Blocks read into the layout, packed and read back give gguf's dequantised values
    bit for bit, for rows that do not fill the last panel; the layout is as large as the
    file (Q4_K and Q5_K: their 6-bit scales and mins a byte each, 2-3% more)."""
    rows, cols = 37, 512
    blocks = _blocks(kind, rows, cols)
    weight = from_gguf(blocks, kind, "kquant")
    assert isinstance(weight, kquants.KQuantWeight) and weight.shape == (rows, cols)
    assert torch.equal(weight.dequantize(), _expected(blocks, kind, rows))
    back = kquants.unpack(*kquants.pack(weight))
    assert torch.equal(back.dequantize(), _expected(blocks, kind, rows))
    full = from_gguf(_blocks(kind, 64, cols), kind, "kquant")
    held = sum(s.nbytes for s in full.segments)
    file = 64 * blocks.shape[1]
    if kind in ("Q4_K", "Q5_K"):
        assert file < held <= 1.03 * file, (held, file)
    else:
        assert held == file, (held, file)


def test_a_weight_of_mixed_kinds_is_segments_in_row_order() -> None:
    kinds, rows = ("Q4_K", "Q4_K", "Q6_K", "Q5_0"), (48, 16, 20, 33)
    weight = _weight(kinds, rows, 256)
    assert [s.kind for s in weight.segments] == ["Q4_K", "Q6_K", "Q5_0"]  # 48 + 16 merged
    expected = torch.cat(
        [
            _expected(_blocks(kind, n, 256, seed), kind, n)
            for seed, (kind, n) in enumerate(zip(kinds, rows, strict=True))
        ]
    )
    assert torch.equal(kquants.unpack(*kquants.pack(weight)).dequantize(), expected)


def _inputs(count: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(count, cols, generator=torch.Generator().manual_seed(1))
    x[min(1, count - 1), :32] = 0.0  # an all-zero group
    x[0, 5] = 30.0  # an outlier
    return x.to(dtype)


MIXED = (("Q4_K", "Q6_K", "Q5_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1"), (40, 24, 16, 16, 32, 8, 20))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_products_are_the_weight_s_with_int8_inputs(compiled_ops, torch_ops, dtype) -> None:
    """The compiled op and the torch implementation agree to float rounding, and both are
    within the inputs' int8 rounding of the product with gguf's values, for the few-row
    path, the buffered one and their remainders, over segments of every kind."""
    weight = _weight(*MIXED, 512)
    codes, scales = kquants.pack(weight)
    out = weight.shape[0]
    dense = weight.dequantize().double()
    x = _inputs(70, 512, dtype)
    groups = x.double().view(70, -1, 256)  # a weight with K-quants: a scale per block
    # The inputs' rounding: half a step (max|x| / 127 / 2) per input, times |w|.
    step = (groups.abs().amax(-1, keepdim=True) / 254).expand_as(groups).reshape(70, 512)
    bound = step @ dense.abs().t() + 1e-5 * (x.double().abs() @ dense.abs().t()) + 1e-6
    reference = x.double() @ dense.t()
    for count in (1, 2, 3, 4, 5, 9, 33, 64, 70):
        got = compiled_ops.kquant_matmul_a8(x[:count], codes, scales, out)
        assert got.shape == (count, out) and got.dtype == dtype
        fallback = torch_ops.kquant_matmul_a8(x[:count], codes, scales, out)
        rounding = 2e-2 if dtype == torch.bfloat16 else 1e-5
        close = (
            got.double() - fallback.double()
        ).abs() <= rounding * fallback.double().abs() + 1e-4
        assert close.all(), count
        slack = reference[:count].abs() * (2**-8 if dtype == torch.bfloat16 else 0)
        assert ((got.double() - reference[:count]).abs() <= bound[:count] + slack).all(), count


@pytest.mark.parametrize("kinds", [("Q4_0",), ("Q4_1",), ("Q5_0",), ("Q5_1",), MIXED[0]])
def test_the_products_are_the_quantised_inputs_times_gguf_s_values(
    compiled_ops, torch_ops, kinds
) -> None:
    """Every kind's product, its zero or offset included, is that of the inputs as their
    int8 codes hold them (llama.cpp's Q8_0 / Q8_1 or Q8_K) and gguf's values, to float32
    sums: an offset multiplies the quantised inputs' sum (Q8_1's s), a zero comes off the
    dot in the integers (Q4_0 x Q8_0), so the inputs' rounding is never scaled by the
    codes alone."""
    rows = MIXED[1] if len(kinds) > 1 else (40,)
    weight = _weight(kinds, rows, 512)
    codes, scales = kquants.pack(weight)
    x = _inputs(9, 512, torch.float32)
    span = 256 if any(kquants.in_blocks(kind) for kind in kinds) else 32
    x_codes, x_scales, _ = quantized_torch.quantize_activations(x, span)
    inputs = (x_codes.double() * x_scales.double()[..., None]).flatten(-2)
    dense = weight.dequantize().double()
    reference = inputs @ dense.t()
    bound = 4 * 512 * torch.finfo(torch.float32).eps * (inputs.abs() @ dense.abs().t()) + 1e-6
    for table in (compiled_ops, torch_ops):
        got = table.kquant_matmul_a8(x, codes, scales, weight.shape[0]).double()
        assert ((got - reference).abs() <= bound).all(), kinds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_portable_loop_gives_the_vector_path_s_bits(compiled_ops, dtype) -> None:
    """CELLBATCH_A8_PORTABLE=1 runs the portable loop: the same chain, the same bits as the
    paths this CPU takes (VNNI for 1 row and, where there is AMX, tiles for 9; the AVX2 run of
    this file holds the AVX2 path to it)."""
    weight = _weight(*MIXED, 512)
    codes, scales = kquants.pack(weight)
    x = _inputs(9, 512, dtype)
    vector = [compiled_ops.kquant_matmul_a8(x[:n], codes, scales, weight.shape[0]) for n in (1, 9)]
    os.environ["CELLBATCH_A8_PORTABLE"] = "1"
    try:
        portable = [
            compiled_ops.kquant_matmul_a8(x[:n], codes, scales, weight.shape[0]) for n in (1, 9)
        ]
    finally:
        del os.environ["CELLBATCH_A8_PORTABLE"]
    assert all(torch.equal(a, b) for a, b in zip(vector, portable, strict=True))


def test_a_row_depends_on_neither_the_other_rows_nor_the_threads(compiled_ops) -> None:
    weight = _weight(("Q4_K", "Q6_K", "Q5_0"), (500, 250, 250), 768)  # 63 panels
    codes, scales = kquants.pack(weight)
    x = torch.randn(300, 768, generator=torch.Generator().manual_seed(3))
    op = compiled_ops.kquant_matmul_a8
    threads = torch.get_num_threads()  # tests/conftest.py puts it back after the test
    torch.set_num_threads(1)
    alone = torch.cat([op(x[i : i + 1], codes, scales, 1000) for i in range(300)])
    for count in (2, 3, 4, 5, 7, 13, 64, 65, 150, 256, 300):  # 300: two passes over a block
        assert torch.equal(op(x[:count], codes, scales, 1000), alone[:count]), count
    torch.set_num_threads(max(2, threads))
    for count in (1, 7, 70, 300):
        assert torch.equal(op(x[:count], codes, scales, 1000), alone[:count]), count
    assert torch.equal(op(x[40:73], codes, scales, 1000), alone[40:73])


@pytest.mark.skipif(not cpu.cpu_has_amx(), reason="needs AMX (and torch at the AVX512 width)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tile_path_gives_the_vnni_path_s_bits(compiled_ops, monkeypatch, dtype) -> None:
    """CELLBATCH_AMX=always puts every call on the AMX tiles: each row's bits are the VNNI
    path's, for every kind in one weight (Q6_K's sub-groups apart), a chunk of fewer groups,
    part-filled row tiles and blocks, and more than one pass of rows, on 1 and 2 threads."""
    op = compiled_ops.kquant_matmul_a8
    for weight in (_weight(*MIXED, 512), _weight(("Q5_1", "Q4_0"), (20, 30), 96)):
        codes, scales = kquants.pack(weight)
        out, cols = weight.shape
        x = _inputs(150, cols, dtype)
        monkeypatch.setenv("CELLBATCH_AMX", "0")
        vnni = op(x, codes, scales, out)
        monkeypatch.setenv("CELLBATCH_AMX", "always")
        for threads in (1, 2):
            torch.set_num_threads(threads)  # tests/conftest.py puts it back after the test
            for n in (1, 4, 15, 17, 129, 150):
                assert torch.equal(op(x[:n], codes, scales, out), vnni[:n]), (threads, n)
            assert torch.equal(op(x[40:73], codes, scales, out), vnni[40:73]), threads


def _largest_block(kind: str) -> np.ndarray:
    """One GGUF block of `kind` whose every weight is at its largest magnitude: Q4_K/Q5_K
    q 15 or 31, sc and mn 63, d and dmin 1; Q6_K q 0 (q - 32 = -32), sc -128, d 1."""
    one = np.frombuffer(np.array([1.0, 1.0], dtype=np.float16).tobytes(), np.uint8)
    if kind == "Q6_K":  # ql[128], qh[64], scales[16], d
        block = np.zeros(210, dtype=np.uint8)
        block[192:208] = 0x80
        block[208:210] = one[:2]
        return block
    block = np.full({"Q4_K": 144, "Q5_K": 176}[kind], 0xFF, dtype=np.uint8)
    block[0:4] = one  # d, dmin
    return block


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_a_block_s_integer_sums_hold_the_largest_codes_and_scales(
    compiled_ops, monkeypatch, kind
) -> None:
    """Every weight at its largest magnitude and every input at +-127 (x +-1): a block's
    integer sums (isum; Q4_K/Q5_K's imin) reach their largest magnitudes, and every path
    (VNNI's few rows and buffer, the tiles, the portable loop) gives the weight's product
    within float rounding: no int32 overflows."""
    block = _largest_block(kind)
    rows, cols = 48, 512
    weight = kquants.from_blocks(np.tile(block, (rows, cols // 256)), kind)
    codes, scales = kquants.pack(weight)
    dense = weight.dequantize().double()
    # d sc q - dmin mn: 882 (Q4_K) or 1890 (Q5_K); d sc (q - 32): 4096 (Q6_K)
    assert dense.abs().max() == {"Q4_K": 882, "Q5_K": 1890, "Q6_K": 4096}[kind]
    signs = torch.ones(70, cols)
    signs[1::2, ::3] = -1.0
    expected = signs.double() @ dense.t()
    runs = {"vnni": {"CELLBATCH_AMX": "0"}, "amx": {"CELLBATCH_AMX": "always"}}
    runs["portable"] = {"CELLBATCH_A8_PORTABLE": "1"}
    for name, env in runs.items():
        if name == "amx" and not cpu.cpu_has_amx():
            continue
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        for n in (1, 3, 70):
            got = compiled_ops.kquant_matmul_a8(signs[:n], codes, scales, rows).double()
            assert torch.allclose(got, expected[:n], rtol=1e-5, atol=0), (name, n)
        for key in env:
            monkeypatch.delenv(key)


def test_a_bad_header_or_shape_is_refused(compiled_ops) -> None:
    codes, scales = kquants.pack(_weight(("Q4_K",), (20,), 256))
    op = compiled_ops.kquant_matmul_a8
    with pytest.raises(RuntimeError, match="segments hold 20 outputs, not 21"):
        op(torch.randn(2, 256), codes, scales, 21)
    with pytest.raises(RuntimeError, match="256 inputs, x has 512"):
        op(torch.randn(2, 512), codes, scales, 20)
    with pytest.raises(RuntimeError, match="outside the codes or scales"):
        op(torch.randn(2, 256), codes[:-64].clone(), scales, 20)
    with pytest.raises(RuntimeError, match="kquant header"):
        op(torch.randn(2, 256), torch.zeros_like(codes), scales, 20)


def test_a_kept_embedding_gathers_its_head_s_rows(table) -> None:
    weight = _weight(("Q6_K",), (100,), 256)
    head = kquants.KQuantLinear(weight, None, table)
    embedding = kquants.KQuantEmbedding(head, torch.bfloat16, table)
    tokens = torch.tensor([[0, 99, 16], [15, 17, 50]])
    assert torch.equal(embedding(tokens), weight.dequantize()[tokens].to(torch.bfloat16))


def test_the_rows_op_gives_gguf_s_values_of_every_kind(table) -> None:
    """kquant_rows: any outputs, in any order, repeated, across segments of every kind, are
    gguf's own values (the layout's, which test_the_layout_holds_gguf_s_own_values holds to
    gguf's dequantiser) bit for bit; no rows, no values."""
    weight = _weight(*MIXED, 512)
    codes, scales = kquants.pack(weight)
    out = weight.shape[0]
    rows = torch.tensor([155, 0, 39, 40, 63, 64, 80, 96, 127, 128, 135, 136, 0, 155, 70])
    got = table.kquant_rows(codes, scales, rows, 512, out)
    assert got.dtype == torch.float32
    assert torch.equal(got, weight.dequantize()[rows])
    assert table.kquant_rows(codes, scales, rows[:0], 512, out).shape == (0, 512)


def test_the_rows_op_refuses_a_row_outside_the_weight(table) -> None:
    weight = _weight(("Q4_K", "Q5_0"), (20, 12), 256)
    codes, scales = kquants.pack(weight)
    error = RuntimeError if table.kind == "compiled" else ValueError
    for bad in (32, -1):
        with pytest.raises(error, match="outside the weight's 32 outputs"):
            table.kquant_rows(codes, scales, torch.tensor([3, bad]), 256, 32)
    with pytest.raises(error, match="int64 vector"):
        table.kquant_rows(codes, scales, torch.tensor([3], dtype=torch.int32), 256, 32)


def test_torch_export_traces_a_kept_product_and_embedding(table) -> None:
    linear = kquants.KQuantLinear(_weight(("Q4_K", "Q6_K"), (32, 16), 256), None, table)
    embedding = kquants.KQuantEmbedding(linear, torch.float32, table)
    namespace = ops.NAMESPACE if table.kind == "compiled" else ops.TORCH_NAMESPACE
    for module, argument, op in (
        (linear, torch.randn(5, 256), "kquant_matmul_a8"),
        (embedding, torch.tensor([[47, 3], [0, 31]]), "kquant_rows"),
    ):
        exported = torch.export.export(module, (argument,))
        assert f"{namespace}.{op}" in str(exported.graph)
        assert torch.equal(exported.module()(argument), module(argument))


def _q4_k_m(name: str) -> str | None:
    """Q4_K_M's mix: Q4_K projections, Q6_K for v, down of layer 1 and the embedding."""
    if "norm" in name or not name.endswith(".weight"):
        return None
    if name in ("token_embd.weight", "output.weight", "blk.1.ffn_down.weight"):
        return "Q6_K"
    return "Q6_K" if "attn_v" in name else "Q4_K"


SHAPE = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, std=0.05
)
STEPS = [[(0, list(range(1, 30))), (1, [5, 9, 3])], [(0, [4]), (1, list(range(40, 60)))]]


def test_a_q4_k_m_file_keeps_every_tensor_in_its_kind(
    tiny_checkpoint, packed_steps, tmp_path, caplog, kernel
) -> None:
    """Every projection, the embedding and the head stay in their kinds; the load line
    says what runs them; the model computes what the file's dequantised model computes,
    within the int8 inputs' rounding; with float inputs asked for, nothing is kept."""
    hf_model, _ = tiny_checkpoint("llama", **SHAPE)
    file = tmp_path / "q4_k_m.gguf"
    write_gguf(hf_model, file, "llama", kinds=_q4_k_m)
    said: list[str] = []
    with caplog.at_level(logging.WARNING):
        _, model = load_model(file, "float32", kernel, progress=lambda what, _: said.append(what))
    assert not [r for r in caplog.records if "cannot stay quantised" in r.getMessage()]
    assert model.layers[0].qkv.format == "Q4_K+Q6_K" and model.layers[1].down.format == "Q6_K"
    assert model.layers[0].down.format == "Q4_K" and model.embed.format == "Q6_K"
    assert model.lm_head is not None and model.lm_head.format == "Q6_K"
    assert "Q4_K in 7 products" in said[-1] and "Q6_K in 4 products" in said[-1]
    assert "kept as they are: kquant_matmul_a8, int8 inputs" in said[-1]
    summary = weights_summary.describe(model)
    assert summary.format.endswith(said[-1].partition("; ")[2].removesuffix(")"))
    assert set(summary.bytes_by_format) == {"Q4_K", "Q6_K", "float32"}
    assert sum(summary.bytes_by_format.values()) == sum(
        p.numel() * p.element_size() for p in model.parameters()
    )
    _, dequantised = load_model(file, "float32", kernel, "none")
    got = torch.cat(packed_steps(model, STEPS, 2))
    expected = torch.cat(packed_steps(dequantised, STEPS, 2))
    # Every product's inputs rounded to int8 (a random model amplifies it: 4% here, and
    # 0.9% on the float products of the Q4_1 file of this model, whose embedding and head
    # are requantised to int8); a layout read wrong would be wrong by about 100%.
    assert (got - expected).norm() < 0.08 * expected.norm()
    _, floats = load_model(file, "float32", kernel, activations="float")
    assert not any(isinstance(m, kquants.KQuantLinear) for m in floats.modules())
    assert isinstance(floats.layers[0].gate_up, QuantizedLinear)  # Q4_K as int4
    assert floats.layers[0].gate_up.format == "int4"


def test_kept_layers_run_as_the_one_op_layer_and_as_the_torch_ops_do(
    compiled_ops, tiny_checkpoint, packed_steps, tmp_path
) -> None:
    """The one-op layer gives the Python steps' bits; the torch implementations give the
    compiled kernels' results to the inputs' rounding (each product agrees to float
    rounding, test_the_products_..., but a float rounding apart can move an input's int8
    code by one, which this random model amplifies)."""
    hf_model, _ = tiny_checkpoint("llama", **SHAPE)
    file = tmp_path / "q.gguf"
    write_gguf(hf_model, file, "llama", kinds=_q4_k_m)
    _, model = load_model(file, "float32", "compiled")
    assert model.fuse_layers() == 2
    fused = torch.cat(packed_steps(model, STEPS, 2))
    model.fuse_layers(False)
    assert torch.equal(torch.cat(packed_steps(model, STEPS, 2)), fused)
    _, slow = load_model(file, "float32", "torch")
    expected = torch.cat(packed_steps(slow, STEPS, 2))
    assert (fused - expected).norm() < 0.05 * expected.norm()


def test_the_torch_implementation_reads_the_layout(torch_ops) -> None:
    """quantized_torch's implementation is the reference: its product over one-hot rows
    is the weight (within the int8 inputs: a one-hot group quantises exactly)."""
    weight = _weight(*MIXED, 256)
    got = quantized_torch.kquant_matmul_a8_torch(torch.eye(256), *kquants.pack(weight), 156)
    assert torch.allclose(got.t(), weight.dequantize(), rtol=1e-6, atol=1e-7)
