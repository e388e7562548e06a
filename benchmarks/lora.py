"""What LoRA adapters cost: the same work on the base model alone and spread over adapters.

Four modes on one engine (default weights unless --quantize), each round running them
in an order that alternates, so that the machine's drift hits every mode alike:
- P32: the 32 chat prompts at once, at most 64 new tokens, greedy (as the README's P32);
  base: all 32 on the base model; lora: prompt i with adapter i % N;
- D32: the same with 128 new tokens each and no stop token (as the README's D32);
- single: 8 chat prompts one at a time, 64 new tokens, no stop token; base, then each
  with one adapter.
The adapters are made here with PEFT on the model's transformers twin (random A and B,
rank --rank on every linear module, or --targets), unless --adapters names folders.
Prints generated tokens/s per mode (the median of the rounds, and each round's), and
lora against base.

Usage: .venv/bin/python benchmarks/lora.py [--model PATH] [--threads 2] [--loras 4]
       [--rank 16] [--targets q_proj,v_proj] [--rounds 3] [--adapters DIR ...]
       [--quantize auto] [--output-json PATH]

Owns: this comparison's run and its JSON.
Never: judges the figures (it prints them).
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from cellbatch.bench.workload import CHAT_PROMPTS
from cellbatch.engine import Engine
from cellbatch.model.default import default_model_path
from cellbatch.model.lora import MODULE_PRODUCTS
from cellbatch.types import GenConfig

SINGLE_PROMPTS = 8


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model to run (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--loras", type=int, default=4, help="adapters made (default 4)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(MODULE_PRODUCTS), help="modules adapted")
    parser.add_argument("--adapters", nargs="+", type=Path, help="PEFT folders to use instead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", action="append", default=[], help="P32, D32 or single")
    parser.add_argument("--output-json", type=Path)
    return parser.parse_args(argv)


def make_adapters(model: Path, count: int, rank: int, targets: list[str], root: Path) -> list[Path]:
    """`count` random PEFT adapters of `model` (rank `rank` on `targets`) under `root`."""
    from peft import LoraConfig, get_peft_model

    from cellbatch.bench.peers import load_transformers_model

    base = load_transformers_model(model, torch.float32)
    folders = []
    for index in range(count):
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
        )
        wrapped = get_peft_model(copy.deepcopy(base), config)
        generator = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for name, param in wrapped.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
        folders.append(root / f"adapter-{index}")
        wrapped.save_pretrained(folders[-1])
        del wrapped
    return folders


def made_apart(model: Path, count: int, rank: int, targets: list[str], root: Path) -> list[Path]:
    """`make_adapters` in a process of its own: transformers and PEFT left in this one slow
    the engine measured after them (D32 on the base model: 441 tokens/s against 693)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(make_adapters, model, count, rank, targets, root).result()


def run_batch(
    engine: Engine, prompts: list[list[int]], names: list[str | None], new: int, stop: bool
) -> tuple[int, float]:
    """All prompts at once, prompt i with adapter names[i] (one call per adapter, started
    together): (generated tokens, seconds)."""
    groups: dict[str | None, list[list[int]]] = {}
    for prompt, name in zip(prompts, names, strict=True):
        groups.setdefault(name, []).append(prompt)
    stops = None if stop else frozenset()
    started = time.perf_counter()
    batches = [
        engine.generate_async(group, GenConfig(max_new_tokens=new, stop_tokens=stops, adapter=name))
        for name, group in groups.items()
    ]
    results = [result for batch in batches for result in batch.results()]
    seconds = time.perf_counter() - started
    assert all(result.ok for result in results), [r.error for r in results if not r.ok]
    return sum(len(result.tokens) for result in results), seconds


def measure(engine: Engine, names: list[str], rounds: int, skip: list[str]) -> list[dict[str, Any]]:
    prompts = [engine.chat_tokens(text) for text in CHAT_PROMPTS[:32]]
    spread = [names[i % len(names)] for i in range(len(prompts))]
    modes: dict[str, Any] = {}
    if "P32" not in skip:
        modes["P32 base"] = lambda: run_batch(engine, prompts, [None] * 32, 64, True)
        modes["P32 lora"] = lambda: run_batch(engine, prompts, spread, 64, True)
    if "D32" not in skip:
        modes["D32 base"] = lambda: run_batch(engine, prompts, [None] * 32, 128, False)
        modes["D32 lora"] = lambda: run_batch(engine, prompts, spread, 128, False)
    if "single" not in skip:

        def single(adapters: list[str | None]) -> tuple[int, float]:
            tokens, seconds = 0, 0.0
            for index, prompt in enumerate(prompts[:SINGLE_PROMPTS]):
                got, spent = run_batch(
                    engine, [prompt], [adapters[index % len(adapters)]], 64, False
                )
                tokens, seconds = tokens + got, seconds + spent
            return tokens, seconds

        modes["single base"] = lambda: single([None])
        modes["single lora"] = lambda: single(list(names))
    run_batch(engine, prompts[:4], spread[:4], 8, False)  # warm-up
    figures: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_index in range(rounds):
        order = list(modes) if round_index % 2 == 0 else list(modes)[::-1]
        for mode in order:
            tokens, seconds = modes[mode]()
            figures[mode].append(tokens / seconds)
            print(f"round {round_index + 1} {mode}: {tokens / seconds:.1f} tokens/s", flush=True)
    return [
        {
            "mode": mode,
            "tokens_per_s": round(statistics.median(values), 1),
            "rounds_tokens_per_s": [round(v, 1) for v in values],
        }
        for mode, values in figures.items()
    ]


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    model = options.model or default_model_path()
    with tempfile.TemporaryDirectory(prefix="cellbatch-lora-") as scratch:
        folders = options.adapters or made_apart(
            model, options.loras, options.rank, options.targets.split(","), Path(scratch)
        )
        adapters = {f"lora{index}": str(folder) for index, folder in enumerate(folders)}
        with Engine.from_pretrained(
            model,
            threads=options.threads,
            quantize=options.quantize,
            dtype=options.dtype,
            max_sessions=32,
            lora_adapters=adapters,
        ) as engine:
            print(
                f"{model.name}: weights {engine.weight_format}, {engine.dtype}, "
                f"{options.threads} threads; adapters: "
                + ", ".join(
                    f"{a.name} rank {a.rank} on {'/'.join(a.targets)}" for a in engine.adapters()
                ),
                flush=True,
            )
            rows = measure(engine, list(adapters), options.rounds, options.skip)
    by_mode = {row["mode"]: row["tokens_per_s"] for row in rows}
    print(f"{'mode':<14} {'tokens/s':>9}  rounds")
    for row in rows:
        print(f"{row['mode']:<14} {row['tokens_per_s']:>9.1f}  {row['rounds_tokens_per_s']}")
    for workload in ("P32", "D32", "single"):
        if f"{workload} base" in by_mode:
            ratio = by_mode[f"{workload} lora"] / by_mode[f"{workload} base"]
            print(f"{workload}: lora / base = {ratio:.3f}x")
    if options.output_json is not None:
        options.output_json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
