"""CudaExecutor on the CPU (docs/design.md#the-cuda-executor): decode widths with padding
rows on the scratch cell, graphs captured once per shape and replayed (through the CPU
stand-in, `RecordedCapture`, which replays a record of the forward's operations as a
CUDA graph replays its kernels), recaptures after pool growth, the prefill lower bound,
weight sharing, and tokens against the module executor.

The reference is a ModuleExecutor over a copy of the same weights with the torch ops:
the CudaExecutor's attention (SDPA over gathered cells, or FlexAttention over the pool)
rounds differently from the module's, so logits are compared with a tolerance and
tokens exactly (the weights are drawn so that greedy picks are far from ties).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from cellbatch.executor.cell_executor import CellExecutor, ExecutorShape
from cellbatch.executor.cuda_executor import CudaExecutor, CudaOptions, default_widths
from cellbatch.executor.graphs import RecordedCapture
from cellbatch.executor.module_executor import ModuleExecutor
from cellbatch.generation_config import SamplingParams
from cellbatch.kv_pool import SCRATCH_CELL
from cellbatch.model.config import ModelConfig
from cellbatch.model.transformer import PackedTransformer
from cellbatch.types import BatchInput, Input, InvalidArgumentError, SessionId
from scripted_drafter import ScriptedDrafter, decode_run

VOCAB = 64
CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    attention_bias=False,
    attention_out_bias=False,
    qk_norm=False,
    layer_windows=(None, 8),  # one full and one sliding-window layer
    bos_token_id=None,
    eos_token_ids=(),
)
SHAPE = ExecutorShape(max_sessions=8, max_session_tokens=256, max_cells=2048, max_batch_tokens=64)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def weights() -> PackedTransformer:
    torch.manual_seed(0)
    module = PackedTransformer(CONFIG, kernels="torch")
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.3)  # peaked logits: greedy picks are far from ties
    return module.eval()


def cuda_executor(
    weights: PackedTransformer,
    capture: RecordedCapture | None = None,
    shape: ExecutorShape = SHAPE,
    **options: object,
) -> CudaExecutor:
    executor = CudaExecutor(
        copy.deepcopy(weights),
        CONFIG,
        shape,
        CudaOptions(cuda_graph=capture is not None, **options),  # type: ignore[arg-type]
        capture=capture,
    )
    executor.initialize()
    return executor


def module_executor(weights: PackedTransformer, shape: ExecutorShape = SHAPE) -> ModuleExecutor:
    executor = ModuleExecutor(copy.deepcopy(weights), CONFIG, shape)
    executor.initialize()
    return executor


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def step(executor: CellExecutor, inputs: Sequence[Input]) -> list[tuple[int, ...] | None]:
    out = executor.execute(BatchInput(tuple(inputs)))
    return [None if o is None else o.tokens for o in out.outputs]


def staggered(
    executor: CellExecutor,
    batch_prompts: Sequence[list[int]],
    steps: int,
    sampling: tuple[SamplingParams, int] | None = None,
) -> list[list[int]]:
    """Sessions joining one per step (so the decode rows' mix changes every step), then
    `steps` decodes each; every session's tokens."""
    sids: list[SessionId] = []
    tokens: list[list[int]] = []
    pending = list(batch_prompts)
    while pending or any(len(t) < steps for t in tokens):
        inputs = [
            Input(sid, True, 0, 1, [row[-1]], executor.position(sid))
            for sid, row in zip(sids, tokens, strict=True)
            if len(row) < steps
        ]
        live = [i for i, row in enumerate(tokens) if len(row) < steps]
        if pending:
            prompt = pending.pop(0)
            sid = executor.open_session()
            if sampling is not None:
                executor.set_sampling(sid, *sampling)
            sids.append(sid)
            tokens.append([])
            live.append(len(tokens) - 1)
            inputs.append(Input(sid, True, 0, len(prompt), prompt, 0))
        for index, out in zip(live, step(executor, inputs), strict=True):
            assert out is not None
            tokens[index].append(out[0])
    return tokens


@pytest.mark.parametrize(
    "options",
    [{}, {"decode_widths": (4, 16), "min_prefill_tokens": 17}],
    ids=["verified-on-prefill", "verified-as-decode-rows"],
)
def test_verified_drafts_give_the_tokens_of_one_at_a_time_decoding(weights, options) -> None:
    """Drafts verified through the decode graphs (or the wide path) keep exactly the
    tokens that decoding one token a step gives, and more than one a step is kept."""
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    greedy = SamplingParams()
    expected = decode_run(
        cuda_executor(weights, RecordedCapture(), **options), prompts, 30, 0, greedy
    )
    drafter = ScriptedDrafter(dict(enumerate(expected)))  # a fresh table's sessions: 0, 1, 2
    executor = CudaExecutor(
        copy.deepcopy(weights),
        CONFIG,
        SHAPE,
        CudaOptions(**options),  # type: ignore[arg-type]
        capture=RecordedCapture(),
        drafter=drafter,
    )
    executor.initialize()
    got = decode_run(executor, prompts, 8, 3, greedy)
    assert drafter.proposed > 0
    for prompt, tokens, want in zip(prompts, got, expected, strict=True):
        assert tokens == want[: len(tokens)]
        assert len(tokens) - len(prompt) > 8  # more than a token a step: drafts were kept
    # Runs of 12 tokens take the wide path by default, decode_16's graph with its options.
    assert (executor.graphs.stats.replays > 0) == bool(options)


def test_default_widths_are_powers_of_two_up_to_the_decodes() -> None:
    assert default_widths(1) == (1,)
    assert default_widths(32) == (1, 2, 4, 8, 16, 32)
    assert default_widths(48) == (1, 2, 4, 8, 16, 32, 48)


def test_widths_derive_from_the_decodes_per_step_and_bound_prefill(weights) -> None:
    shape = ExecutorShape(max_sessions=64, max_batch_tokens=64, max_decode_sequences=12)
    executor = CudaExecutor(copy.deepcopy(weights), CONFIG, shape)
    assert executor.widths == (1, 2, 4, 8, 12)
    assert executor.min_prefill_tokens == 13
    with pytest.raises(InvalidArgumentError, match="below max_batch_tokens=64"):
        CudaExecutor(copy.deepcopy(weights), CONFIG, shape, CudaOptions(decode_widths=(8, 64)))
    with pytest.raises(InvalidArgumentError, match="unknown attention 'triton'"):
        CudaExecutor(copy.deepcopy(weights), CONFIG, shape, CudaOptions(attention="triton"))


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_tokens_match_the_module_executor(weights, attention) -> None:
    batch_prompts = prompts(5, 19, 11, 3, 27, seed=1)
    expected = staggered(module_executor(weights), batch_prompts, 8)
    executor = cuda_executor(weights, RecordedCapture(), attention=attention)
    assert staggered(executor, batch_prompts, 8) == expected
    stats = executor.graphs.stats
    assert stats.captures >= 1 and stats.replays > stats.captures and stats.eager_runs == 0


def test_graph_replay_equals_eager_bit_for_bit(weights) -> None:
    """Logprobs carry the logits' bits: a replayed graph and the eager run of the same
    padded shapes give the same ones."""
    sampling = (SamplingParams(temperature=0.0, logprobs=3), 0)
    batch_prompts = prompts(6, 14, 9, 21, seed=2)
    runs = []
    for capture in (RecordedCapture(), None):
        executor = cuda_executor(weights, capture)
        sids = [executor.open_session() for _ in batch_prompts]
        for sid in sids:
            executor.set_sampling(sid, *sampling)
        outs = executor.execute(
            BatchInput(
                tuple(
                    Input(s, True, 0, len(p), p, 0)
                    for s, p in zip(sids, batch_prompts, strict=True)
                )
            )
        ).outputs
        seen = [[(o.tokens, o.logprobs)] for o in outs]  # type: ignore[union-attr]
        for _ in range(6):
            inputs = tuple(
                Input(s, True, 0, 1, [row[-1][0][0]], executor.position(s))
                for s, row in zip(sids, seen, strict=True)
            )
            for row, out in zip(seen, executor.execute(BatchInput(inputs)).outputs, strict=True):
                row.append((out.tokens, out.logprobs))  # type: ignore[union-attr]
        runs.append(seen)
    assert runs[0] == runs[1]


def test_one_graph_per_shape_replayed_for_any_mix_of_sessions(weights) -> None:
    capture = RecordedCapture()
    executor = cuda_executor(weights, capture)
    staggered(executor, prompts(4, 6, 5, 7, 3, seed=3), 6)
    stats = executor.graphs.stats
    keys = executor.graphs.captured_keys()
    # Widths 1..8 and one key bucket (contexts below 64): each shape captured once.
    assert {key[1] for key in keys} == {64}
    assert stats.captures == len(keys) == capture.captured
    assert stats.recaptures == 0 and stats.invalidations == 0
    assert all(width in executor.widths for width, _ in keys)
    assert stats.replays > 2 * stats.captures


def test_pool_growth_drops_every_graph_and_recaptures_them(weights) -> None:
    executor = cuda_executor(weights, RecordedCapture())
    first, second = prompts(10, 10, seed=4)
    a, b = executor.open_session(), executor.open_session()
    out = step(executor, [Input(a, True, 0, 10, first, 0), Input(b, True, 0, 10, second, 0)])
    for _ in range(3):
        out = step(
            executor,
            [
                Input(sid, True, 0, 1, [o[0]], executor.position(sid))  # type: ignore[index]
                for sid, o in zip((a, b), out, strict=True)
            ],
        )
    assert executor.graphs.stats.captures == 1 and executor.pool.rows == 256
    # A long prompt takes the pool past its 256 rows: it grows, and the graphs read the
    # tensors it replaced.
    c = executor.open_session()
    long_prompt = prompts(250, seed=5)[0]
    for start in range(0, 250, 50):
        step(executor, [Input(c, False, start, 50, long_prompt, 0)])
    assert executor.pool.growth_count == 1
    step(
        executor,
        [
            Input(sid, True, 0, 1, [o[0]], executor.position(sid))  # type: ignore[index]
            for sid, o in zip((a, b), out, strict=True)
        ],
    )
    stats = executor.graphs.stats
    assert stats.invalidations == 1 and stats.recaptures == 1 and stats.captures == 2
    assert executor.stats()["pool_growths"] == 1


def test_padding_rows_write_only_the_scratch_cell(weights) -> None:
    executor = cuda_executor(weights, RecordedCapture())
    sids = [executor.open_session() for _ in range(3)]
    batch = prompts(4, 5, 6, seed=6)
    out = step(
        executor, [Input(s, True, 0, len(p), p, 0) for s, p in zip(sids, batch, strict=True)]
    )
    pool = executor.pool
    before = [k.clone() for k in pool.k]
    used = executor.cache.high_water()
    # Three decodes run as rows of width 4: one padding row.
    step(
        executor,
        [
            Input(s, True, 0, 1, [o[0]], executor.position(s))  # type: ignore[index]
            for s, o in zip(sids, out, strict=True)
        ],
    )
    assert executor.graphs.captured_keys() == [(4, 64)]
    new_cells = set(range(used, executor.cache.high_water()))
    assert len(new_cells) == 3
    for old, new in zip(before, pool.k, strict=True):
        changed = set(torch.nonzero((old != new).any(dim=(1, 2))).reshape(-1).tolist())
        assert changed - new_cells <= {SCRATCH_CELL}
        assert SCRATCH_CELL in changed  # the padding row wrote it
    buffers = executor._buffers[(4, 64)]
    assert buffers.cells[3].item() == SCRATCH_CELL and buffers.tokens[3].item() == 0
    assert (buffers.table[3] == SCRATCH_CELL).all()


def test_short_prompts_run_as_decode_rows_and_long_ones_eagerly(weights) -> None:
    shape = ExecutorShape(max_sessions=8, max_cells=2048, max_batch_tokens=64)
    executor = cuda_executor(weights, RecordedCapture(), shape, decode_widths=(1, 8))
    assert executor.min_prefill_tokens == 9
    a = executor.open_session()
    short, long = prompts(7, 20, seed=7)
    step(executor, [Input(a, True, 0, 7, short, 0)])  # below the bound: rows of width 8
    assert executor.graphs.captured_keys() == [(8, 64)]
    b = executor.open_session()
    replays = executor.graphs.stats.replays
    step(executor, [Input(b, True, 0, 20, long, 0)])  # at least the bound: prefill, eager
    assert executor.graphs.stats.replays == replays
    expected = staggered(module_executor(weights, shape), [short, long], 1)
    assert staggered(cuda_executor(weights, RecordedCapture(), shape, decode_widths=(1, 8)),
                     [short, long], 1) == expected  # fmt: skip


def test_without_weight_sharing_each_method_holds_a_copy(weights) -> None:
    batch_prompts = prompts(12, 3, 20, seed=8)
    shared = cuda_executor(weights, RecordedCapture())
    own = cuda_executor(weights, RecordedCapture(), weight_sharing=False)
    assert staggered(own, batch_prompts, 5) == staggered(shared, batch_prompts, 5)
    assert shared.stats()["weight_copies"] == 1
    methods = {f"decode_{width}" for width, _ in own.graphs.captured_keys()} | {"prefill"}
    assert own.stats()["weight_copies"] == 1 + len(methods)


def test_device_sampling_draws_what_the_host_sampler_draws(weights) -> None:
    """The same seeded policies, sampled where the logits are and from a host copy, and
    by the module executor (the host sampler of the CPU engine)."""
    batch_prompts = prompts(5, 9, 13, 7, seed=9)
    sampling = (SamplingParams(temperature=0.9, top_p=0.9, top_k=20), 1234)
    on_device = staggered(cuda_executor(weights, RecordedCapture()), batch_prompts, 10, sampling)
    on_host = staggered(
        cuda_executor(weights, RecordedCapture(), sample_on_host=True), batch_prompts, 10, sampling
    )
    module = staggered(module_executor(weights), batch_prompts, 10, sampling)
    assert on_device == on_host == module


@pytest.mark.parametrize("length", [5, 30], ids=["as-decode-rows", "eager-prefill"])
def test_pooling_sessions_get_the_module_executors_vectors(weights, length) -> None:
    """An embedding's slice runs eagerly with its hidden states, whichever path its length
    would take, beside a generation whose tokens stay the module executor's."""
    shape = ExecutorShape(max_sessions=8, max_cells=2048, max_batch_tokens=64)
    prompt, other = prompts(length, 2, seed=11)  # 5 + 2 tokens: below the bound of 9

    def run(executor: CellExecutor) -> tuple[tuple[float, ...], tuple[int, ...]]:
        pooled, generating = executor.open_session(), executor.open_session()
        assert pooled is not None and generating is not None
        executor.set_sampling(pooled, SamplingParams(pooling="mean"), None)
        out = executor.execute(
            BatchInput(
                (Input(pooled, True, 0, length, prompt, 0), Input(generating, True, 0, 2, other, 0))
            )
        ).outputs
        assert out[0] is not None and out[0].embedding is not None and not out[0].tokens
        assert out[1] is not None and out[1].embedding is None
        return out[0].embedding, out[1].tokens

    expected_vector, expected_tokens = run(module_executor(weights, shape))
    executor = cuda_executor(weights, RecordedCapture(), shape, decode_widths=(1, 8))
    vector, tokens = run(executor)
    assert tokens == expected_tokens and executor.graphs.stats.replays == 0
    np.testing.assert_allclose(vector, expected_vector, rtol=1e-4, atol=1e-5)
