"""The sampling extras clients send, through the Engine on a tiny random Llama with the
default model's tokenizer: logit bias, allowed tokens, banned sequences (bad words),
min_tokens, extra stop tokens, no EOS, the stop string kept. Each is per generation:
a prompt gets the same tokens alone and among others with other rules."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cellbatch import Engine, FinishReason, GenConfig, SamplingParams
from cellbatch.types import InvalidArgumentError
from tiny_models import make_tiny_chat_checkpoint

PROMPTS = ["Tell me a story.", "What is two plus two?", "hi", "Name a colour."]
BUDGET = 12


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    folder: Path = make_tiny_chat_checkpoint(tmp_path_factory.mktemp("rules") / "llama", 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with Engine.from_pretrained(folder, dtype="float32", kernels="torch", max_sessions=16) as made:
        yield made
    torch.set_num_threads(threads)


def run(engine: Engine, config: GenConfig, prompts: list[str] = PROMPTS) -> list[list[int]]:
    results = engine.chat(prompts, config, share_prefix=False)
    assert all(result.error == "" for result in results), [r.error for r in results]
    return [result.tokens for result in results]


def free(engine: Engine) -> list[list[int]]:
    return run(engine, GenConfig(max_new_tokens=BUDGET, stop_tokens=frozenset()))


def with_sampling(**rules: object) -> GenConfig:
    return GenConfig(
        max_new_tokens=BUDGET, stop_tokens=frozenset(), sampling=SamplingParams(**rules)
    )


def test_logit_bias_pulls_and_pushes_tokens(engine: Engine) -> None:
    plain = free(engine)
    forced = run(engine, with_sampling(logit_bias=((1234, 100.0),)))
    assert all(tokens == [1234] * BUDGET for tokens in forced)
    first = plain[0][0]
    pushed = run(engine, with_sampling(logit_bias=((first, -100.0),)), PROMPTS[:1])[0]
    assert first not in pushed


def test_allowed_tokens_keep_only_those(engine: Engine) -> None:
    allowed = frozenset({100, 200, 300})
    for tokens in run(engine, with_sampling(allowed_tokens=allowed, temperature=1.0)):
        assert set(tokens) <= allowed


def test_a_banned_sequence_is_never_completed(engine: Engine) -> None:
    plain = free(engine)[0]
    pair = (plain[2], plain[3])
    banned = run(engine, with_sampling(banned_sequences=(pair,)), PROMPTS[:1])[0]
    assert banned[:3] == plain[:3] and banned[3] != plain[3]  # the pair's end, once begun
    assert all((a, b) != pair for a, b in itertools.pairwise(banned))
    single = run(engine, with_sampling(banned_sequences=((plain[0],),)), PROMPTS[:1])[0]
    assert plain[0] not in single


def test_min_tokens_holds_the_stop_tokens_back(engine: Engine) -> None:
    eos = engine.tokenizer.eos_token_id if engine.tokenizer else None
    assert eos is not None
    pull_eos = SamplingParams(logit_bias=((eos, 100.0),))
    stopped = engine.chat(PROMPTS[:1], GenConfig(max_new_tokens=BUDGET, sampling=pull_eos))[0]
    assert stopped.tokens == [eos] and stopped.finish_reason == FinishReason.STOP_TOKEN
    held = replace(pull_eos, min_tokens=5)
    result = engine.chat(PROMPTS[:1], GenConfig(max_new_tokens=BUDGET, sampling=held))[0]
    assert len(result.tokens) == 6 and result.tokens[-1] == eos
    assert eos not in result.tokens[:5]
    with pytest.raises(InvalidArgumentError, match="min_tokens"):
        GenConfig(max_new_tokens=3, sampling=SamplingParams(min_tokens=4))


def test_extra_stop_tokens_and_no_stop_tokens(engine: Engine) -> None:
    plain = free(engine)[0]
    stop = plain[4]
    config = GenConfig(max_new_tokens=BUDGET, stop_tokens=frozenset(), extra_stop_tokens={stop})
    result = engine.chat(PROMPTS[:1], config, share_prefix=False)[0]
    assert result.tokens == plain[: plain.index(stop) + 1]
    assert result.finish_reason == FinishReason.STOP_TOKEN


def test_the_stop_string_can_stay_in_the_text(engine: Engine) -> None:
    text = engine.chat(PROMPTS[:1], GenConfig(max_new_tokens=BUDGET, stop_tokens=frozenset()))
    whole = text[0].text
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    assert stop.strip(), whole
    cut = GenConfig(max_new_tokens=BUDGET, stop_tokens=frozenset(), stop_strings=(stop,))
    kept = replace(cut, include_stop_string=True)
    before = engine.chat(PROMPTS[:1], cut)[0].text
    assert engine.chat(PROMPTS[:1], kept)[0].text == before + stop


def test_rules_are_per_generation_alone_and_among_others(engine: Engine) -> None:
    ruled = SamplingParams(
        logit_bias=((500, 5.0), (600, -5.0)),
        banned_sequences=((700,),),
        temperature=1.0,
    )
    config = GenConfig(max_new_tokens=BUDGET, stop_tokens=frozenset(), sampling=ruled, seed=5)
    prompt = engine.chat_tokens(PROMPTS[0])
    alone = engine.generate([prompt], config, share_prefix=False)[0].tokens
    sessions, handles = [], []
    neighbours = [
        SamplingParams(allowed_tokens=frozenset({1, 2, 3})),
        SamplingParams(logit_bias=((500, -100.0),)),
        SamplingParams(temperature=1.0, min_tokens=3),
        SamplingParams(),
    ]
    for index in range(9):
        session = engine.open_session()
        sessions.append(session)
        if index == 4:
            handles.append(session.generate_async(prompt, config))
        else:
            other = GenConfig(max_new_tokens=BUDGET, sampling=neighbours[index % 4], seed=index)
            handles.append(session.generate_async(engine.chat_tokens(PROMPTS[index % 4]), other))
    for handle in handles:
        assert handle.wait(60)
    assert list(handles[4].tokens()) == alone
    for session in sessions:
        session.close()


def test_a_rule_naming_a_token_outside_the_vocabulary_fails_that_generation_alone(
    engine: Engine,
) -> None:
    outside = with_sampling(logit_bias=((10**9, 1.0),))
    bad, good = engine.chat(PROMPTS[:1], outside)[0], engine.chat(PROMPTS[:1], GenConfig(4))[0]
    assert bad.finish_reason == FinishReason.FAILED and "outside the vocabulary" in bad.error
    assert good.ok
