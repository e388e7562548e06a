"""LoRA adapters through the Engine: greedy tokens against transformers + PEFT (a tiny
model, its GGUF file and, slow, the default model), adapters and the base mixed in one
batch, an int4 base in one-op layers, and adapters loaded and unloaded while generations run."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from cellbatch.engine import Engine
from cellbatch.generation_config import GenConfig
from cellbatch.model.default import default_model_path
from cellbatch.model.lora import AdapterError
from cellbatch.types import FinishReason, InvalidArgumentError
from lora_adapters import make_adapter, peft_model
from tiny_models import (
    first_divergence,
    greedy_check,
    greedy_reference,
    make_tiny_checkpoint,
    near_tie,
    write_gguf,
)

NEW_TOKENS = 24
VOCAB = 96
WAIT_S = 30.0
NO_EOS = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": None}
# Three adapters of the kinds people train: attention only, MLP only, every module.
ADAPTERS: dict[str, dict] = {
    "attention": {"targets": ["q_proj", "k_proj", "v_proj", "o_proj"], "rank": 8, "seed": 1},
    "mlp": {"targets": ["gate_proj", "up_proj", "down_proj"], "rank": 16, "seed": 2},
    "all": {"rank": 4, "seed": 3, "rslora": True, "alpha": 8.0},
}


def random_prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request: pytest.FixtureRequest) -> Iterator[None]:
    before = torch.get_num_threads()
    if request.node.get_closest_marker("slow") is None:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """(transformers model, its folder, {name: adapter folder}) of a tiny Llama."""
    root = tmp_path_factory.mktemp("lora-tiny")
    hf_model, folder = make_tiny_checkpoint("llama", root / "model", **NO_EOS)
    adapters = {
        name: make_adapter(hf_model, root / name, **options) for name, options in ADAPTERS.items()
    }
    return hf_model, folder, adapters


@pytest.fixture(scope="module")
def references(tiny) -> Callable[[str | None, tuple[int, ...]], list[int]]:
    """references(adapter or None, prompt) -> transformers + PEFT's greedy tokens."""
    hf_model, _, adapters = tiny

    @functools.cache
    def model(name: str | None):
        return hf_model if name is None else peft_model(hf_model, adapters[name])

    @functools.cache
    def tokens(name: str | None, prompt: tuple[int, ...]):
        return greedy_reference(model(name), list(prompt), NEW_TOKENS)

    return tokens


def run_each(engine: Engine, jobs: Sequence[tuple[str | None, list[int]]]) -> list[list[int]]:
    """Submits every (adapter, prompt) at once and returns each one's greedy tokens."""
    handles = [
        engine.runner.submit(prompt, GenConfig(max_new_tokens=NEW_TOKENS, adapter=adapter))
        for adapter, prompt in jobs
    ]
    tokens = []
    for handle in handles:
        assert handle.wait(WAIT_S) and handle.finish_reason() == FinishReason.TOKEN_LIMIT, (
            handle.error()
        )
        tokens.append(handle.tokens())
    return tokens


def test_each_adapter_and_the_base_give_peft_greedy_tokens(tiny, references) -> None:
    _, folder, adapters = tiny
    prompts = random_prompts([5, 12, 30], seed=4)
    with Engine.from_pretrained(
        folder, dtype="float32", quantize="none", lora_adapters=adapters, max_sessions=8
    ) as engine:
        assert [info.name for info in engine.adapters()] == list(ADAPTERS)
        jobs = [(name, p) for name in (*ADAPTERS, None) for p in prompts]
        got = run_each(engine, jobs)
        usage = engine.adapter_usage()
    moved = 0
    for (name, prompt), tokens in zip(jobs, got, strict=True):
        expected = references(name, tuple(prompt))
        assert tokens == expected.tokens or near_tie(tokens, expected), (
            f"{name}, {len(prompt)} tokens: {first_divergence(tokens, expected)}"
        )
        moved += name is not None and expected.tokens != references(None, tuple(prompt)).tokens
    assert moved >= 6  # the adapters do change what the model says
    assert usage["mlp"].generations == 3 and usage["mlp"].generated_tokens == 3 * NEW_TOKENS


def test_a_gguf_base_runs_adapters_trained_on_its_transformers_model(
    tiny, references, tmp_path
) -> None:
    """llama.cpp's file interleaves Q/K rows; the adapter's q/k pairs still fit."""
    hf_model, _, adapters = tiny
    gguf = tmp_path / "tiny.gguf"
    write_gguf(hf_model, gguf, "llama")
    prompt = random_prompts([17], seed=5)[0]
    with Engine.from_pretrained(
        gguf, dtype="float32", quantize="none", lora_adapters={"attention": adapters["attention"]}
    ) as engine:
        (tokens,) = run_each(engine, [("attention", prompt)])
    expected = references("attention", tuple(prompt))
    assert tokens == expected.tokens or near_tie(tokens, expected), first_divergence(
        tokens, expected
    )


