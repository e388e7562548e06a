"""An exported program against the eager model (issue 12): the same workload, in one run.

On the throughput benchmark's workload (its chat prompts, greedy, at most 64 new tokens)
and its decode sweep (sessions decoding in lockstep), for the default model (or --model):
generated tokens/s and decode-only tokens/s at 1, 8 and 32 sessions for ModuleExecutor
(the eager model) and ProgramExecutor (the exported program); whether their greedy tokens
agree; the export time (when this run exports); the time from process start to the
first token of a program and of the model; and the 1-session decode against the
memory-bandwidth bound (the weights read once per step at a measured read bandwidth).

Each engine runs in a process of its own (two OpenMP teams in one process slow each
other), and the two alternate for --rounds rounds, so that a shared machine's load hits
both alike; the figures are each round's and their median, with the program's ratio to
the eager model per round.

Usage: .venv/bin/python benchmarks/program_throughput.py [--program model.pt2]
       [--dtype float32] [--quantize none] [--threads 2] [--prompts 32] [--max-new-tokens 64]
       [--sessions 1,8,32] [--rounds 2] [--output-json PATH]
Without --program it exports the model first (`cellbatch export`'s defaults but for
--dtype and --quantize, timed). Both engines take --quantize (default none: float weights).

Owns: this comparison's run and its JSON.
Never: judges the figures (it prints them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cellbatch.bench.peers import cellbatch_generate, decode_sweep_point, progress
from cellbatch.bench.workload import CHAT_PROMPTS, WARMUP_TOKENS
from cellbatch.generation_config import GenConfig
from cellbatch.types import QUANTIZE_CHOICES

RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = ("module", "program")
_FIRST_TOKEN = """
import sys
from cellbatch.engine import Engine
source, dtype, quantize, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
engine = Engine.from_pretrained(source, dtype=dtype, quantize=quantize, threads=threads)
engine.chat(["Hello"], max_new_tokens=1)
print("first token", flush=True)
engine.close()
"""


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model to export and compare (default: SmolLM2)")
    parser.add_argument("--program", type=Path, help="a program of that model (else exported)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--quantize", default="none", choices=QUANTIZE_CHOICES, help="weights of both (none: float)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sessions", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-json", type=Path, default=RESULTS / "program-throughput.json")
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    from cellbatch.model.default import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    if args.child is not None:  # one engine's figures, as JSON on the last line
        source = model if args.child == "module" else args.program
        print(json.dumps(measure(source, args)), flush=True)
        return 0
    result: dict[str, Any] = {
        "model": str(model),
        "dtype": args.dtype,
        "quantize": args.quantize,
        "threads": args.threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_1min_at_start": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory() as scratch:
        if args.program is None:
            args.program = Path(scratch) / "model.pt2"
            result["export_seconds"] = export(model, args.program, args)
        rounds = []
        for index in range(args.rounds):
            figures = {name: child(name, model, args) for name in ENGINES}
            for name in ENGINES:
                figures[name]["first_token_seconds"] = first_token(
                    model if name == "module" else args.program, args
                )
            progress(f"round {index + 1}: {json.dumps(ratios(figures))}")
            for name in ENGINES:
                del figures[name]["outputs"]
            rounds.append(figures)
    result["rounds"] = rounds
    result["median"] = {name: median([r[name] for r in rounds]) for name in ENGINES}
    result["program_over_module"] = ratios(result["median"])
    result["greedy_agreement"] = rounds[0]["agreement"]
    result["memory_bound"] = memory_bound(result["median"])
    result["load_average_1min_at_end"] = os.getloadavg()[0]
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(result, indent=1) + "\n")
    progress(f"figures written to {args.output_json}")
    return 0


def export(model: Path, program: Path, args: argparse.Namespace) -> float:
    progress(f"exporting {model} to {program}")
    started = time.perf_counter()
    command = [sys.executable, "-c", "import sys; from cellbatch.cli import main; sys.exit(main())"]
    options = ["export", "--model", str(model), "-o", str(program), "--dtype", args.dtype]
    options += ["--quantize", args.quantize]
    subprocess.run([*command, *options, "--threads", str(args.threads)], check=True)
    return round(time.perf_counter() - started, 1)


def child(name: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One engine's figures, measured in a process of its own."""
    command = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--model",
        str(model),
        "--program",
        str(args.program),
        "--dtype",
        args.dtype,
        "--quantize",
        args.quantize,
        "--threads",
        str(args.threads),
        "--prompts",
        str(args.prompts),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--sessions",
        args.sessions,
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(source: Path, args: argparse.Namespace) -> dict[str, Any]:
    from cellbatch.engine import Engine
    from cellbatch.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model or source)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}])
        for text in CHAT_PROMPTS[: args.prompts]
    ]
    sessions = [int(s) for s in args.sessions.split(",")]
    started = time.perf_counter()
    engine = Engine.from_pretrained(
        source,
        dtype=args.dtype,
        quantize=args.quantize,
        threads=args.threads,
        max_sessions=max(len(prompts), *sessions),
    )
    figures: dict[str, Any] = {
        "executor": engine.executor_kind,
        "load_seconds": round(time.perf_counter() - started, 2),
        "weights_bytes": engine.weights_bytes,
    }
    with engine:
        config = GenConfig(max_new_tokens=args.max_new_tokens, stop_tokens=tokenizer.stop_tokens)
        cellbatch_generate(engine, prompts[:2], GenConfig(max_new_tokens=WARMUP_TOKENS))
        begun = time.perf_counter()
        outputs, _ = cellbatch_generate(engine, prompts, config)
        generated = sum(len(tokens) for tokens in outputs)
        figures["tokens_per_second"] = round(generated / (time.perf_counter() - begun), 1)
        figures["generated_tokens"] = generated
        figures["outputs"] = outputs
        decode_sweep_point(engine, prompts, 1, WARMUP_TOKENS)
        for count in sessions:
            point = decode_sweep_point(engine, prompts, count, args.max_new_tokens)
            rate = point.window.decode_only_tokens_per_s
            figures[f"decode_only_tokens_per_second_{count}"] = round(rate, 1)
            progress(f"{figures['executor']}: {count} sessions: {rate:.1f} decode-only tokens/s")
    figures["load_average_1min"] = os.getloadavg()[0]
    return figures


