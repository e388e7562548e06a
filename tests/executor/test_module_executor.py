"""ModuleExecutor on a tiny random PackedTransformer (docs/design.md#executors): which
inputs get outputs, refused batches, running out of cells, slicing and rewinds, and
seeded sampling that does not depend on the batch.

A session's reference tokens come from the same executor class running that session
alone, one input per step, so each test compares packing against no packing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from cellbatch.executor.module_executor import ExecutorShape, ModuleExecutor
from cellbatch.generation_config import SamplingParams
from cellbatch.model.config import ModelConfig
from cellbatch.model.transformer import PackedTransformer
from cellbatch.types import (
    BatchInput,
    Input,
    InvalidArgumentError,
    OutOfResourcesError,
    Output,
    SessionId,
)

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
                param.normal_(0.0, 0.3)  # peaked logits: greedy picks are far from ties
    return module.eval()


def make_executor(model: PackedTransformer, **shape: object) -> ModuleExecutor:
    executor = ModuleExecutor(model, CONFIG, ExecutorShape(**shape))
    executor.initialize()
    return executor


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def prompt_input(sid: SessionId, tokens: Sequence[int], produce: bool = True) -> Input:
    return Input(sid, produce, 0, len(tokens), list(tokens), 0)


def decode_input(executor: ModuleExecutor, sid: SessionId, token: int) -> Input:
    return Input(sid, True, 0, 1, [token], executor.position(sid))


def run(executor: ModuleExecutor, inputs: Sequence[Input]) -> list[tuple[int, ...] | None]:
    out = executor.execute(BatchInput(tuple(inputs)))
    assert out is not None
    assert len(out.outputs) == len(inputs)
    for item, output in zip(inputs, out.outputs, strict=True):
        assert output is None or output.sid == item.sid
    return [None if output is None else output.tokens for output in out.outputs]


def generate_alone(
    model: PackedTransformer,
    prompt: Sequence[int],
    steps: int,
    sampling: tuple[SamplingParams, int | None] | None = None,
) -> list[int]:
    """One session on its own executor: the prompt, then `steps` - 1 decodes."""
    executor = make_executor(model)
    sid = executor.open_session()
    if sampling is not None:
        executor.set_sampling(sid, *sampling)
    tokens = [run(executor, [prompt_input(sid, prompt)])[0][0]]
    while len(tokens) < steps:
        tokens.append(run(executor, [decode_input(executor, sid, tokens[-1])])[0][0])
    return tokens


def generate_together(
    executor: ModuleExecutor,
    sids: Sequence[SessionId],
    batch_prompts: Sequence[list[int]],
    steps: int,
) -> list[list[int]]:
    """Every session's prompt in one step, then every session decodes in each step."""
    first = run(executor, [prompt_input(s, p) for s, p in zip(sids, batch_prompts, strict=True)])
    tokens = [[out[0]] for out in first]
    for _ in range(steps - 1):
        step = run(
            executor, [decode_input(executor, s, t[-1]) for s, t in zip(sids, tokens, strict=True)]
        )
        for row, out in zip(tokens, step, strict=True):
            row.append(out[0])
    return tokens


def cache_state(executor: ModuleExecutor, sids: Sequence[SessionId]) -> tuple:
    cache = executor.cache
    return (
        cache.used_cells(),
        cache.free_cells(),
        cache.high_water(),
        tuple(executor.position(s) for s in sids),
        tuple(tuple(cache.seq_cells(executor.table.seq_of(s)).tolist()) for s in sids),
    )


# -- outputs ------------------------------------------------------------------------------


def test_outputs_answer_exactly_the_inputs_that_ask(model) -> None:
    executor = make_executor(model)
    a, b, c = (executor.open_session() for _ in range(3))
    pa, pb, pc = prompts(12, 5, 9)
    inputs = [
        Input(a, False, 0, 7, pa, 0),  # two chunks of one prompt: only the last answers
        Input(a, True, 7, 5, pa, 0),
        prompt_input(b, pb),
        prompt_input(c, pc, produce=False),
    ]
    got = run(executor, inputs)
    assert [out is None for out in got] == [not item.produce_output for item in inputs]
    assert got[1] == (generate_alone(model, pa, 1)[0],)
    assert got[2] == (generate_alone(model, pb, 1)[0],)
    assert [executor.position(s) for s in (a, b, c)] == [12, 5, 9]


