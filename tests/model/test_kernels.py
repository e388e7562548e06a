"""The model's custom ops (`cellbatch.model.ops`): the compiled kernels against the torch
implementations, op by op and through a whole model, and torch.library's own checks
(schema, fake implementation, tracing) on both; which library `cellbatch.model.kernels`
accepts, and how a choice of kernels resolves."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from cellbatch.cache import CellCache, FlatAttentionPlan
from cellbatch.executor.sampling import greedy_tokens
from cellbatch.kv_format import head_width, store_heads
from cellbatch.model import kernels, kquants, quantized
from cellbatch.model import ops as model_ops
from cellbatch.model.attention import CellAttention
from cellbatch.model.loading import load_model
from cellbatch.model.ops import rotate
from cellbatch.types import InvalidArgumentError
from tiny_models import head_geometry

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=["compiled", "torch"])
def table(request) -> model_ops.Ops:
    """Each ops table in turn."""
    return request.getfixturevalue("compiled_ops" if request.param == "compiled" else "torch_ops")


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable values of a's dtype lie between a and b."""
    spacing = torch.finfo(a.dtype).eps * torch.maximum(a.float().abs(), b.float().abs())
    return (a.float() - b.float()).abs() / spacing.clamp_min(torch.finfo(a.dtype).tiny)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_torch_implementation_to_two_ulps(
    compiled_ops, torch_ops, dtype
) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, generator=generator).to(dtype)
    x = (torch.randn(37, 96, generator=generator) * 3).to(dtype)
    got = compiled_ops.rms_norm(x, weight, 1e-5)
    expected = torch_ops.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    # The mean of squares is summed in another order than torch's reduction.
    assert ulps_apart(got, expected).max() <= 2.0
    # A strided view of heads (as q/k norms get) and a row alone give the same bits.
    heads = torch.randn(5, 40, generator=generator).to(dtype)[:, :32].unflatten(1, (2, 16))
    head_weight = torch.randn(16, generator=generator).to(dtype)
    whole = compiled_ops.rms_norm(heads, head_weight, 1e-6)
    assert whole.shape == heads.shape
    assert torch.equal(compiled_ops.rms_norm(heads[3:4], head_weight, 1e-6), whole[3:4])
    assert torch.equal(compiled_ops.rms_norm(x[5:6], weight, 1e-5), got[5:6])


def rope_inputs(dtype: torch.dtype, cache_dtype: torch.dtype):
    """q, k, v (strided views of one qkv row block), cos, sin, cells, k_cache, v_cache: six
    tokens, the last two padding (not stored)."""
    generator = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, dim = 6, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (t.view(tokens, -1, dim) for t in (q, k, v))
    angles = torch.rand(tokens, dim // 2, generator=generator) * 50
    k_cache = torch.full((10, kv_heads, head_width(dim, cache_dtype)), -7, dtype=cache_dtype)
    cells = torch.tensor([7, 3, 9, 1])
    return q, k, v, angles.cos(), angles.sin(), cells, k_cache, k_cache.clone()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_rope_store_rotates_q_and_stores_k_v_like_the_torch_chain(
    table, dtype, cache_dtype
) -> None:
    """The rotated K and V as the cache holds them: an int8 cache quantises each head,
    with the bits of kv_format.quantize_heads in the compiled kernel too."""
    q, k, v, cos, sin, cells, k_cache, v_cache = rope_inputs(dtype, cache_dtype)
    expected_q = rotate(q, cos.to(dtype)[:, None], sin.to(dtype)[:, None])
    expected_k = rotate(k, cos.to(dtype)[:, None], sin.to(dtype)[:, None])
    table.rope_store(q, k, v, cos, sin, cells, k_cache, v_cache)
    assert torch.equal(q, expected_q)  # rotated in place, through the strided view
    assert torch.equal(k_cache[cells], store_heads(expected_k[:4], cache_dtype))
    assert torch.equal(v_cache[cells], store_heads(v[:4], cache_dtype))
    untouched = torch.tensor([0, 2, 4, 5, 6, 8])
    assert (k_cache[untouched] == -7).all() and (v_cache[untouched] == -7).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_torch_implementation(compiled_ops, torch_ops, dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(9, 2 * 72, generator=generator) * 4).to(dtype)  # 72: a ragged tail
    got = compiled_ops.silu_mul(gate_up)
    expected = torch_ops.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == (9, 72)
    assert ulps_apart(got, expected).max() <= 1.0
    assert torch.equal(compiled_ops.silu_mul(gate_up[4:5]), got[4:5])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 33, 100, 49_152])
