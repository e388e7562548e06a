"""A model's checkpoint as loading reads it: a Hugging Face folder (config.json and
safetensors files) or a GGUF file, and the map from each parameter of
`PackedTransformer` to the checkpoint tensors concatenated into it.

Owns: `HFCheckpoint` and `GGUFCheckpoint` (the config, every tensor's shape and GGUF kind,
a tensor as float32 or converted to a quantised layout, where its bytes are mapped), the
name maps (transformers' names and llama.cpp's), and `check_tensors`, the one check of
names and shapes before anything loads.
Promises: a mismatch raises one `CheckpointMismatchError` naming every missing,
unexpected and mis-shaped tensor (expected vs got); GGUF tensors come in transformers'
row order (llama.cpp's interleaved Q/K rows of llama-arch files undone).
Never: builds a model or decides a tensor's format (`cellbatch.model.loading` does).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeAlias

import numpy as np
import torch

from cellbatch.model import gguf_blocks, kquants, quantized
from cellbatch.model.config import ModelConfig, UnsupportedModelError

# Checkpoint tensors that carry nothing the model needs.
_IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_IGNORED_GGUF = frozenset({"rope_freqs.weight"})  # read into ModelConfig.rope_scaling
_LISTED = 8  # names quoted per kind of problem in a mismatch error


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match what its config describes."""


class _SafetensorsSlice(Protocol):
    """What is read of a safetensors slice (`get_slice`): its shape."""

    def get_shape(self) -> list[int]: ...


class _SafetensorsFile(Protocol):
    """What is read of an open safetensors file (`safe_open`, whose methods safetensors
    leaves unannotated)."""

    def keys(self) -> list[str]: ...

    def get_slice(self, name: str) -> _SafetensorsSlice: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...


class HFCheckpoint:
    """config.json + one or many safetensors files (with model.safetensors.index.json)."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.path = folder
        with open(folder / "config.json", encoding="utf-8") as f:
            self.config = ModelConfig.from_hf_dict(json.load(f))
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            # Mistral repos also ship consolidated.safetensors in Mistral's own naming.
            files = [
                p.name
                for p in sorted(folder.glob("*.safetensors"))
                if not p.name.startswith("consolidated")
            ]
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors weights in {folder} (other formats such as "
                "pytorch_model.bin are not supported; convert them to safetensors)"
            )
        self.files = [folder / "config.json", *(folder / name for name in files)]
        self._handles: dict[str, _SafetensorsFile] = {}
        self._file_of: dict[str, str] = {}
        for name in files:
            file = folder / name
            if not file.is_file():
                raise FileNotFoundError(
                    f"{index.name} lists {name}, which is missing from {folder}"
                )
            handle: _SafetensorsFile = safe_open(str(file), framework="pt")
            self._handles[name] = handle
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                self._file_of[key] = name
        self.sources = _hf_sources(self.config)
        self.ignored = {"lm_head.weight"} if self.config.tie_word_embeddings else set()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            key: tuple(self._handles[file].get_slice(key).get_shape())
            for key, file in self._file_of.items()
        }

    def ignorable(self, name: str) -> bool:
        return name in self.ignored or bool(_IGNORED_HF.search(name))

    def load(self, name: str) -> torch.Tensor:
        """The tensor as the file's mapped pages (safetensors maps, never copies)."""
        return self._handles[self._file_of[name]].get_tensor(name)

    def span(self, name: str) -> tuple[int, int]:
        """Where the tensor's bytes are mapped: (address, length)."""
        tensor = self.load(name)
        return tensor.data_ptr(), tensor.numel() * tensor.element_size()

    def kinds(self, names: list[str]) -> None:
        return None  # not GGUF: "auto" keeps it float

    def load_quantized(self, name: str, fmt: str) -> quantized.QuantizedWeight:
        return quantized.from_float(self.load(name), fmt)