def test_a_slice_without_outputs_still_runs(model) -> None:
    # max_batch_tokens=8 puts the first, silent, input in a slice of its own.
    executor = make_executor(model, max_batch_tokens=8)
    a, b = executor.open_session(), executor.open_session()
    pa, pb = prompts(8, 6, seed=1)
    got = run(executor, [prompt_input(a, pa, produce=False), prompt_input(b, pb)])
    assert got[0] is None and got[1] == (generate_alone(model, pb, 1)[0],)
    assert executor.position(a) == 8
    # a's K/V were written: its next chunk continues it as if the prompt were one.
    more = prompts(3, seed=2)[0]
    assert run(executor, [Input(a, True, 8, 3, pa + more, 0)]) == [
        (generate_alone(model, pa + more, 1)[0],)
    ]


def test_tokens_do_not_depend_on_slicing_or_batch_mates(model) -> None:
    batch_prompts = prompts(3, 17, 30, 9, 41, seed=3)
    expected = [generate_alone(model, p, 6) for p in batch_prompts]
    for max_batch_tokens in (7, 544):  # slices cut across inputs, or one forward
        executor = make_executor(model, max_batch_tokens=max_batch_tokens)
        sids = [executor.open_session() for _ in batch_prompts]
        assert generate_together(executor, sids, batch_prompts, 6) == expected


class RecordingModel(torch.nn.Module):
    """Passes every forward through to `model` and keeps the logits it returned."""

    def __init__(self, model: PackedTransformer) -> None:
        super().__init__()
        self.model = model
        self.logits: list[torch.Tensor] = []

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        self.logits.append(self.model(*args))
        return self.logits[-1]


def test_logits_are_bit_identical_whatever_shares_the_step(model) -> None:
    """Stronger than equal tokens: fp32 rounding must not depend on the batch either."""
    # One neighbour longer than a key block (64) pads its group's keys past the target's.
    target, *others = prompts(13, 2, 30, 7, 100, 5, 16, 3, 40, seed=10)

    def target_logits(before: Sequence[list[int]], after: Sequence[list[int]]) -> torch.Tensor:
        recorder = RecordingModel(model)
        executor = ModuleExecutor(recorder, CONFIG, ExecutorShape())
        executor.initialize()
        order = [*before, target, *after]
        sids = [executor.open_session() for _ in order]
        first = run(executor, [prompt_input(s, p) for s, p in zip(sids, order, strict=True)])
        decode = [decode_input(executor, s, out[0]) for s, out in zip(sids, first, strict=True)]
        run(executor, decode)
        # One forward per step, one logits row per input, in input order.
        return torch.stack([step[len(before)] for step in recorder.logits])

    alone = target_logits([], [])
    assert torch.equal(target_logits(others, []), alone)
    assert torch.equal(target_logits([], others), alone)
    assert torch.equal(target_logits(others[:3], others[3:]), alone)


def test_an_input_below_the_committed_length_rewinds_the_session(model) -> None:
    executor = make_executor(model)
    sid = executor.open_session()
    prompt, tail = prompts(10, 3, seed=4)
    run(executor, [prompt_input(sid, prompt)])
    got = run(executor, [Input(sid, True, 6, 3, prompt[:6] + tail, 0)])
    assert executor.position(sid) == 9
    assert got == [(generate_alone(model, prompt[:6] + tail, 1)[0],)]


def test_a_clone_shares_the_prefix_and_continues_like_a_fresh_session(model) -> None:
    executor = make_executor(model)
    source = executor.open_session()
    prompt = prompts(20, seed=5)[0]
    run(executor, [prompt_input(source, prompt)])
    used = executor.cache.used_cells()
    clone = executor.clone(source, 12)
    assert clone is not None and executor.position(clone) == 12
    assert executor.cache.used_cells() == used  # no K/V copied
    got = run(executor, [Input(clone, True, 12, 8, prompt, 0)])
    assert got == [(generate_alone(model, prompt, 1)[0],)]
    assert executor.clone(source, 21) is None
    assert executor.cache.used_cells() == used + 8  # the refusal changed nothing


