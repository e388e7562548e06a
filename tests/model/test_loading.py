"""Loading Hugging Face folders (one or many safetensors) and GGUF files, and the errors
for checkpoints that cannot be loaded."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cellbatch.model.checkpoints import CheckpointMismatchError
from cellbatch.model.config import UnsupportedModelError
from cellbatch.model.loading import load_model, locate_model
from tiny_models import write_gguf

TOKENS = [5, 17, 33, 2, 61, 9, 40, 12]


def packed_logits(packed_steps, model) -> torch.Tensor:
    return packed_steps(model, [[(0, TOKENS)]], 1)[0]


def hf_logits(hf_model) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([TOKENS])).logits[0]


def test_sharded_safetensors_load_like_one_file(tiny_checkpoint, packed_steps) -> None:
    hf_model, folder = tiny_checkpoint("qwen2", max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 2
    assert (folder / "model.safetensors.index.json").is_file()
    _, model = load_model(folder, "float32")
    assert (packed_logits(packed_steps, model) - hf_logits(hf_model)).abs().max() < 1e-4


def test_weights_take_the_requested_dtype(tiny_checkpoint) -> None:
    _, folder = tiny_checkpoint("llama")
    for name, dtype in (
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
    ):
        _, model = load_model(folder, name)
        assert {p.dtype for p in model.parameters()} == {dtype}
        assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gguf_file_loads_like_the_original(tiny_checkpoint, packed_steps, tmp_path, kind) -> None:
    hf_model, _ = tiny_checkpoint(kind)
    file = tmp_path / f"{kind}.gguf"
    write_gguf(hf_model, file, kind)
    config, model = load_model(file, "float32")
    assert config.architecture == kind
    assert config.attention_bias == (kind == "qwen2")
    assert not config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert (packed_logits(packed_steps, model) - hf_logits(hf_model)).abs().max() < 1e-4
    # A folder holding exactly one .gguf (and no config.json) names the same model.
    assert locate_model(tmp_path).path == file


def test_gguf_with_mistral_in_its_name_is_mistral(tiny_checkpoint, tmp_path) -> None:
    hf_model, _ = tiny_checkpoint("llama")
    write_gguf(hf_model, tmp_path / "m.gguf", "llama", name="Mistral 7B Instruct")
    config, _ = load_model(tmp_path / "m.gguf", "float32")
    assert config.architecture == "mistral"


def test_unsupported_gguf_architecture_is_named(tiny_checkpoint, tmp_path) -> None:
    hf_model, _ = tiny_checkpoint("llama")
    write_gguf(hf_model, tmp_path / "g.gguf", "gemma")
    with pytest.raises(
        UnsupportedModelError, match=r"GGUF architecture 'gemma'.*llama, mistral, qwen2, qwen3"
    ):
        load_model(tmp_path / "g.gguf", "float32")


# -- errors ------------------------------------------------------------------------


def test_missing_paths_and_wrong_files(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere", "float32")
    with pytest.raises(FileNotFoundError, match=r"neither config\.json nor a \.gguf"):
        load_model(tmp_path, "float32")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(UnsupportedModelError, match=r"not a \.gguf file"):
        load_model(tmp_path / "weights.bin", "float32")
    (tmp_path / "broken.gguf").write_bytes(b"\0" * 16)
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF"):
        load_model(tmp_path / "broken.gguf", "float32")


def test_folder_without_safetensors(tiny_checkpoint) -> None:
    _, folder = tiny_checkpoint("llama")
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(folder, "float32")


def test_sharded_folder_missing_a_shard(tiny_checkpoint) -> None:
    _, folder = tiny_checkpoint("llama", max_shard_size="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(folder, "float32")


def test_unsupported_architecture_in_config_json(tiny_checkpoint) -> None:
    _, folder = tiny_checkpoint("llama")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError, match="'GPT2LMHeadModel' is not supported; supported: Llama"
    ):
        load_model(folder, "float32")


def test_shape_mismatch_names_tensor_and_shapes(tiny_checkpoint) -> None:
    _, folder = tiny_checkpoint("llama")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 80
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointMismatchError) as error:
        load_model(folder, "float32")
    message = str(error.value)
    assert "model.layers.0.mlp.gate_proj.weight: expected (80, 64), got (96, 64)" in message
    assert "model.layers.1.mlp.down_proj.weight: expected (64, 80), got (64, 96)" in message


def test_missing_and_unexpected_tensors_are_listed(tiny_checkpoint) -> None:
    _, folder = tiny_checkpoint("llama")
    file = folder / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError) as error:
        load_model(folder, "float32")
    message = str(error.value)
    assert "missing tensors (1): model.layers.1.self_attn.k_proj.weight" in message
    assert "unexpected tensors (1): model.layers.1.self_attn.extra.weight" in message


def test_more_layers_in_config_than_in_checkpoint(tiny_checkpoint) -> None:
    _, folder = tiny_checkpoint("qwen3")
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 3
    config["layer_types"] = ["full_attention"] * 3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointMismatchError, match=r"missing tensors \(11\): model\.layers\.2\."
    ):
        load_model(folder, "float32")
