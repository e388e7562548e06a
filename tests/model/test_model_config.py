"""ModelConfig from config.json dicts, RoPE frequencies and dtype resolution."""

from __future__ import annotations

import pytest
import torch

from cellbatch.model import cpu as cpu_module
from cellbatch.model.config import ModelConfig, UnsupportedModelError
from cellbatch.model.transformer import resolve_dtype, rope_inverse_frequencies
from cellbatch.types import InvalidArgumentError

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def hf(architecture: str, **extra: object) -> dict:
    return {"architectures": [architecture], **BASE, **extra}


def test_llama_fields_and_transformers4_rope_layout() -> None:
    config = ModelConfig.from_hf_dict(
        hf(
            "LlamaForCausalLM",
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=[2, 7, 2],
        )
    )
    assert config.architecture == "llama"
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (4, 4, 2)
    assert config.head_dim == 16  # hidden / heads when head_dim is absent
    assert config.rope_theta == 500000.0 and config.rope_scaling is None
    assert config.tie_word_embeddings and config.max_position_embeddings == 4096
    assert not (config.attention_bias or config.attention_out_bias or config.qk_norm)
    assert config.layer_windows == (None,) * 4
    assert config.bos_token_id == 1 and config.eos_token_ids == (2, 7)


def test_llama3_rope_scaling_in_both_layouts() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = ModelConfig.from_hf_dict(
        hf("LlamaForCausalLM", rope_theta=5e5, rope_scaling={"rope_type": "llama3", **scaling})
    )
    new = ModelConfig.from_hf_dict(
        hf(
            "LlamaForCausalLM",
            rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **scaling},
        )
    )
    assert old == new
    assert new.rope_theta == 5e5
    assert new.rope_scaling.kind == "llama3" and new.rope_scaling.factor == 8.0


def test_qwen2_has_qkv_bias_and_windows_from_max_window_layers() -> None:
    plain = ModelConfig.from_hf_dict(hf("Qwen2ForCausalLM", sliding_window=32768))
    assert plain.attention_bias and not plain.attention_out_bias
    assert plain.layer_windows == (None,) * 4  # use_sliding_window defaults to off
    windowed = ModelConfig.from_hf_dict(
        hf("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    )
    assert windowed.layer_windows == (None, None, 8, 8)


def test_qwen3_layer_types_and_qk_norm() -> None:
    config = ModelConfig.from_hf_dict(
        hf(
            "Qwen3ForCausalLM",
            head_dim=32,
            use_sliding_window=True,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
    )
    assert config.qk_norm and config.head_dim == 32
    assert config.layer_windows == (16, None, 16, None)


def test_mistral_window_applies_to_every_layer() -> None:
    config = ModelConfig.from_hf_dict(hf("MistralForCausalLM", sliding_window=4096))
    assert config.layer_windows == (4096,) * 4
    assert (
        ModelConfig.from_hf_dict(hf("MistralForCausalLM", sliding_window=None)).layer_windows
        == (None,) * 4
    )


def test_unsupported_architecture_is_named_with_the_supported_list() -> None:
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as error:
        ModelConfig.from_hf_dict(hf("GPT2LMHeadModel"))
    for supported in (
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
    ):
        assert supported in str(error.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_unsupported_settings_are_refused_clearly(extra: dict, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_dict(hf("LlamaForCausalLM", **extra))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_frequencies_match_transformers_bit_for_bit(rope: dict) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(**{**BASE, "rope_parameters": rope})
    if rope["rope_type"] == "default":
        module = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding
        expected, _ = module.compute_default_rope_parameters(hf_config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    ours = rope_inverse_frequencies(ModelConfig.from_hf_dict(hf_config.to_dict()))
    assert torch.equal(ours, expected)


def test_resolve_dtype_names_aliases_and_errors() -> None:
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(InvalidArgumentError, match="unknown dtype 'float8'"):
        resolve_dtype("float8")
    with pytest.raises(InvalidArgumentError, match="not supported"):
        resolve_dtype(torch.int8)


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_auto_dtype_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, fast_bf16: bool) -> None:
    monkeypatch.setattr(cpu_module, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert resolve_dtype("auto") is (torch.bfloat16 if fast_bf16 else torch.float32)
