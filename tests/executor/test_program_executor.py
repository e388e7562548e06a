"""ProgramExecutor's mapping of packed steps onto methods, without compiling anything: a
stand-in program whose methods run the eager model on exactly the inputs a compiled method
would get (and check them against the method's declared sizes, as AOTInductor does).

Tokens must equal ModuleExecutor's for every kind of step (prompt slices below the prefill
bound as decode rows, decodes alone at each width with padding, mixes on prefill, a step
cut into two forwards, a rewind), greedy and seeded; and limits the program cannot hold
are refused with the numbers.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from cellbatch.cache import FlatAttentionPlan
from cellbatch.executor.cell_executor import ExecutorShape
from cellbatch.executor.module_executor import ModuleExecutor
from cellbatch.executor.program_executor import ProgramExecutor
from cellbatch.export.manifest import (
    DECODE,
    FORMAT_VERSION,
    LOGITS_MODE,
    METHOD_INPUTS,
    PREFILL,
    Manifest,
    MethodSpec,
)
from cellbatch.export.program import Program
from cellbatch.kv_pool import SCRATCH_CELL
from cellbatch.model.attention import QUERY_BLOCK
from cellbatch.model.config import ModelConfig
from cellbatch.model.transformer import PackedTransformer
from cellbatch.types import InvalidArgumentError
from program_steps import (
    DECODE_WIDTHS,
    GREEDY,
    MAX_STEP,
    MIN_PREFILL,
    SCENARIO_SHAPE,
    SEEDED,
    run_scenario,
)
from scripted_drafter import ScriptedDrafter, decode_run

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attention_bias=False,
    attention_out_bias=False,
    qk_norm=False,
    layer_windows=(None, 8),  # one full and one sliding-window layer
    bos_token_id=None,
    eos_token_ids=(),
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> PackedTransformer:
    torch.manual_seed(0)
    module = PackedTransformer(CONFIG)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.3)
    module.pack_linears()
    return module.eval()


class StandIn:
    """A method that runs the eager model, refusing inputs its compiled twin would."""

    def __init__(self, spec: MethodSpec, model: PackedTransformer, calls: list[str]) -> None:
        self.spec, self.model, self.calls = spec, model, calls

    def __call__(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        layers = CONFIG.num_layers
        assert len(inputs) == len(METHOD_INPUTS) + 2 * layers
        tokens, positions, cells, a_cells, rows, a_pos, offsets, blocks, logit_rows = inputs[:9]
        count = tokens.shape[0]
        assert self.spec.min_tokens <= count <= self.spec.max_tokens
        assert all(t.shape[0] == count for t in (positions, cells, rows, a_pos, offsets))
        assert a_cells.shape[0] >= 2 and blocks.shape[0] >= 2 and logit_rows.shape[0] >= 2
        if self.spec.static:
            assert logit_rows.shape[0] == max(count, 2)
        assert sorted(rows.tolist()) == list(range(count))  # every row is one query
        self.calls.append(self.spec.name)
        flat = FlatAttentionPlan(a_cells, rows, a_pos, offsets, blocks, count)
        k, v = inputs[9 : 9 + layers], inputs[9 + layers :]
        return self.model.forward_flat(tokens, positions, cells, flat, k, v, logit_rows)


def stand_in_program(
    model: PackedTransformer,
    calls: list[str],
    widths: tuple[int, ...] = DECODE_WIDTHS,
    min_prefill: int = MIN_PREFILL,
    max_positions: int = 256,
) -> Program:
    methods = [MethodSpec(PREFILL, PREFILL, min_prefill, MAX_STEP)] + [
        MethodSpec(f"{DECODE}_{w}", DECODE, w, w) for w in widths
    ]
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        cellbatch_version="test",
        torch_version=torch.__version__,
        cpu_capability="DEFAULT",
        model=dataclasses.replace(CONFIG.geometry, max_positions=max_positions, eos_token_ids=()),
        dtype="float32",
        kv_dtype="float32",
        methods=methods,
        min_prefill_tokens=min_prefill,
        max_step_tokens=MAX_STEP,
        max_pool_rows=1 << 20,
        query_block=QUERY_BLOCK,
        logits=LOGITS_MODE,
        stop_tokens=[],
        source={},
        constants={},
        custom_ops={},
        kernel_library="none",
    )
    manifest.check()
    stand_ins = {spec.name: StandIn(spec, model, calls) for spec in methods}
    return Program(Path("stand-in.pt2"), manifest, stand_ins, {}, 0, 0.0)


def executors(model: PackedTransformer, calls: list[str], **program: object):
    module = ModuleExecutor(model, CONFIG, SCENARIO_SHAPE)
    module.initialize()
    executor = ProgramExecutor(stand_in_program(model, calls, **program), SCENARIO_SHAPE)
    executor.initialize()
    return module, executor


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_every_kind_of_step_gives_the_module_executors_tokens(model, sampling) -> None:
    calls: list[str] = []
    module, program = executors(model, calls)
    expected = run_scenario(module, CONFIG.vocab_size, sampling)
    assert run_scenario(program, CONFIG.vocab_size, sampling) == expected
    assert set(calls) == {"prefill", "decode_1", "decode_2", "decode_4", "decode_8"}
    assert all(len(tokens) >= 5 for tokens in expected)


def test_without_narrow_widths_rows_pad_to_the_one_width(model) -> None:
    calls: list[str] = []
    module, program = executors(model, calls, widths=(8,), min_prefill=2)
    expected = run_scenario(module, CONFIG.vocab_size, GREEDY)
    assert run_scenario(program, CONFIG.vocab_size, GREEDY) == expected
    assert set(calls) == {"prefill", "decode_8"}


def test_the_step_plan_cuts_steps_onto_methods(model) -> None:
    _, program = executors(model, [])
    plan = [(offset, length, method.name) for offset, length, method in program.calls(8)]
    assert plan == [(0, 8, "decode_8")]
    plan = [(offset, length, method.name) for offset, length, method in program.calls(3)]
    assert plan == [(0, 3, "decode_4")]
    plan = [(offset, length, method.name) for offset, length, method in program.calls(65)]
    assert plan == [(0, 56, "prefill"), (56, 9, "prefill")]
    _, narrow = executors(model, [], widths=(1, 2), min_prefill=9)
    plan = [(offset, length, method.name) for offset, length, method in narrow.calls(7)]
    assert plan == [(0, 2, "decode_2"), (2, 2, "decode_2"), (4, 2, "decode_2"), (6, 1, "decode_1")]


def test_padding_rows_write_only_the_scratch_cell(model) -> None:
    _, program = executors(model, [])
    run_scenario(program, CONFIG.vocab_size, GREEDY)
    live = program.cache.high_water()
    before = [k[live:].clone() for k in program.pool.k]
    assert all(torch.count_nonzero(rows) == 0 for rows in before)  # never written
    assert torch.count_nonzero(program.pool.k[0][SCRATCH_CELL]) > 0  # padding wrote here


@pytest.mark.parametrize(
    ("shape", "problem"),
    [
        (ExecutorShape(max_session_tokens=300), "max_session_tokens=300 is above the 256"),
        (ExecutorShape(max_batch_tokens=65), "max_batch_tokens=65 is above its widest method"),
        (ExecutorShape(kv_dtype=torch.bfloat16), "its KV cache is float32, not bfloat16"),
        (ExecutorShape(max_cells=1 << 20), "max_cells=1048576 (+ the scratch row) is above"),
    ],
)
def test_limits_the_program_cannot_hold_are_refused(model, shape, problem) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(problem)):
        ProgramExecutor(stand_in_program(model, []), shape)


def test_runs_without_model_code_in_a_fresh_process() -> None:
    """Importing the executor (and the program reader) loads nothing of cellbatch.model."""
    import subprocess
    import sys

    code = (
        "import sys, cellbatch.executor.program_executor, cellbatch.export.program\n"
        "print(sorted(m for m in sys.modules if m.startswith('cellbatch.model')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("min_prefill", [MIN_PREFILL, 16])
def test_verified_drafts_give_the_module_executors_tokens(model, min_prefill: int) -> None:
    """Verified runs on the program's methods (on prefill, or as decode rows: one
    session's run in one call or cut across two) keep exactly the tokens one-at-a-time
    decoding draws."""
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    module = ModuleExecutor(model, CONFIG, SCENARIO_SHAPE)
    module.initialize()
    expected = decode_run(module, prompts, 30, 0)
    calls: list[str] = []
    drafter = ScriptedDrafter(dict(enumerate(expected)))  # a fresh table's sessions: 0, 1, 2
    program = ProgramExecutor(
        stand_in_program(model, calls, min_prefill=min_prefill), SCENARIO_SHAPE, drafter=drafter
    )
    program.initialize()
    got = decode_run(program, prompts, 8, 3)
    assert drafter.proposed > 0
    for prompt, tokens, want in zip(prompts, got, expected, strict=True):
        assert tokens == want[: len(tokens)]
        assert len(tokens) - len(prompt) > 8  # more than a token a step: drafts were kept
    assert ("decode_8" in calls) == (min_prefill == 16)