def test_argmax_rows_gives_torch_max_indices_with_ties_nans_and_infinities(
    compiled_ops, dtype, vocab
) -> None:
    """The first of equal maxima, the first NaN of a row that holds one, rows of any
    width (whole vectors and a tail) and strided rows, on one thread or two."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-3, 4, (8, vocab), generator=generator).to(dtype)  # many ties
    if vocab > 40:
        logits[1, vocab - 3] = float("nan")
        logits[2, 37] = logits[2, vocab - 1] = float("nan")
        logits[3, 20] = logits[3, 36] = float("inf")
        logits[4] = float("-inf")
        logits[5, vocab - 1] = 9.0  # the maximum in the tail
    expected = logits.max(dim=-1).indices
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert torch.equal(compiled_ops.argmax_rows(logits), expected)
    strided = torch.cat([logits, logits], dim=1)[:, :vocab]
    assert torch.equal(compiled_ops.argmax_rows(strided), expected)
    columns = logits.t().contiguous().t()  # column-major: its rows strided, copied first
    assert torch.equal(compiled_ops.argmax_rows(columns), expected)
    assert torch.equal(greedy_tokens(logits), expected)


def test_the_compiled_ops_refuse_bad_shapes_with_a_message(compiled_ops) -> None:
    with pytest.raises(RuntimeError, match="weight must be"):
        compiled_ops.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        compiled_ops.silu_mul(torch.ones(2, 7))
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        compiled_ops.silu_mul(torch.ones(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"logits must be \[rows, vocab\] with vocab > 0"):
        compiled_ops.argmax_rows(torch.ones(2, 0))


# -- torch.library's checks ------------------------------------------------------------


HEADS = head_geometry(num_heads=4, num_kv_heads=2, head_dim=16)


def mixed_step() -> tuple[np.ndarray, FlatAttentionPlan]:
    """A step of a 5-token prompt chunk beside a decode (after a 3-token prompt): its 6
    tokens' cells and its attention plan, in a cache of 64 cells."""
    cache = CellCache(64)
    first, second = cache.seq_alloc(), cache.seq_alloc()
    for seq_ids, positions in (([second] * 3, [0, 1, 2]), ([first] * 5 + [second], [*range(5), 3])):
        ids, pos = np.array(seq_ids), np.array(positions)
        assert cache.declare_step(ids)
        cells = cache.place_step(ids, pos)
    return cells, CellAttention(HEADS, None).prepare(cache.attention_plan(ids, pos, cells))


def attention_inputs(dtype: torch.dtype) -> tuple:
    """The op's arguments for `mixed_step`, with 2 padding rows."""
    heads = HEADS
    _, args = mixed_step()
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(8, heads.num_heads, heads.head_dim, generator=generator).to(dtype)
    k_cache, v_cache = torch.randn(2, 65, heads.num_kv_heads, heads.head_dim, generator=generator)
    out = torch.zeros(8, heads.num_heads * heads.head_dim, dtype=dtype)
    return (
        q,
        k_cache,
        v_cache,
        args.cells,
        args.rows,
        args.positions,
        args.cell_offsets,
        args.block_starts,
        0,
        heads.attention_scale,
        out,
    )