# -- refusals -----------------------------------------------------------------------------


def test_a_batch_refused_by_pack_raises_and_changes_nothing(model) -> None:
    executor = make_executor(model)
    a, b, c = (executor.open_session() for _ in range(3))
    pa, pb, pc = prompts(5, 4, 6, seed=6)
    run(executor, [prompt_input(a, pa), prompt_input(c, pc)])
    before = cache_state(executor, (a, b, c))
    k_before = executor.pool.k[0].clone()
    batch = BatchInput(
        (
            prompt_input(b, pb),
            Input(c, True, 3, 2, pc, 0),  # a valid rewind of c to 3, never applied
            Input(a, True, 0, 1, [1], 7),  # a gap: a holds 5 positions
        )
    )
    with pytest.raises(InvalidArgumentError, match=r"starts at 7.*holds 5"):
        executor.execute(batch)
    assert cache_state(executor, (a, b, c)) == before
    assert torch.equal(executor.pool.k[0][: k_before.shape[0]], k_before)
    # The executor is still usable, and a's context is intact.
    assert run(executor, [Input(a, True, 5, 2, [*pa, 1, 2], 0)]) == [
        (generate_alone(model, [*pa, 1, 2], 1)[0],)
    ]


def test_running_out_of_cells_raises_with_a_clear_message(model) -> None:
    executor = make_executor(model, max_cells=16)
    a, b = executor.open_session(), executor.open_session()
    pa, pb = prompts(10, 9, seed=7)
    run(executor, [prompt_input(a, pa)])
    before = cache_state(executor, (a, b))
    with pytest.raises(OutOfResourcesError) as refused:
        executor.execute(BatchInput((prompt_input(b, pb),)))
    message = str(refused.value)
    assert "9 free KV cells" in message and "6 are free" in message
    assert "max_cells" in message  # says what to change
    assert cache_state(executor, (a, b)) == before
    # What fits still runs.
    assert run(executor, [prompt_input(b, pb[:6])]) == [(generate_alone(model, pb[:6], 1)[0],)]
    assert executor.kv_usage().free_cells == 0


def test_a_batch_short_of_cells_in_a_later_slice_changes_nothing(model) -> None:
    executor = make_executor(model, max_cells=16, max_batch_tokens=8)
    a, b = executor.open_session(), executor.open_session()
    pa, pb = prompts(8, 10, seed=8)
    before = cache_state(executor, (a, b))
    with pytest.raises(OutOfResourcesError, match="free KV cells"):
        executor.execute(BatchInput((prompt_input(a, pa), prompt_input(b, pb))))
    assert cache_state(executor, (a, b)) == before


# -- sampling -----------------------------------------------------------------------------


def test_seeded_sampling_gives_the_same_tokens_alone_and_in_a_batch(model) -> None:
    policy = SamplingParams(temperature=1.0, top_k=20)
    pa, pb, pc = prompts(11, 23, 4, seed=9)
    alone = generate_alone(model, pa, 12, (policy, 42))
    assert alone != generate_alone(model, pa, 12)  # sampling, not greedy in disguise
    assert alone == generate_alone(model, pa, 12, (policy, 42))  # the seed fixes the tokens

    executor = make_executor(model)
    b, a, c = (executor.open_session() for _ in range(3))
    executor.set_sampling(a, policy, 42)
    executor.set_sampling(b, SamplingParams(temperature=0.7, top_p=0.9), 1)
    executor.set_sampling(c, policy, 43)
    together = generate_together(executor, [b, a, c], [pb, pa, pc], 12)
    assert together[1] == alone


# -- penalties and logprobs ---------------------------------------------------------------

