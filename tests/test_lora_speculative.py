"""LoRA adapters beside speculative decoding and the CUDA executor: a generation's drafts
are verified by the target model with the generation's adapter (the tokens equal the
adapter's run without speculation, while the base model's drafts are rejected where the
adapter moves the logits), and an engine whose executor runs no adapters refuses them
with its reason, never running the base model instead."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from cellbatch.engine import Engine, EngineShape, ModuleBackend
from cellbatch.engine.adapter_options import check_lora_options
from cellbatch.executor.cell_executor import ExecutorShape
from cellbatch.executor.cuda_executor import CudaExecutor, CudaOptions
from cellbatch.generation_config import GenConfig
from cellbatch.model.loading import load_model
from cellbatch.speculative import SpeculativeConfig
from cellbatch.types import FinishReason, InvalidArgumentError
from fake_executor import WAIT_S
from lora_adapters import make_adapter
from tiny_models import make_tiny_checkpoint

VOCAB = 96
NO_EOS = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": None}
NEW_TOKENS = 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny model's folder, an adapter on every module of it)."""
    root = tmp_path_factory.mktemp("lora-speculative")
    hf_model, folder = make_tiny_checkpoint("llama", root / "model", **NO_EOS)
    return folder, make_adapter(hf_model, root / "all", rank=8, std=0.2, seed=7)


def _prompts(count: int) -> list[list[int]]:
    """Prompts that repeat a phrase of theirs, so that prompt lookup finds drafts."""
    rng = random.Random(3)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 8))]
        filler = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
        prompts.append([*phrase, *filler, *phrase, *filler, *phrase[:2]])
    return prompts


def _tokens(engine: Engine, prompts: list[list[int]], adapter: str | None) -> list[list[int]]:
    results = engine.generate(
        prompts, GenConfig(max_new_tokens=NEW_TOKENS, adapter=adapter), share_prefix=False
    )
    for result in results:
        assert result.ok, result.error
    return [result.tokens for result in results]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_drafts_are_verified_with_the_generations_adapter(
    tiny: tuple[Path, Path], method: str
) -> None:
    """The draft model is the base model itself: verified without the adapter, every
    draft would be kept and the tokens would be the base's."""
    folder, adapter = tiny
    config, module = load_model(folder, "float32", "torch", "none")
    target = ModuleBackend(module, config)
    prompts = _prompts(6)
    if method == "ngram":
        speculative = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1)
        draft = None
    else:
        speculative = SpeculativeConfig("draft_model", num_speculative_tokens=4, model="tiny")
        draft_config, draft_module = load_model(folder, "float32", "torch", "none")
        draft = ModuleBackend(draft_module, draft_config)
    shape = EngineShape(max_sessions=8, max_batch_tokens=128)
    with Engine(target, None, shape=shape) as plain:
        plain.load_adapter("all", adapter)
        base = _tokens(plain, prompts, None)
        expected = _tokens(plain, prompts, "all")
    assert base != expected  # the adapter moves the tokens
    with Engine(target, None, shape=shape, speculative=speculative, draft=draft) as engine:
        assert [info.name for info in engine.adapters()] == ["all"]  # the backend's bank
        got = _tokens(engine, prompts, "all")
        alone = [_tokens(engine, [prompt], "all")[0] for prompt in prompts[:2]]
        metrics = engine.metrics()
    assert got == expected
    assert alone == expected[:2]
    assert metrics.spec_draft_tokens > 0
    if method == "draft_model":  # the base's drafts: some fall where the adapter differs
        assert metrics.spec_accepted_tokens < metrics.spec_draft_tokens


def test_the_cuda_executor_refuses_adapters_with_its_reason(tiny: tuple[Path, Path]) -> None:
    """The CUDA executor (here eager on the CPU) runs no adapter rows: loading one, a
    generation naming one and the executor's own install are refused, saying to run on
    the CPU; the base model still runs."""
    folder, adapter = tiny
    config, module = load_model(folder, "float32", "torch", "none")
    backend = ModuleBackend(module, config, CudaOptions())
    assert backend.adapters is None
    with Engine(backend, None) as engine:
        assert isinstance(engine.executor, CudaExecutor)
        with pytest.raises(InvalidArgumentError, match="CPU only"):
            engine.load_adapter("all", adapter)
        handle = engine.runner.submit([1, 2, 3], GenConfig(max_new_tokens=2, adapter="all"))
        assert handle.wait(WAIT_S) and handle.finish_reason() == FinishReason.FAILED
        assert "adapter 'all'" in handle.error() and "device 'cpu'" in handle.error()
        base = engine.runner.submit([1, 2, 3], GenConfig(max_new_tokens=2))
        assert base.wait(WAIT_S) and base.finish_reason() == FinishReason.TOKEN_LIMIT
    executor = backend.executor(ExecutorShape(max_sessions=2, max_cells=64))
    executor.initialize()
    sid = executor.open_session()
    assert sid is not None
    with pytest.raises(InvalidArgumentError, match="CudaExecutor runs no LoRA adapters"):
        executor.set_adapter(sid, 1)
    with pytest.raises(InvalidArgumentError, match=r"lora_adapters on cuda.*CPU only"):
        check_lora_options({"all": adapter}, 8, False, torch.device("cuda"))
    with pytest.raises(InvalidArgumentError, match="exported program"):
        check_lora_options({"all": adapter}, 8, True, torch.device("cpu"))