def layer_inputs(dtype: torch.dtype) -> tuple:
    """decoder_layer's arguments for `mixed_step` (6 tokens, 2 padding rows): hidden 64,
    4 heads of 16 over 2 KV heads, intermediate 64, the four products int4 with and
    without int8 activations in turn."""
    heads = HEADS
    cells, plan = mixed_step()
    generator = torch.Generator().manual_seed(6)

    def product(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = torch.randn(rows, cols, generator=generator) * 0.2
        return quantized.pack(quantized.from_float(weight, "int4"))

    kinds = [model_ops.PRODUCT_OPS.index(name) for name in ("int4_matmul_a8", "int4_matmul")]
    angles = torch.rand(8, 8, generator=generator) * 20
    k_cache, v_cache = torch.randn(2, 65, 2, 16, generator=generator).to(dtype)
    return (
        torch.randn(8, 64, generator=generator).to(dtype),
        angles.cos(),
        angles.sin(),
        k_cache,
        v_cache,
        torch.from_numpy(cells),
        plan.cells,
        plan.rows,
        plan.positions,
        plan.cell_offsets,
        plan.block_starts,
        plan.num_tokens,
        0,
        (torch.rand(64, generator=generator) + 0.5).to(dtype),
        (torch.rand(64, generator=generator) + 0.5).to(dtype),
        1e-6,
        *product(128, 64),
        kinds[0],
        *product(64, 64),
        kinds[1],
        *product(128, 64),
        kinds[0],
        64,
        *product(64, 64),
        kinds[1],
        heads.num_heads,
        heads.num_kv_heads,
        heads.head_dim,
        heads.attention_scale,
        [],
    )


def op_cases(dtype: torch.dtype) -> dict[str, tuple]:
    generator = torch.Generator().manual_seed(3)
    q, k, v, cos, sin, cells, k_cache, v_cache = rope_inputs(dtype, torch.float32)
    return {
        "rms_norm": (
            torch.randn(5, 32, generator=generator).to(dtype),
            torch.ones(32, dtype=dtype),
            1e-6,
        ),
        "rope_store": (
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            cos,
            sin,
            cells,
            k_cache,
            v_cache,
        ),
        "silu_mul": (torch.randn(5, 48, generator=generator).to(dtype),),
        "cell_attention": attention_inputs(dtype),
        "int4_matmul": quantized_inputs("int4", dtype, generator),
        "int4_matmul_a8": quantized_inputs("int4", dtype, generator),
        "int8_matmul": quantized_inputs("int8", dtype, generator),
        "int8_matmul_a8": quantized_inputs("int8", dtype, generator, a8=True),
        "kquant_matmul_a8": kquant_inputs(dtype, generator),
        "kquant_rows": (*kquant_inputs(dtype, generator)[1:3], torch.tensor([19, 0, 3]), 256, 20),
        "decoder_layer": layer_inputs(dtype),
        "lora_add": lora_inputs(dtype),
        "argmax_rows": (torch.randn(3, 50, generator=generator).to(dtype),),
    }


def lora_inputs(dtype: torch.dtype) -> tuple:
    """lora_add's arguments: 4 rows of 64 into 48 outputs, rows 1 and 3 with a rank-4
    adapter on the first 16 outputs."""
    generator = torch.Generator().manual_seed(8)
    a, b = torch.randn(4, 64, generator=generator), torch.randn(4 * 16, generator=generator)
    return (
        torch.randn(4, 48, generator=generator).to(dtype),
        torch.randn(4, 64, generator=generator).to(dtype),
        torch.tensor([1, 3]),
        torch.tensor([0, 2]),
        [a.to(dtype), b.to(dtype), torch.tensor([[0, 4, 0, 16]]), torch.empty(0)],
    )


def quantized_inputs(
    fmt: str, dtype: torch.dtype, generator: torch.Generator, a8: bool = False
) -> tuple:
    """x [3, 5, 64] and a 20 x 64 weight in `fmt`'s panels (int8 for int8_matmul_a8: its own)."""
    weight = quantized.from_float(torch.randn(20, 64, generator=generator), fmt)
    packed = quantized.pack_a8(weight) if a8 else quantized.pack(weight)
    return (torch.randn(3, 5, 64, generator=generator).to(dtype), *packed, 20)


def kquant_inputs(dtype: torch.dtype, generator: torch.Generator) -> tuple:
    """x [3, 5, 256] and a 20 x 256 weight of Q4_K rows, then Q6_K ones (`kquants`)."""
    from tiny_models import K_QUANT_ENCODERS

    weight = torch.randn(20, 256, generator=generator).numpy() * 0.05
    parts = [
        kquants.from_blocks(K_QUANT_ENCODERS[kind](rows), kind)
        for kind, rows in (("Q4_K", weight[:16]), ("Q6_K", weight[16:]))
    ]
    packed = kquants.pack(kquants.KQuantWeight.cat(parts))
    return (torch.randn(3, 5, 256, generator=generator).to(dtype), *packed, 20)


@pytest.mark.parametrize("name", list(model_ops.SCHEMAS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_passes_for_each_op(table, name, dtype) -> None:
    """Schema (declared mutations), fake implementation and AOT tracing agree with the
    real op, for the compiled kernels and the torch implementations alike."""
    torch.library.opcheck(getattr(table, name), op_cases(dtype)[name])


def test_the_compiled_and_torch_attention_agree_through_the_op(compiled_ops, torch_ops) -> None:
    compiled_args, torch_args = attention_inputs(torch.float32), attention_inputs(torch.float32)
    compiled_ops.cell_attention(*compiled_args)
    torch_ops.cell_attention(*torch_args)
    assert compiled_args[-1][:6].abs().sum() > 0
    assert (compiled_args[-1] - torch_args[-1]).abs().max() < 1e-5


def test_torch_export_traces_the_ops(table) -> None:
    """Each op appears in an exported graph as itself, with the fake implementation's
    shapes, and the exported program runs it."""

    class Layer(torch.nn.Module):
        def forward(self, x, weight, gate_up, q, k, v, cos, sin, cells, k_cache, v_cache):
            table.rope_store(q, k, v, cos, sin, cells, k_cache, v_cache)
            return table.rms_norm(x, weight, 1e-6), table.silu_mul(gate_up), q * 1

    def layer_args() -> tuple:
        cases = op_cases(torch.float32)
        return (*cases["rms_norm"][:2], *cases["silu_mul"], *cases["rope_store"])

    exported = torch.export.export(Layer(), layer_args())
    namespace = model_ops.NAMESPACE if table.kind == "compiled" else model_ops.TORCH_NAMESPACE
    graph = str(exported.graph)
    for name in ("rms_norm", "silu_mul", "rope_store"):
        assert f"{namespace}.{name}" in graph, name
    for ours, eager in zip(exported.module()(*layer_args()), Layer()(*layer_args()), strict=True):
        assert torch.equal(ours, eager)


def test_the_compiled_and_torch_layers_agree_and_leave_padding_out(compiled_ops, torch_ops) -> None:
    """decoder_layer: the compiled op (each step through the dispatcher) and the torch one
    (the torch implementations of the same steps) agree to the steps' rounding, store
    only the 6 real tokens' K/V, and give padding rows finite values."""
    compiled_args, torch_args = layer_inputs(torch.float32), layer_inputs(torch.float32)
    before = compiled_args[3].clone()
    compiled = compiled_ops.decoder_layer(*compiled_args)
    reference = torch_ops.decoder_layer(*torch_args)
    assert compiled.shape == (8, 64) and compiled.isfinite().all()
    assert (compiled - reference).abs().max() < 1e-4
    written = (compiled_args[3] != before).flatten(1).any(1).nonzero().flatten()
    assert sorted(written.tolist()) == sorted(compiled_args[5].tolist())
    with pytest.raises(RuntimeError, match="product kind 7"):
        compiled_ops.decoder_layer(*compiled_args[:18], 7, *compiled_args[19:])


# -- a whole model ---------------------------------------------------------------------


def test_a_model_gives_the_same_tokens_with_compiled_and_torch_ops(
    compiled_ops, tiny_checkpoint, packed_steps
) -> None:
    _, folder = tiny_checkpoint("qwen3")
    steps = [[(0, [5, 17, 33, 2, 61]), (1, [9, 40, 12])], [(1, [70]), (0, [4])]]
    logits = {}
    for choice in ("compiled", "torch"):
        _, model = load_model(folder, "float32", choice)
        assert model.ops.kind == choice
        logits[choice] = torch.cat(packed_steps(model, steps, 2))
    assert (logits["compiled"] - logits["torch"]).abs().max() < 1e-4
    assert torch.equal(logits["compiled"].argmax(-1), logits["torch"].argmax(-1))


# -- which library loads, and the choice of kernels ---------------------------------------


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path: Path) -> Path:
    """kernels.load() as in a new process, looking for its library in tmp_path."""
    monkeypatch.delenv("CELLBATCH_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "LIBRARY", tmp_path / "_C.so")
    monkeypatch.setattr(kernels, "BUILD_INFO", tmp_path / "_C.json")
    return tmp_path


def test_a_missing_library_means_torch_ops_and_one_warning(fresh_loader, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="cellbatch.model.kernels"):
        assert model_ops.resolve("auto", "cpu").kind == "torch"
        assert not kernels.load()
    assert "not built when cellbatch was installed" in kernels.unavailable_reason()
    assert len(caplog.records) == 1
    assert "pure-torch ops" in caplog.text and "--no-build-isolation" in caplog.text
    with pytest.raises(InvalidArgumentError, match=r"not built.*kernels='torch'"):
        model_ops.resolve("compiled", "cpu")


HERE = torch.backends.cpu.get_cpu_capability()


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        ({"capability": "AVX1024", "torch": torch.__version__}, "built for AVX1024 but torch runs"),
        ({"capability": HERE, "torch": "1.0.0"}, "built against torch 1.0.0"),
        ({"capability": HERE, "torch": torch.__version__, "sources": "0" * 64}, "sources changed"),
        ({"torch": torch.__version__}, "does not say what _C.so was built for"),
    ],
    ids=["another-cpu", "another-torch", "stale-sources", "no-build-info"],
)
def test_a_library_built_for_something_else_is_refused_before_it_is_opened(
    fresh_loader, caplog, build, reason
) -> None:
    """The library here is not one at all: opening it would fail with another reason."""
    (fresh_loader / "_C.so").write_bytes(b"not a shared library")
    (fresh_loader / "kernel.cpp").write_text("// the sources of a checkout\n")
    (fresh_loader / "_C.json").write_text(json.dumps({"sources": "", **build}))
    with caplog.at_level(logging.WARNING, logger="cellbatch.model.kernels"):
        assert not kernels.load()
    assert reason in kernels.unavailable_reason()
    assert len(caplog.records) == 1 and reason in caplog.text


def test_a_library_that_does_not_load_is_refused_with_the_loader_error(fresh_loader) -> None:
    files = [fresh_loader / "kernel.cpp"]
    files[0].write_text("// the sources of a checkout\n")
    (fresh_loader / "_C.so").write_bytes(b"not a shared library")
    build = {"capability": HERE, "torch": torch.__version__, "sources": kernels._digest(files)}
    (fresh_loader / "_C.json").write_text(json.dumps(build))
    assert not kernels.load()
    assert "_C.so does not load" in kernels.unavailable_reason()


def test_kernels_switched_off_mean_torch_ops_without_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setenv("CELLBATCH_KERNELS", "0")
    monkeypatch.setattr(kernels, "_state", {})
    with caplog.at_level(logging.WARNING, logger="cellbatch.model.kernels"):
        assert not kernels.load()
    assert not caplog.records
    assert "CELLBATCH_KERNELS=0" in kernels.unavailable_reason()
    assert model_ops.resolve("auto", "cpu").kind == "torch"
    assert model_ops.resolve("torch", "cpu").kind == "torch"
    with pytest.raises(InvalidArgumentError, match=r"CELLBATCH_KERNELS=0.*kernels='torch'"):
        model_ops.resolve("compiled", "cpu")


def test_the_torch_choice_never_loads_the_library(fresh_loader) -> None:
    assert model_ops.resolve("torch", "cpu").kind == "torch"
    assert "loaded" not in kernels._state


def test_unknown_or_misplaced_kernel_choices_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown kernels 'flash'"):
        model_ops.resolve("flash", "cpu")
    with pytest.raises(InvalidArgumentError, match="CPU only"):
        model_ops.resolve("compiled", "cuda")
    assert model_ops.resolve("auto", "cuda").kind == "torch"
