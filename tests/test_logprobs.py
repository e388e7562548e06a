"""Logprobs and penalties through the runner (issue 13).

Against the fake executor (a token taking position p is 1000 + p, its logprob -p / 100):
updates keep logprobs aligned with the tokens they keep, prompt logprobs come once (a
preempted generation that recomputes its prompt does not send them again), handles
accumulate both, streams merge them in step. Against a tiny random Llama through a
real ModuleExecutor: prompt and token logprobs equal the log-softmax of transformers'
forward over the same tokens, whatever the prompt chunk, and penalised seeded
sampling survives preemption unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cellbatch import Runner
from cellbatch.executor.module_executor import ExecutorShape, ModuleExecutor
from cellbatch.generation_config import GenConfig, SamplingParams
from cellbatch.model.loading import load_model
from cellbatch.runner.admission import GROWTH_CELLS
from cellbatch.scheduler import DecodeFirstScheduler
from cellbatch.types import FinishReason, GenerationUpdate
from fake_executor import (
    WAIT_S,
    FakeExecutor,
    Recorder,
    fake_logprob,
    fake_prompt_logprobs,
    make_tokens,
)
from tiny_models import make_tiny_checkpoint, reference_model

ASK = SamplingParams(logprobs=2, prompt_logprobs=2)


@pytest.fixture
def runners() -> Iterator[list[Runner]]:
    made: list[Runner] = []
    yield made
    for runner in made:
        runner.shutdown()


def fake_runner(runners: list[Runner], **knobs: object) -> tuple[Runner, FakeExecutor]:
    fake = FakeExecutor(logprobs=True, **knobs)
    runners.append(Runner(fake, DecodeFirstScheduler.create(64, 8, 16)))
    return runners[-1], fake


def expected_logprobs(tokens: list[int], prompt_length: int) -> list:
    return [fake_logprob(token, prompt_length + i) for i, token in enumerate(tokens)]


def check_updates(updates: list[GenerationUpdate], prompt: list[int]) -> None:
    """Each update's logprobs align with its tokens; the prompt logprobs come once, first."""
    tokens = [token for update in updates for token in update.tokens]
    assert all(len(update.logprobs) == len(update.tokens) for update in updates)
    assert [lp for update in updates for lp in update.logprobs] == expected_logprobs(
        tokens, len(prompt)
    )
    carrying = [update for update in updates if update.prompt_logprobs]
    assert len(carrying) == 1 and carrying[0] is updates[0]
    assert carrying[0].prompt_logprobs == fake_prompt_logprobs(prompt)


# -- the runner with a fake executor --------------------------------------------------------


@pytest.mark.parametrize("max_new_tokens", [3, 12])
def test_updates_keep_the_logprobs_of_the_tokens_they_keep(runners, max_new_tokens) -> None:
    # Speculative runs of 3; a stop token as the 5th token cuts a run short, and a budget
    # of 3 cuts the first decode's run.
    runner, _ = fake_runner(runners, decode_tokens=3, stop_after=5)
    prompt = make_tokens(7)
    recorder = Recorder()
    handle = runner.submit(
        prompt,
        GenConfig(max_new_tokens=max_new_tokens, sampling=ASK, stop_tokens=frozenset({2})),
        on_update=recorder.on_update,
    )
    result = handle.result(WAIT_S)
    assert len(result.tokens) == min(5, max_new_tokens)
    check_updates(recorder.updates, prompt)
    assert result.logprobs == tuple(expected_logprobs(list(result.tokens), 7))
    assert handle.logprobs() == list(result.logprobs)
    assert result.prompt_logprobs == fake_prompt_logprobs(prompt)
    assert handle.prompt_logprobs() == list(fake_prompt_logprobs(prompt))


def test_a_recomputed_prompt_does_not_send_prompt_logprobs_again(runners) -> None:
    new_tokens = GROWTH_CELLS + 20  # each outgrows the growth reserve it started with
    runner, fake = fake_runner(runners, cell_limit=6 * (10 + new_tokens))
    prompts = [make_tokens(6 + i % 5, start=10 + i) for i in range(16)]
    recorders = [Recorder() for _ in prompts]
    handles = [
        runner.submit(p, GenConfig(max_new_tokens=new_tokens, sampling=ASK), on_update=r.on_update)
        for p, r in zip(prompts, recorders, strict=True)
    ]
    for handle in handles:
        assert handle.result(WAIT_S).finish_reason == FinishReason.TOKEN_LIMIT, handle.error()
    assert runner.metrics().preemptions > 0
    # The fake answered each recomputed prompt with prompt logprobs of the whole context.
    prompt_outputs = Counter(
        item.sid
        for batch in fake.batches
        for item in batch.inputs
        if item.produce_output and len(item.payload) > 1
    )
    assert max(prompt_outputs.values()) > 1
    for prompt, recorder, handle in zip(prompts, recorders, handles, strict=True):
        check_updates(recorder.updates, prompt)
        assert handle.result().prompt_logprobs == fake_prompt_logprobs(prompt)


def test_logprobs_out_of_step_with_the_tokens_fail_the_batch(runners) -> None:
    runner, _ = fake_runner(runners, malformed_at_step=1, malformation="logprobs")
    result = runner.submit(make_tokens(4), GenConfig(sampling=ASK)).result(WAIT_S)
    assert result.finish_reason == FinishReason.FAILED
    assert "1 tokens but 2 logprobs" in result.error