class GGUFCheckpoint:
    """A GGUF file: metadata for the config, tensors dequantised to float32 on load."""

    def __init__(self, file: Path) -> None:
        import gguf

        self.path = file
        self.files = [file]
        try:
            self._reader = gguf.GGUFReader(file)
        except (ValueError, OSError) as error:
            raise UnsupportedModelError(f"{file} is not a readable GGUF file: {error}") from error
        self.config = ModelConfig.from_gguf(self._reader)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.sources = _gguf_sources(self.config)
        # llama.cpp interleaves the two RoPE halves of each Q/K head for llama-arch models
        # (its rotation pairs adjacent dims); Qwen's NEOX layout is stored as-is.
        self._unpermute: dict[str, int] = {}
        if self.config.architecture in ("llama", "mistral"):
            for i in range(self.config.num_layers):
                for kind, heads in (("q", self.config.num_heads), ("k", self.config.num_kv_heads)):
                    for suffix in ("weight", "bias"):
                        self._unpermute[f"blk.{i}.attn_{kind}.{suffix}"] = heads

    def shapes(self) -> dict[str, tuple[int, ...]]:
        # GGUF lists dimensions fastest-first; torch's order is the reverse.
        return {name: tuple(int(d) for d in reversed(t.shape)) for name, t in self._tensors.items()}

    def ignorable(self, name: str) -> bool:
        return name in _IGNORED_GGUF

    def kinds(self, names: list[str]) -> list[str]:
        return [self._tensors[name].tensor_type.name for name in names]

    def load(self, name: str) -> torch.Tensor:
        import gguf

        tensor = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        # A plain ndarray view: dequantising a np.memmap slice by slice is ~2x slower.
        array = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        array = self._torch_rows(name, np.asarray(array, dtype=np.float32).reshape(shape))
        # Unquantised tensors come back as read-only views of the file: copy those.
        array = np.ascontiguousarray(array).reshape(shape)
        return torch.from_numpy(array if array.flags.writeable else array.copy())

    def span(self, name: str) -> tuple[int, int]:
        """Where the tensor's bytes are mapped (the reader maps the file): (address,
        length)."""
        data = self._tensors[name].data
        return data.ctypes.data, data.nbytes

    def load_quantized(
        self, name: str, fmt: str
    ) -> quantized.QuantizedWeight | kquants.KQuantWeight:
        """The tensor's blocks (rows in torch's order) converted to `fmt`."""
        tensor = self._tensors[name]
        data = self._torch_rows(name, np.asarray(tensor.data))
        return gguf_blocks.from_gguf(data, tensor.tensor_type.name, fmt)

    def _torch_rows(self, name: str, array: np.ndarray) -> np.ndarray:
        """Rows (dim 0) of `array` in transformers' order. Stored row (head, j, half) holds
        transformers' row (head, half, j) for the Q/K tensors of llama-arch files."""
        heads = self._unpermute.get(name)
        if heads is None:
            return array
        rows = array.shape[0]
        stored = array.reshape(heads, rows // heads // 2, 2, *array.shape[1:])
        unpermuted: np.ndarray = stored.swapaxes(1, 2).reshape(array.shape)
        return unpermuted


Checkpoint: TypeAlias = HFCheckpoint | GGUFCheckpoint


# -- name maps: our parameter -> the checkpoint tensors concatenated (dim 0) into it ------


def _hf_sources(c: ModelConfig) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    return _sources(
        c,
        embed="model.embed_tokens.weight",
        norm="model.norm.weight",
        lm_head="lm_head.weight",
        layer=lambda i, part: (
            f"model.layers.{i}."
            + {
                "input_norm": "input_layernorm.weight",
                "q": "self_attn.q_proj",
                "k": "self_attn.k_proj",
                "v": "self_attn.v_proj",
                "q_norm": "self_attn.q_norm.weight",
                "k_norm": "self_attn.k_norm.weight",
                "o": "self_attn.o_proj",
                "post_norm": "post_attention_layernorm.weight",
                "gate": "mlp.gate_proj.weight",
                "up": "mlp.up_proj.weight",
                "down": "mlp.down_proj.weight",
            }[part]
        ),
    )


def _gguf_sources(c: ModelConfig) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    return _sources(
        c,
        embed="token_embd.weight",
        norm="output_norm.weight",
        lm_head="output.weight",
        layer=lambda i, part: (
            f"blk.{i}."
            + {
                "input_norm": "attn_norm.weight",
                "q": "attn_q",
                "k": "attn_k",
                "v": "attn_v",
                "q_norm": "attn_q_norm.weight",
                "k_norm": "attn_k_norm.weight",
                "o": "attn_output",
                "post_norm": "ffn_norm.weight",
                "gate": "ffn_gate.weight",
                "up": "ffn_up.weight",
                "down": "ffn_down.weight",
            }[part]
        ),
    )


def _sources(
    c: ModelConfig, embed: str, norm: str, lm_head: str, layer: Callable[[int, str], str]
) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Our parameter name -> [(checkpoint name, expected shape)], in concatenation order.
    `layer(i, part)` names a layer tensor; q/k/v/o get ".weight"/".bias" appended."""
    h, hd = c.hidden_size, c.head_dim
    out: dict[str, list[tuple[str, tuple[int, ...]]]] = {
        "embed.weight": [(embed, (c.vocab_size, h))],
        "norm.weight": [(norm, (h,))],
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = [(lm_head, (c.vocab_size, h))]
    for i in range(c.num_layers):
        p = f"layers.{i}."
        qkv_rows = (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size))
        out[p + "input_norm.weight"] = [(layer(i, "input_norm"), (h,))]
        out[p + "qkv.weight"] = [(layer(i, part) + ".weight", (rows, h)) for part, rows in qkv_rows]
        if c.attention_bias:
            out[p + "qkv.bias"] = [(layer(i, part) + ".bias", (rows,)) for part, rows in qkv_rows]
        if c.qk_norm:
            out[p + "q_norm.weight"] = [(layer(i, "q_norm"), (hd,))]
            out[p + "k_norm.weight"] = [(layer(i, "k_norm"), (hd,))]
        out[p + "o_proj.weight"] = [(layer(i, "o") + ".weight", (h, c.q_size))]
        if c.attention_out_bias:
            out[p + "o_proj.bias"] = [(layer(i, "o") + ".bias", (h,))]
        out[p + "post_norm.weight"] = [(layer(i, "post_norm"), (h,))]
        out[p + "gate_up.weight"] = [
            (layer(i, "gate"), (c.intermediate_size, h)),
            (layer(i, "up"), (c.intermediate_size, h)),
        ]
        out[p + "down.weight"] = [(layer(i, "down"), (h, c.intermediate_size))]
    return out


def check_tensors(checkpoint: Checkpoint, config: ModelConfig) -> None:
    """Checks every name and shape before anything loads: one error lists all problems."""
    shapes = checkpoint.shapes()
    wanted = {name: shape for parts in checkpoint.sources.values() for name, shape in parts}
    missing = sorted(name for name in wanted if name not in shapes)
    unexpected = sorted(n for n in shapes if n not in wanted and not checkpoint.ignorable(n))
    mismatched = sorted(
        f"{name}: expected {wanted[name]}, got {shapes[name]}"
        for name in wanted
        if name in shapes and shapes[name] != wanted[name]
    )
    problems = [
        f"{label} ({len(items)}): {', '.join(items[:_LISTED])}"
        + (" ..." if len(items) > _LISTED else "")
        for label, items in (
            ("missing tensors", missing),
            ("unexpected tensors", unexpected),
            ("shape mismatches", mismatched),
        )
        if items
    ]
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {checkpoint.path} does not match its config "
            f"({config.architecture}, {config.num_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_heads} heads / {config.num_kv_heads} kv heads, "
            f"head_dim {config.head_dim}): " + "; ".join(problems)
        )
