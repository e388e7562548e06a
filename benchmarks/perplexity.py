"""Perplexity of each weight format on a fixed text, and llama.cpp's on the file.

The text is benchmarks/data/perplexity.txt (self-written, ~2,900 tokens of the default
model's tokenizer). It is cut into chunks of `--context` tokens; each chunk runs as one
prefill and the second half of its tokens are scored (as llama.cpp's llama-perplexity
does), so every token is predicted from at least context/2 tokens of its chunk.
Perplexity = exp(mean negative log-likelihood). cellbatch runs each mode of `--formats`
(QUANTIZE[:DTYPE[:ACTIVATIONS[:KV]]] as benchmarks/quantized.py takes them: float32
"none", int8 and int4 by default; "auto:auto" is the default mode, "auto:auto:auto:int8"
the same with the int8 KV cache, whose K/V every scored token reads) on the same file;
with `--llama-python PY` (a Python where llama-cpp-python is built, see
benchmarks/llama_cpp_peer.py) llama.cpp scores the same token ids on the same file.

    .venv/bin/python benchmarks/perplexity.py [--model M] [--context 512] [--threads N]
        [--formats none,int8,int4] [--llama-python /tmp/llamacpp-venv/bin/python]
        [--output-json benchmarks/results/perplexity.json]

Owns: the scoring rule and the table. Never: judges the figures (it prints them, with
each mode's ratio to none:float32).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from cellbatch.cache import CellCache
from cellbatch.kv_pool import KVPool
from cellbatch.model.default import default_model_path
from cellbatch.model.loading import load_model
from cellbatch.model.tokenizer import load_tokenizer
from cellbatch.model.transformer import resolve_kv_dtype
from cellbatch.model.weights_summary import describe
from cellbatch.threads import in_short_lived_thread
from llama_cpp_peer import ask
from quantized import mode_options, weights_label

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def chunk_nll(model: torch.nn.Module, tokens: Sequence[int], kv_dtype: torch.dtype) -> list[float]:
    """Negative log-likelihoods of the second half of `tokens`, prefilled as one step (each
    layer stores the chunk's K/V in the pool, then attends over the stored K/V)."""
    config = model.config
    count = len(tokens)
    cache = CellCache(capacity=count)
    pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim, count, kv_dtype)
    seq = cache.seq_alloc()
    seq_ids, positions = np.full(count, seq), np.arange(count)
    assert cache.declare_step(seq_ids)
    cells = cache.place_step(seq_ids, positions)
    pool.ensure(cache.high_water())
    plan = cache.attention_plan(seq_ids, positions, cells)
    rows = torch.arange(count // 2, count - 1)
    with torch.no_grad():
        logits = model(
            torch.tensor(tokens),
            torch.from_numpy(positions),
            plan,
            pool,
            torch.from_numpy(cells),
            rows,
        )
    targets = torch.tensor(tokens)[rows + 1]
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    return (-log_probs[torch.arange(len(rows)), targets]).tolist()


def cellbatch_nll(path: Path, mode: str, tokens: list[int], context: int) -> dict:
    quantize, dtype, activations, kv_name = mode_options(mode)

    def run() -> dict:
        _, model = load_model(path, dtype, "auto", quantize, activations=activations)
        kv_dtype = resolve_kv_dtype(kv_name, model.dtype)
        nll = [
            value
            for start in range(0, len(tokens) - context + 1, context)
            for value in chunk_nll(model, tokens[start : start + context], kv_dtype)
        ]
        weights = weights_label(describe(model).format, model.dtype)
        return {"nll": nll, "weights": f"{weights}, KV {str(kv_dtype).removeprefix('torch.')}"}

    return in_short_lived_thread(run)  # one OpenMP team, as the engine has (cellbatch.threads)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a GGUF file (default: SmolLM2-135M Q4_1)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--formats", default="none,int8,int4")
    parser.add_argument("--llama-python", help="Python with llama-cpp-python (optional)")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    tokens = load_tokenizer(path).encode(TEXT.read_text(encoding="utf-8"))
    print(f"{TEXT.name}: {len(tokens)} tokens, chunks of {args.context}", file=sys.stderr)
    results: dict[str, dict] = {}
    for quantize in args.formats.split(","):
        results[f"cellbatch {quantize}"] = cellbatch_nll(path, quantize, tokens, args.context)
        print(f"cellbatch {quantize}: done", file=sys.stderr)
    if args.llama_python:
        request = {
            "task": "perplexity",
            "model": str(path),
            "threads": args.threads,
            "tokens": tokens,
            "context": args.context,
        }
        try:
            results["llama.cpp (file as is)"] = ask(args.llama_python, request)
        except (RuntimeError, OSError) as error:
            print(f"llama.cpp skipped: {error}", file=sys.stderr)
    else:
        print("llama.cpp skipped: no --llama-python given", file=sys.stderr)
    base = next(
        (r for n, r in results.items() if mode_options(n.split()[-1])[:2] == ("none", "float32")),
        None,
    )
    base_ppl = math.exp(float(np.mean(base["nll"]))) if base else None
    print(f"{'peer':<28} {'weights':<44} {'scored':>6} {'perplexity':>10} {'vs fp32':>8}")
    for name, result in results.items():
        result["tokens_scored"] = len(result["nll"])
        result["perplexity"] = math.exp(float(np.mean(result["nll"])))
        ratio = f"{result['perplexity'] / base_ppl:.4f}" if base_ppl else "-"
        print(
            f"{name:<28} {result.get('weights', 'the file (Q4_1 here)'):<44} "
            f"{result['tokens_scored']:>6} {result['perplexity']:>10.4f} {ratio:>8}"
        )
    if args.output_json:
        summary = {
            name: {k: v for k, v in result.items() if k != "nll"}
            for name, result in results.items()
        }
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps({"context": args.context, **summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
