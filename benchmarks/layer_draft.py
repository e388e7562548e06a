"""A draft model for benchmarks/speculative.py: the default model cut to its first N layers.

No smaller model shares SmolLM2's tokenizer, so the draft-model figures use this one:
the default model's embeddings, first N transformer layers, final norm and head, with
its real weights (the early-exit draft of self-speculative decoding, untrained for it).
Its acceptance and speed are real for such a draft; a draft trained for the target
would be accepted more often.

Written as a Hugging Face folder (from the float32 folder that vLLM's peer reads, made
once from the GGUF) and as a GGUF file quantized like the default model (Q4_1, through
llama.cpp's converter and llama-quantize), so that cellbatch and llama.cpp draft with
the same weights:

    .venv/bin/python benchmarks/layer_draft.py --layers 8 [--out DIR]
        -> DIR/SmolLM2-135M-Instruct-L8/ and DIR/SmolLM2-135M-Instruct-L8.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import llama_cpp_tools
from cellbatch.bench.vllm_peer import vllm_folder
from cellbatch.bench.workload import DEFAULT_PEER_CACHE
from cellbatch.model.default import default_model_path


def cut(source: Path, layers: int, out: Path) -> Path:
    """The Hugging Face folder `source` with its first `layers` layers only."""
    from safetensors.torch import load_file, save_file

    folder = out / f"SmolLM2-135M-Instruct-L{layers}"
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be in [1, {config['num_hidden_layers']})")
    config["num_hidden_layers"] = layers
    weights = load_file(str(source / "model.safetensors"))
    kept = {
        name: tensor
        for name, tensor in weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    save_file(kept, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for item in source.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            shutil.copy(item, folder / item.name)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def gguf(folder: Path, kind: str = "Q4_1") -> Path:
    """`folder` as a GGUF file of `kind` beside it."""
    out = folder.with_name(f"{folder.name}.{kind}.gguf")
    if out.exists():
        return out
    plain = folder.with_name(f"{folder.name}.f32.gguf")
    converter = [str(llama_cpp_tools.venv_python()), str(llama_cpp_tools.converter())]
    convert = [*converter, str(folder), "--outtype", "f32", "--outfile", str(plain)]
    subprocess.run(convert, check=True)
    quantize = llama_cpp_tools.binary("llama-quantize")
    subprocess.run([str(quantize), str(plain), str(out), kind], check=True)
    plain.unlink()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=Path, default=DEFAULT_PEER_CACHE)
    options = parser.parse_args()
    source = vllm_folder(default_model_path(), DEFAULT_PEER_CACHE)
    folder = cut(source, options.layers, options.out)
    print(folder)
    print(gguf(folder))


if __name__ == "__main__":
    main()