@pytest.mark.parametrize(("quantize", "dtype"), [("none", "float32"), ("int4", "bfloat16")])
def test_adapters_and_the_base_mixed_in_a_batch_of_16_give_their_lone_tokens(
    tiny, quantize, dtype
) -> None:
    """Each row of a 16-row batch (3 adapters and the base, interleaved) gets the tokens
    it gets alone: a row's tokens never depend on its neighbours' adapters (int4 bf16:
    the one-op layers with adapters inside)."""
    _, folder, adapters = tiny
    prompts = random_prompts([3 + 4 * i for i in range(16)], seed=6)
    names: list[str | None] = [*ADAPTERS, None]
    jobs = [(names[i % 4], prompt) for i, prompt in enumerate(prompts)]
    with Engine.from_pretrained(
        folder, dtype=dtype, quantize=quantize, lora_adapters=adapters, max_sessions=16
    ) as engine:
        alone = [run_each(engine, [job])[0] for job in jobs]
        together = run_each(engine, jobs)
        assert engine.metrics().peak_concurrent_generations == 16
        shuffled = list(reversed(jobs))
        assert run_each(engine, shuffled) == list(reversed(alone))
    assert together == alone


def test_an_adapter_unloaded_while_it_runs_finishes_its_generations(tiny, references) -> None:
    _, folder, adapters = tiny
    prompt = random_prompts([11], seed=8)[0]
    with Engine.from_pretrained(folder, dtype="float32", quantize="none") as engine:
        engine.load_adapter("mlp", adapters["mlp"])
        handle = engine.runner.submit(prompt, GenConfig(max_new_tokens=NEW_TOKENS, adapter="mlp"))
        engine.unload_adapter("mlp")  # at once: new generations can no longer name it
        assert engine.adapters() == []
        refused = engine.runner.submit(prompt, GenConfig(adapter="mlp"))
        assert refused.wait(WAIT_S) and refused.finish_reason() == FinishReason.FAILED
        assert "no LoRA adapter named 'mlp'" in refused.error()
        assert handle.wait(WAIT_S) and handle.finish_reason() == FinishReason.TOKEN_LIMIT
        assert handle.tokens() == references("mlp", tuple(prompt)).tokens
        assert engine.backend.adapters is not None and engine.backend.adapters.holding() == 0
        with pytest.raises(InvalidArgumentError, match="no LoRA adapter named 'mlp'"):
            engine.unload_adapter("mlp")


def test_a_bad_adapter_loads_nothing_and_says_why(tiny, tmp_path) -> None:
    _, folder, adapters = tiny
    other, _ = make_tiny_checkpoint("llama", tmp_path / "wide", hidden_size=32, **NO_EOS)
    wide = make_adapter(other, tmp_path / "for-another-model", ["q_proj"], rank=4)
    with Engine.from_pretrained(folder, dtype="float32") as engine:
        with pytest.raises(AdapterError, match=r"for-another-model.*expected lora_A \[r, 64\]"):
            engine.load_adapter("wide", wide)
        assert engine.adapters() == []
        with pytest.raises(InvalidArgumentError, match="adapter name"):
            engine.load_adapter(" spaced ", adapters["all"])
    with pytest.raises(AdapterError):
        Engine.from_pretrained(folder, lora_adapters={"wide": wide})
    with pytest.raises(InvalidArgumentError, match="max_loras"):
        Engine.from_pretrained(folder, lora_adapters=adapters, max_loras=2)


# -- slow: the default model --------------------------------------------------------------


@pytest.mark.slow
def test_the_default_model_with_adapters_gives_peft_greedy_tokens(
    tmp_path: Path, default_reference
) -> None:
    """Adapters of the default model's shape (rank 16 on every module, rank 64 on q and
    v) on its GGUF file, fp32: each prompt's greedy tokens equal transformers + PEFT on
    the same weights (the file dequantised)."""
    path = default_model_path()
    base = default_reference  # make_adapter and peft_model wrap copies of it
    adapters = {
        "wide": make_adapter(base, tmp_path / "wide", rank=16, std=0.02, seed=11),
        "qv64": make_adapter(base, tmp_path / "qv", ["q_proj", "v_proj"], rank=64, std=0.01),
    }
    prompts = random_prompts([7, 40], seed=9)
    prompts = [[p + 1000 for p in prompt] for prompt in prompts]
    with Engine.from_pretrained(
        path, dtype="float32", quantize="none", lora_adapters=adapters
    ) as engine:
        jobs = [(name, prompt) for name in (*adapters, None) for prompt in prompts]
        got = run_each(engine, jobs)
    models = {name: peft_model(base, folder) for name, folder in adapters.items()}
    for (name, prompt), tokens in zip(jobs, got, strict=True):
        model = base if name is None else models[name]
        expected = greedy_check(model, prompt, tokens, NEW_TOKENS)
        assert tokens == expected.tokens or near_tie(tokens, expected), (
            f"{name}: {first_divergence(tokens, expected)}"
        )
