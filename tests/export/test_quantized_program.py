"""A program with quantised weights (`cellbatch export --quantize int4`).

A tiny random Llama exported with int4 projections (int8 embedding and head, as the eager
model takes them) and decode widths 1 and 8 (about 40 s of compiling on 2 cores): the
program's steps give the eager quantised model's tokens for every kind of step, its
manifest says which weight format it holds, the Engine reports it, and a `quantize` that
contradicts it is refused. The same in bf16 with the int8 KV cache (the default dtype on
CPUs with native bf16, with int8 activations where the CPU has VNNI; about 40 s more):
every logit the program samples from is the eager model's, bit for bit. On CPUs where
`auto` gives a float32 model int8 inputs (AVX2), the float32 program takes them too.
"""

from __future__ import annotations

import dataclasses
import zipfile
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from cellbatch.engine import Engine
from cellbatch.executor.module_executor import ModuleExecutor
from cellbatch.executor.program_executor import ProgramExecutor
from cellbatch.export.exporter import ExportOptions, export_program
from cellbatch.export.program import load_program
from cellbatch.model.loading import load_model
from cellbatch.model.quantized import a8_products, resolve_activations
from cellbatch.model.weights_summary import describe
from cellbatch.types import InvalidArgumentError
from program_steps import GREEDY, MAX_STEP, MIN_PREFILL, SCENARIO_SHAPE, SEEDED, run_scenario
from tiny_models import make_tiny_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("quantized-llama")
    make_tiny_checkpoint(
        "llama",
        folder,
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return folder


def export_int4(
    checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
    dtype: str,
    kv_dtype: str | None = None,
) -> Path:
    """The checkpoint as an int4 program in `dtype`, decode widths 1 and 8."""
    path = tmp_path_factory.mktemp("program") / f"int4-{dtype}.pt2"
    options = ExportOptions(
        dtype=dtype,
        kv_dtype=kv_dtype,
        quantize="int4",
        max_step_tokens=MAX_STEP,
        decode_widths=(1, 8),
        min_prefill_tokens=MIN_PREFILL,
    )
    export_program(checkpoint, path, options)
    return path


@pytest.fixture(scope="module")
def program(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_int4(checkpoint, tmp_path_factory, "float32")


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_program_gives_the_eager_quantised_models_tokens(
    checkpoint: Path, program: Path, sampling
) -> None:
    config, model = load_model(checkpoint, "float32", "compiled", quantize="int4")
    eager = ModuleExecutor(model, config, SCENARIO_SHAPE)
    eager.initialize()
    compiled = ProgramExecutor(load_program(program), SCENARIO_SHAPE)
    compiled.initialize()
    assert run_scenario(compiled, VOCAB, sampling) == run_scenario(eager, VOCAB, sampling)


@pytest.fixture(scope="module")
def bf16_program(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bf16 with the int8 KV cache (the default model's slow test exports a bf16 one)."""
    return export_int4(checkpoint, tmp_path_factory, "bfloat16", kv_dtype="int8")


def sampled_logits(executor: ModuleExecutor | ProgramExecutor) -> dict[int, list[torch.Tensor]]:
    """The scenario's logits rows that each session sampled from, in order."""
    seen: dict[int, list[torch.Tensor]] = defaultdict(list)
    sample = executor.table.sample

    def recording(sids, rows, drafts=None):
        assert drafts is None  # the scenario does not speculate: one row per session
        for sid, row in zip(sids, rows, strict=True):
            seen[sid].append(row.clone())
        return sample(sids, rows, drafts)

    executor.table.sample = recording  # type: ignore[method-assign]
    run_scenario(executor, VOCAB, GREEDY)
    return seen


def test_a_bf16_program_gives_the_eager_models_logits_bit_for_bit(
    checkpoint: Path, bf16_program: Path
) -> None:
    """bf16 rounds each step's result: the program's fused elementwise code must too (a
    residual add fused with the next one in float32 moved greedy tokens of the default
    model from the first, and made a row depend on which method ran it). Its int8 KV
    cache is the eager model's, quantised by the same kernels."""
    assert load_program(bf16_program).kv_dtype == torch.int8
    shape = dataclasses.replace(SCENARIO_SHAPE, kv_dtype=torch.int8)
    config, model = load_model(checkpoint, "bfloat16", "compiled", quantize="int4")
    eager = ModuleExecutor(model, config, shape)
    eager.initialize()
    compiled = ProgramExecutor(load_program(bf16_program), shape)
    compiled.initialize()
    got, expected = sampled_logits(compiled), sampled_logits(eager)
    assert got.keys() == expected.keys()
    for sid, rows in expected.items():
        assert len(got[sid]) == len(rows)
        for step, (ours, theirs) in enumerate(zip(got[sid], rows, strict=True)):
            assert torch.equal(ours, theirs), (sid, step)


def test_the_manifest_and_the_engine_say_which_weights_run(checkpoint: Path, program: Path) -> None:
    manifest = load_program(program).manifest
    assert manifest.weight_formats == {
        "projections": "int4",
        "embedding": "int8",
        "lm_head": "int8",
    }
    assert manifest.weight_kernel == "compiled"
    # Where `auto` gives a float32 model int8 inputs (AVX2 CPUs), gate_up and the head
    # take them: the program calls the int8-input products for those.
    a8 = resolve_activations("auto", "compiled", torch.float32) == "int8"
    assert not a8 or a8_products(torch.float32) == ("gate_up", "lm_head")
    products = (
        ("int4_matmul", "int4_matmul_a8", "int8_matmul_a8")
        if a8
        else ("int4_matmul", "int8_matmul")
    )
    ops = ("cell_attention", *products, "rms_norm", "rope_store", "silu_mul")
    # Every custom op the methods call goes straight to the kernels' C entry point.
    assert manifest.c_shims == [f"aoti_torch_cpu_{op}" for op in ops]
    assert {name.removeprefix("cellbatch::") for name in manifest.custom_ops} == set(ops)
    with zipfile.ZipFile(program) as archive:
        methods = [archive.read(n) for n in archive.namelist() if n.endswith(".wrapper.so")]
    assert len(methods) == len(manifest.methods)
    for code in methods:
        assert all(f"aoti_torch_cpu_{op}".encode() in code for op in ops)
        assert b"aoti_torch_proxy_executor_call_function" not in code
    _, model = load_model(checkpoint, "float32", "compiled", quantize="int4")
    assert manifest.weight_bytes_by_format == describe(model).bytes_by_format
    with Engine.from_pretrained(program, max_sessions=2) as engine:
        inputs = " (gate_up, lm_head with int8 activations)" if a8 else ""
        assert engine.weight_format == "int4, embedding int8, lm_head int8" + inputs
        assert engine.weights.bytes_by_format == manifest.weight_bytes_by_format
        # The program stores the quantised weights once, and no float copy of them: all it
        # holds besides them is the RoPE tables.
        rope = model.rope_cos.nbytes + model.rope_sin.nbytes
        assert engine.weights_bytes == sum(manifest.weight_bytes_by_format.values()) + rope
        [result] = engine.generate([[1, 2, 3]], max_new_tokens=4)
        assert result.ok and result.tokens


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_quantize_the_program_does_not_hold_is_refused(program: Path, quantize: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"holds int4 weights.*export --quantize"):
        Engine.from_pretrained(program, quantize=quantize)
    Engine.from_pretrained(program, quantize="int4", max_sessions=1).close()