# Sampled, penalised and reporting everything: the hardest policy to keep batch-independent.
SCORED = SamplingParams(
    temperature=0.9,
    top_p=0.95,
    min_p=0.02,
    repetition_penalty=1.3,
    presence_penalty=0.4,
    frequency_penalty=0.3,
    logprobs=5,
    prompt_logprobs=5,
)
MATE = SamplingParams(temperature=1.0, frequency_penalty=1.0, prompt_logprobs=2, logprobs=1)


def scored_run(
    model: PackedTransformer,
    prompt: Sequence[int],
    chunk: int,
    steps: int,
    mates: Sequence[list[int]] = (),
    **shape: object,
) -> list[Output]:
    """The target's outputs: its prompt in `chunk`-token chunks, one a step, then decodes;
    each mate feeds its whole prompt in the first step and decodes in every later one."""
    executor = make_executor(model, **shape)
    mate_sids = [executor.open_session() for _ in mates]
    sid = executor.open_session()
    executor.set_sampling(sid, SCORED, 5)
    for index, mate in enumerate(mate_sids):
        executor.set_sampling(mate, MATE, index)
    chunks = [(o, min(chunk, len(prompt) - o)) for o in range(0, len(prompt), chunk)]
    mate_tokens: dict[SessionId, int] = {}
    outputs: list[Output] = []
    for step in range(len(chunks) + steps - 1):
        inputs = [
            Input(mate, True, 0, len(p), p, 0) if step == 0 else decode_input(executor, mate, t)
            for mate, p, t in zip(
                mate_sids, mates, [mate_tokens.get(m, 0) for m in mate_sids], strict=True
            )
        ]
        if step < len(chunks):
            offset, size = chunks[step]
            inputs.insert(
                step % (len(inputs) + 1),
                Input(sid, step == len(chunks) - 1, offset, size, list(prompt), 0),
            )
        else:
            inputs.insert(
                step % (len(inputs) + 1), decode_input(executor, sid, outputs[-1].tokens[0])
            )
        answer = executor.execute(BatchInput(tuple(inputs)))
        for item, output in zip(inputs, answer.outputs, strict=True):
            if output is None:
                continue
            if item.sid == sid:
                outputs.append(output)
            else:
                mate_tokens[item.sid] = output.tokens[0]
    return [dataclasses.replace(output, sid=0) for output in outputs]


def test_penalised_sampling_and_logprobs_do_not_depend_on_chunks_slices_or_batch_mates(model):
    target, *mates = prompts(20, 9, 14, 3, seed=11)
    alone = scored_run(model, target, chunk=20, steps=8)
    assert len(alone) == 8 and len(alone[0].prompt_logprobs) == 20
    assert all(len(output.logprobs) == 1 for output in alone)
    assert all(output.prompt_logprobs == () for output in alone[1:])
    for chunk, max_batch_tokens in ((3, 544), (7, 5), (20, 7)):
        crowded = scored_run(
            model, target, chunk, steps=8, mates=mates, max_batch_tokens=max_batch_tokens
        )
        assert crowded == alone, (chunk, max_batch_tokens)
    # The penalties really act: the same seed without them draws other tokens.
    unpenalised = dataclasses.replace(
        SCORED, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0
    )
    plain = generate_alone(model, target, 8, (unpenalised, 5))
    assert plain != [output.tokens[0] for output in alone]


def test_only_sessions_asking_for_prompt_logprobs_widen_the_logits(model) -> None:
    recorder = RecordingModel(model)
    executor = ModuleExecutor(recorder, CONFIG, ExecutorShape())
    executor.initialize()
    plain, scored = executor.open_session(), executor.open_session()
    executor.set_sampling(plain, SamplingParams(logprobs=3), 0)
    executor.set_sampling(scored, SamplingParams(prompt_logprobs=0), 0)
    pa, pb = prompts(12, 9, seed=12)
    first = run(executor, [prompt_input(plain, pa), prompt_input(scored, pb)])
    # One row for plain's output, nine for scored: eight prompt rows and its output row.
    assert recorder.logits[-1].shape[0] == 1 + 9
    run(
        executor,
        [decode_input(executor, plain, first[0][0]), decode_input(executor, scored, first[1][0])],
    )
    assert recorder.logits[-1].shape[0] == 2  # decodes: one row each