def ratios(figures: dict[str, Any]) -> dict[str, Any]:
    """program / module for every rate, and the greedy agreement when both have outputs."""
    module, program = figures["module"], figures["program"]
    out: dict[str, Any] = {
        key: round(program[key] / module[key], 2)
        for key in module
        if (key.endswith("per_second") or "per_second_" in key) and module[key]
    }
    out["first_token_speedup"] = round(
        module["first_token_seconds"] / program["first_token_seconds"], 2
    )
    if "outputs" in module and "outputs" in program:
        same = sum(a == b for a, b in zip(module["outputs"], program["outputs"], strict=True))
        figures["agreement"] = f"{same}/{len(module['outputs'])}"
        out["agreement"] = figures["agreement"]
    return out


def median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        key: statistics.median(r[key] for r in rounds)
        for key, value in rounds[0].items()
        if isinstance(value, (int, float))
    }


def first_token(source: Path, args: argparse.Namespace) -> float:
    """Seconds from starting a fresh process to its first generated token."""
    started = time.perf_counter()
    command = [sys.executable, "-c", _FIRST_TOKEN, str(source), args.dtype, args.quantize]
    command.append(str(args.threads))
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        for line in process.stdout:
            if line.startswith("first token"):
                return round(time.perf_counter() - started, 2)
    raise RuntimeError(f"{source}: the child process produced no token")


def memory_bound(figures: dict[str, Any]) -> dict[str, Any]:
    """The 1-session decode against reading the weights once per step at the measured
    read bandwidth (a 1 GiB float32 sum on the run's threads, best of 5)."""
    data = torch.ones(2**28)
    best = min(_timed(data.sum) for _ in range(5))
    bandwidth = data.numel() * data.element_size() / best
    # A decode step reads every product's weights once: the program's stored weights
    # (the embedding is only gathered from, but the tied LM head reads as much).
    weights = figures["program"]["weights_bytes"]
    bound = bandwidth / weights  # steps per second: one token each at 1 session
    return {
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "weights_bytes": weights,
        "bound_tokens_per_second_1": round(bound, 1),
        **{
            f"{name}_fraction_of_bound": round(
                figures[name]["decode_only_tokens_per_second_1"] / bound, 2
            )
            for name in ENGINES
        },
    }


def _timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(main())