def test_streams_keep_logprobs_in_step_and_send_the_prompt_logprobs_once(runners) -> None:
    runner, _ = fake_runner(runners, decode_tokens=2)
    prompt = make_tokens(5)

    async def read(late: bool) -> tuple[list[GenerationUpdate], GenerationUpdate]:
        handle = runner.submit(prompt, GenConfig(max_new_tokens=9, sampling=ASK))
        if late:
            await handle.result_async()
        updates = [update async for update in handle.stream()]
        return updates, await handle.result_async()

    for late in (False, True):
        updates, result = asyncio.run(asyncio.wait_for(read(late), WAIT_S))
        check_updates(updates, prompt)
        assert updates[-1].finish_reason == FinishReason.TOKEN_LIMIT
        assert [t for u in updates for t in u.tokens] == list(result.tokens)
        assert result.logprobs == tuple(expected_logprobs(list(result.tokens), 5))
        assert result.prompt_logprobs == fake_prompt_logprobs(prompt)
        if late:
            assert len(updates) == 1  # merged: everything in one update


# -- a tiny Llama through ModuleExecutor -----------------------------------------------------

PROMPT = [5, 17, 33, 2, 90, 41, 8, 8, 63, 12, 77, 3, 50, 21, 9, 60, 11, 42, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """(config, our module, transformers' module) of one tiny random Llama."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    folder: Path = tmp_path_factory.mktemp("tiny") / "llama"
    make_tiny_checkpoint("llama", folder, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    config, module = load_model(folder, "float32")
    yield config, module, reference_model(folder)
    torch.set_num_threads(before)


def model_runner(runners: list[Runner], tiny, chunk: int = 16, max_cells: int = 4096) -> Runner:
    config, module, _ = tiny
    executor = ModuleExecutor(
        module, config, ExecutorShape(max_sessions=8, max_session_tokens=128, max_cells=max_cells)
    )
    runners.append(Runner(executor, DecodeFirstScheduler.create(64, 8, chunk)))
    return runners[-1]


def reference_logprobs(tiny, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over `tokens`: row i predicts token i + 1."""
    with torch.no_grad():
        logits = tiny[2](torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_scores(entry, reference_row: torch.Tensor, token: int, top: int) -> None:
    assert entry.token == token
    assert entry.logprob == pytest.approx(reference_row[token].item(), abs=1e-4)
    expected = reference_row.topk(top)
    assert [t for t, _ in entry.top] == expected.indices.tolist()
    assert [v for _, v in entry.top] == pytest.approx(expected.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("chunk", [3, 7, len(PROMPT)])
def test_logprobs_equal_a_direct_forward_whatever_the_prompt_chunks(runners, tiny, chunk):
    runner = model_runner(runners, tiny, chunk)
    sampling = SamplingParams(logprobs=4, prompt_logprobs=5)
    neighbour = runner.submit(make_tokens(11), GenConfig(max_new_tokens=8))
    result = runner.submit(PROMPT, GenConfig(max_new_tokens=6, sampling=sampling)).result(WAIT_S)
    assert result.finish_reason == FinishReason.TOKEN_LIMIT, result.error
    assert neighbour.result(WAIT_S).finish_reason == FinishReason.TOKEN_LIMIT
    tokens = PROMPT + list(result.tokens)
    reference = reference_logprobs(tiny, tokens)
    assert len(result.prompt_logprobs) == len(PROMPT) and result.prompt_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        entry = result.prompt_logprobs[position]
        assert_scores(entry, reference[position - 1], PROMPT[position], 5)
    assert len(result.logprobs) == 6
    for index, entry in enumerate(result.logprobs):
        position = len(PROMPT) + index
        assert_scores(entry, reference[position - 1], tokens[position], 4)
        # Greedy: the chosen token is the most likely one.
        assert entry.top[0][0] == entry.token


def test_penalised_seeded_sampling_survives_preemption_unchanged(runners, tiny) -> None:
    prompts = [PROMPT[i : i + 8 + i % 3] for i in range(6)]
    sampling = SamplingParams(
        temperature=0.8,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        logprobs=2,
        prompt_logprobs=1,
    )

    new_tokens = GROWTH_CELLS + 14  # each outgrows the growth reserve it started with

    def run_all(runner: Runner) -> list[GenerationUpdate]:
        handles = [
            runner.submit(p, GenConfig(max_new_tokens=new_tokens, sampling=sampling, seed=i))
            for i, p in enumerate(prompts)
        ]
        results = [handle.result(WAIT_S) for handle in handles]
        for result in results:
            assert result.finish_reason == FinishReason.TOKEN_LIMIT, result.error
        return results

    free = run_all(model_runner(runners, tiny, chunk=4))
    # Two start (the second beside the first's growth reserve), and outgrow the pool.
    pressed_runner = model_runner(runners, tiny, chunk=4, max_cells=2 * GROWTH_CELLS + 32)
    pressed = run_all(pressed_runner)
    assert pressed_runner.metrics().preemptions > 0
    assert pressed == free
    assert [len(r.prompt_logprobs) for r in free] == [len(p) for p in prompts]
    assert all(len(r.logprobs) == new_tokens for r in free)
    # The penalties act: without them the same seeds draw other tokens.
    plain = dataclasses.replace(sampling, repetition_penalty=1.0, frequency_penalty=0.0)
    runner = model_runner(runners, tiny, chunk=4)
    unpenalised = [
        runner.submit(p, GenConfig(max_new_tokens=14, sampling=plain, seed=i)).result(WAIT_S)
        for i, p in enumerate(prompts)
    ]
    assert [r.tokens for r in unpenalised] != [r.tokens for r in free]
