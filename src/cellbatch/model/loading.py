"""Weight loading: a Hugging Face folder or a GGUF file -> (ModelConfig, PackedTransformer).

Owns: finding a checkpoint's files (`locate_model`), reading its config, and mapping its
tensors (transformers names or llama.cpp names) onto the fused layout of
`PackedTransformer` (q/k/v concatenated into `qkv`, gate/up into `gate_up`).
Promises: every parameter of the model comes from the checkpoint, converted to the
requested dtype, or loading fails with one error naming every missing, unexpected and
mis-shaped tensor (expected vs got); GGUF tensors are dequantised to float32 first, and
llama.cpp's interleaved Q/K row order (llama-arch RoPE) is undone.
Never: downloads anything, initialises weights randomly (the model is built on the meta
device and the loaded tensors are assigned), or keeps the checkpoint open after loading.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cellbatch.model.config import ModelConfig, UnsupportedModelError
from cellbatch.model.transformer import PackedTransformer, resolve_dtype

# Checkpoint tensors that carry nothing the model needs.
_IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_IGNORED_GGUF = frozenset({"rope_freqs.weight"})  # read into ModelConfig.rope_scaling
_LISTED = 8  # names quoted per kind of problem in a mismatch error


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match what its config describes."""


@dataclass(frozen=True)
class ModelFiles:
    """Where a model lives: kind "hf" (`path` is the folder) or "gguf" (`path` is the file)."""

    kind: str
    path: Path

    @property
    def folder(self) -> Path:
        return self.path if self.kind == "hf" else self.path.parent


def locate_model(path: str | Path) -> ModelFiles:
    """A Hugging Face folder (config.json + *.safetensors), a .gguf file, or a folder
    holding exactly one .gguf file and no config.json."""
    path = Path(path).expanduser()
    usage = "pass a Hugging Face folder (config.json + *.safetensors) or a .gguf file"
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist; {usage}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UnsupportedModelError(f"model file {path} is not a .gguf file; {usage}")
        return ModelFiles("gguf", path)
    if (path / "config.json").is_file():
        return ModelFiles("hf", path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelFiles("gguf", ggufs[0])
    found = f"{len(ggufs)} .gguf files" if ggufs else "neither config.json nor a .gguf file"
    raise FileNotFoundError(f"model folder {path} holds {found}; {usage}")


def load_model(
    path: str | Path, dtype: str | torch.dtype = "auto", kernels: str = "auto"
) -> tuple[ModelConfig, PackedTransformer]:
    """Loads the model at `path` with weights in `dtype` ("auto", "float32", ...) and
    `kernels` ("auto", "compiled", "torch": see PackedTransformer)."""
    files = locate_model(path)
    torch_dtype = resolve_dtype(dtype)
    checkpoint = _HFCheckpoint(files.path) if files.kind == "hf" else _GGUFCheckpoint(files.path)
    config = checkpoint.config
    model = PackedTransformer(config, dtype=torch_dtype, device="meta", kernels=kernels)
    state = _assemble(checkpoint, config, torch_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_rope("cpu")
    model.requires_grad_(False)
    model.pack_linears()
    return config, model.eval()


# -- checkpoints -------------------------------------------------------------------


class _HFCheckpoint:
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
        self._handles = {}
        self._file_of: dict[str, str] = {}
        for name in files:
            file = folder / name
            if not file.is_file():
                raise FileNotFoundError(
                    f"{index.name} lists {name}, which is missing from {folder}"
                )
            handle = safe_open(str(file), framework="pt")
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
        return self._handles[self._file_of[name]].get_tensor(name)


class _GGUFCheckpoint:
    """A GGUF file: metadata for the config, tensors dequantised to float32 on load."""

    def __init__(self, file: Path) -> None:
        import gguf

        self.path = file
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

    def load(self, name: str) -> torch.Tensor:
        import gguf

        tensor = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        # A plain ndarray view: dequantising a np.memmap slice by slice is ~2x slower.
        array = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        array = np.asarray(array, dtype=np.float32).reshape(shape)
        heads = self._unpermute.get(name)
        if heads is not None:
            # Stored row (head, j, half) holds transformers' row (head, half, j).
            array = array.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2)
        # Unquantised tensors come back as read-only views of the file: copy those.
        array = np.ascontiguousarray(array).reshape(shape)
        return torch.from_numpy(array if array.flags.writeable else array.copy())


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


def _assemble(
    checkpoint: _HFCheckpoint | _GGUFCheckpoint, config: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Checks every name and shape first (one error listing all problems), then loads."""
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
    return {
        target: torch.cat([checkpoint.load(name).to(dtype) for name, _ in parts])
        if len(parts) > 1
        else checkpoint.load(parts[0][0]).to(dtype)
        for target, parts in checkpoint.sources.items()
    }
