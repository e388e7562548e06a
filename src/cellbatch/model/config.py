"""Model configuration: the shape of a Llama-family decoder, read from its checkpoint.

Owns: `ModelConfig` (plain, frozen data) and `RopeScaling`, built from a Hugging Face
`config.json` dict (`ModelConfig.from_hf_dict`) or from GGUF metadata
(`ModelConfig.from_gguf`).
Promises: every supported architecture maps onto the same fields, so the transformer and
the loader never look at architecture names; anything the packed transformer cannot run
(another architecture, activation, RoPE type or MLP bias) is refused here with an error
that names it and says what is supported.
Never: reads tensors' values (GGUF tensors are only listed, and `rope_freqs` is read
because llama.cpp stores Llama 3 RoPE scaling there), touches torch, or guesses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cellbatch.types import ModelGeometry

# Hugging Face `architectures[0]` -> our architecture name.
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# GGUF `general.architecture` values we read (llama.cpp writes Mistral as "llama").
GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this package cannot run."""


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE inverse frequencies are rescaled for long contexts.

    kind "linear": every frequency divided by `factor`. kind "llama3": Llama 3.1's
    wavelength-dependent rule (`factor`, `low_freq_factor`, `high_freq_factor`,
    `original_max_position_embeddings`). kind "freq_factors": frequency i divided by
    `freq_factors[i]` (what llama.cpp stores in a GGUF's `rope_freqs` tensor for Llama 3).
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """The shape of one decoder-only Llama-family model."""

    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2 always)
    attention_out_bias: bool  # bias on o_proj (Llama/Qwen3 attention_bias=True)
    qk_norm: bool  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    layer_windows: tuple[int | None, ...]  # per layer: sliding window, None = full
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # The sizes its pooled hidden states (embeddings) may be shortened to, from
    # `matryoshka_dimensions` in config.json; () when `is_matryoshka` allows any; None
    # when the model was not trained for shortened embeddings.
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UnsupportedModelError(
                    f"model config: {name} must be a positive int, got {value!r}"
                )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(
                f"model config: head_dim must be even for RoPE, got {self.head_dim}"
            )
        if len(self.layer_windows) != self.num_layers:
            raise UnsupportedModelError(
                f"model config: layer_windows has {len(self.layer_windows)} entries for "
                f"{self.num_layers} layers"
            )
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise UnsupportedModelError(
                f"model config: sliding windows must be >= 1, got {self.layer_windows}"
            )
        scaling = self.rope_scaling
        if (
            scaling is not None
            and scaling.kind == "freq_factors"
            and len(scaling.freq_factors) != self.head_dim // 2
        ):
            raise UnsupportedModelError(
                f"model config: rope freq_factors has {len(scaling.freq_factors)} entries, "
                f"expected head_dim / 2 = {self.head_dim // 2}"
            )

    @property
    def geometry(self) -> ModelGeometry:
        """Its sizes as the runtime reads them (positions: the whole context)."""
        return ModelGeometry(
            vocab_size=self.vocab_size,
            max_positions=self.max_position_embeddings,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_size=self.hidden_size,
            layer_windows=self.layer_windows,
            eos_token_ids=self.eos_token_ids,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # -- Hugging Face ------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """From a Hugging Face `config.json` (transformers 4 or 5 layout)."""
        architecture = _hf_architecture(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"{architecture}: hidden_act {hf['hidden_act']!r} is not supported (only silu)"
            )
        if hf.get("mlp_bias", False):
            raise UnsupportedModelError(f"{architecture}: mlp_bias=True is not supported")
        num_layers = _required(hf, "num_hidden_layers")
        num_heads = _required(hf, "num_attention_heads")
        hidden_size = _required(hf, "hidden_size")
        head_dim = hf.get("head_dim") or hidden_size // num_heads
        rope_theta, rope_scaling = _hf_rope(hf, architecture)
        bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=_required(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required(hf, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if architecture == "qwen2" else bias,
            attention_out_bias=False if architecture == "qwen2" else bias,
            qk_norm=architecture == "qwen3",
            layer_windows=_hf_layer_windows(hf, architecture, num_layers),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_ids(eos),
            matryoshka_dimensions=_hf_matryoshka(hf),
        )

    # -- GGUF --------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: Any) -> ModelConfig:
        """From the metadata (and tensor list) of a `gguf.GGUFReader`."""
        arch = gguf_field(reader, "general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported; supported: "
                f"{', '.join(GGUF_ARCHITECTURES)}"
            )
        name = str(gguf_field(reader, "general.name") or "").lower()
        architecture = "mistral" if arch == "llama" and "mistral" in name else arch

        def meta(key: str, default: Any = None) -> Any:
            value = gguf_field(reader, f"{arch}.{key}")
            if value is None and default is None:
                raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
            return default if value is None else value

        tensors = {t.name: t for t in reader.tensors}
        num_layers = int(meta("block_count"))
        num_heads = int(meta("attention.head_count"))
        hidden_size = int(meta("embedding_length"))
        head_dim = int(
            gguf_field(reader, f"{arch}.attention.key_length")
            or gguf_field(reader, f"{arch}.rope.dimension_count")
            or hidden_size // num_heads
        )
        vocab_size = gguf_field(reader, f"{arch}.vocab_size")
        if vocab_size is None:
            tokens = reader.fields.get("tokenizer.ggml.tokens")
            vocab_size = (
                len(tokens.data)
                if tokens is not None
                else int(tensors["token_embd.weight"].shape[-1])
            )
        window = gguf_field(reader, f"{arch}.attention.sliding_window")
        eos = [
            gguf_field(reader, key)
            for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        ]
        return cls(
            architecture=architecture,
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(meta("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope(reader, arch, tensors),
            max_position_embeddings=int(meta("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            attention_out_bias="blk.0.attn_output.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            layer_windows=(int(window) if window else None,) * num_layers,
            bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_ids([e for e in eos if e is not None]),
        )


# -- helpers -----------------------------------------------------------------------


def gguf_field(reader: Any, key: str) -> Any:
    """A GGUF metadata value as a Python value (str, int, float, bool or list); None if absent.

    Reads `parts`/`data` directly rather than `ReaderField.contents()` so that older gguf
    releases work too.
    """
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return None
    string = gguf.GGUFValueType.STRING

    def value(part: np.ndarray, kind: Any) -> Any:
        return bytes(part).decode("utf-8") if kind == string else part.tolist()[0]

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [value(field.parts[i], field.types[-1]) for i in field.data]
    return value(field.parts[field.data[0]], field.types[0])


def _hf_architecture(hf: Mapping[str, Any]) -> str:
    supported = ", ".join(HF_ARCHITECTURES)
    architectures = hf.get("architectures") or []
    if architectures:
        name = architectures[0]
        if name not in HF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {name!r} is not supported; supported: {supported}"
            )
        return HF_ARCHITECTURES[name]
    model_type = hf.get("model_type")
    if model_type in HF_ARCHITECTURES.values():
        return str(model_type)  # equal to one of those names: a str
    raise UnsupportedModelError(
        f"config.json names no supported architecture (architectures={architectures}, "
        f"model_type={model_type!r}); supported: {supported}"
    )


def _required(hf: Mapping[str, Any], key: str) -> int:
    if hf.get(key) is None:
        raise UnsupportedModelError(f"config.json lacks {key!r}")
    return int(hf[key])


def _hf_rope(hf: Mapping[str, Any], architecture: str) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x wrote `rope_theta` and
    # `rope_scaling` (with "type" in older files, "rope_type" in newer).
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{architecture}: RoPE type {kind!r} is not supported; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(params["factor"]))
    return theta, RopeScaling(
        kind="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _hf_layer_windows(
    hf: Mapping[str, Any], architecture: str, num_layers: int
) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if architecture == "mistral":
        return (int(window) if window else None,) * num_layers
    if architecture == "llama" or not hf.get("use_sliding_window", False) or not window:
        return (None,) * num_layers
    layer_types = hf.get("layer_types")
    if layer_types:
        return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
    # Qwen2/Qwen3: layers from max_window_layers on use the window.
    first = int(hf.get("max_window_layers", num_layers))
    return tuple(int(window) if i >= first else None for i in range(num_layers))


def _gguf_rope(reader: Any, arch: str, tensors: Mapping[str, Any]) -> RopeScaling | None:
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64).reshape(-1)
        return RopeScaling(kind="freq_factors", freq_factors=tuple(float(f) for f in factors))
    kind = gguf_field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = gguf_field(reader, f"{arch}.rope.scaling.factor")
    if kind != "linear" or not factor:
        raise UnsupportedModelError(
            f"GGUF RoPE scaling {kind!r} is not supported; supported: linear, and Llama 3 "
            "frequency factors (the rope_freqs tensor)"
        )
    return RopeScaling(kind="linear", factor=float(factor))


def _as_ids(value: int | Sequence[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(dict.fromkeys(int(v) for v in value))


def _hf_matryoshka(hf: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The embedding sizes a config.json allows (see ModelConfig.matryoshka_dimensions)."""
    sizes = hf.get("matryoshka_dimensions")
    if sizes:
        return tuple(int(size) for size in sizes)
    return () if hf.get("is_matryoshka") else None
