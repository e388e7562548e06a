"""Optimistic admission against worst-case reservation when KV cells are short (issue 11).

64 greedy generations of at most 256 new tokens each, on the chat prompts of the
throughput benchmark (each prompt's chat-template tokens; the 32 prompts in turn), go
through `Engine.generate` on two engines that differ only in `admission`: "optimistic"
(start what fits now, preempt the newest generation when a step lacks cells) and
"reserve" (start only what fits at its worst case, prompt + max_new_tokens). The cell
pool holds 16 worst cases: max_cells = 16 x (longest prompt + 256); max_sessions 64.
The two modes run in turn (A B A B ...) so that a noisy machine slows both alike.
Prints, per mode, the median tokens/s, the peak number of generations running at once,
preemptions and recomputed tokens, the ratio of the medians, and whether the greedy
tokens are the same in both modes (they must be). Writes benchmarks/results/
kv-pressure-<dtype>[-quick].json.

Usage: .venv/bin/python benchmarks/kv_pressure.py [--dtype float32|bfloat16] [--quick]
       [--generations N] [--max-new-tokens N] [--repeats N] [--model PATH]  (--help)

Owns: one KV-pressure run: its options, the two engines, the order of the timed calls,
the agreement check between the modes, the printed table and the JSON.
Promises: both modes get the same prompt tokens, dtype, threads, pool and session limit;
each mode's counters are taken over its own timed calls only (the peak is the largest
seen by its engine); the exit status is 0 when every call succeeded and the modes'
tokens agree, 1 otherwise; a bad option exits with a usage error before any model loads.
Never: judges throughput against the target ratio (it prints both), or reaches into
the engine beyond its public API.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from cellbatch.bench.peers import cellbatch_generate, progress
from cellbatch.bench.report import Agreement, compare, dump_json
from cellbatch.bench.results import cpu_name
from cellbatch.bench.throughput import _load_average
from cellbatch.bench.workload import CHAT_PROMPTS, WARMUP_PROMPTS, WARMUP_TOKENS
from cellbatch.generation_config import GenConfig
from cellbatch.metrics import EngineMetrics
from cellbatch.types import QUANTIZE_CHOICES, Token

OPTIMISTIC = "optimistic"
RESERVE = "reserve"
MODES = (OPTIMISTIC, RESERVE)

DEFAULT_GENERATIONS = 64
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_WORST_CASES = 16
DEFAULT_MAX_SESSIONS = 64
DEFAULT_REPEATS = 3
QUICK_GENERATIONS = 16
QUICK_MAX_NEW_TOKENS = 64
QUICK_WORST_CASES = 4
QUICK_REPEATS = 1
TARGET_RATIO = 2.0  # what optimistic admission is for: >= 2x reserve's tokens/s here
# EngineMetrics counters a ModeRun takes over its own call.
_PER_CALL_COUNTERS = (
    "preemptions",
    "recomputed_tokens",
    "sessions_reclaimed",
    "deferred_for_cells",
)


@dataclass(frozen=True)
class PressureOptions:
    model: Path | None  # None: the embedded default model
    dtype: str
    quantize: str
    threads: int
    generations: int
    max_new_tokens: int
    worst_cases: int  # the pool holds this many worst cases (longest prompt + max_new_tokens)
    max_sessions: int
    repeats: int
    quick: bool
    output_json: Path


@dataclass
class ModeRun:
    """One timed `Engine.generate` call of one mode."""

    mode: str
    repeat: int
    seconds: float = 0.0
    outputs: list[list[Token]] = field(default_factory=list)
    error: str = ""
    preemptions: int = 0
    recomputed_tokens: int = 0
    sessions_reclaimed: int = 0
    deferred_for_cells: int = 0
    steps: int = 0
    mean_decode_sessions_per_step: float = 0.0

    @property
    def generated_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def count(self, before: EngineMetrics, after: EngineMetrics) -> None:
        """The engine's counters over this call."""
        for name in _PER_CALL_COUNTERS:
            setattr(self, name, getattr(after, name) - getattr(before, name))
        self.steps = after.steps - before.steps
        decodes = after.decode_sessions - before.decode_sessions
        self.mean_decode_sessions_per_step = decodes / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["outputs"]
        return {
            **fields,
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": self.tokens_per_s,
        }


@dataclass
class PressureReport:
    options: PressureOptions
    environment: dict[str, Any]
    prompt_lengths: list[int]
    max_cells: int
    runs: list[ModeRun] = field(default_factory=list)
    peak_concurrent_generations: dict[str, int] = field(default_factory=dict)

    def mode_runs(self, mode: str) -> list[ModeRun]:
        return [run for run in self.runs if run.mode == mode]

    @property
    def ok(self) -> bool:
        return bool(self.runs) and not any(run.error for run in self.runs)

    def median_tokens_per_s(self, mode: str) -> float:
        rates = [run.tokens_per_s for run in self.mode_runs(mode) if not run.error]
        return statistics.median(rates) if rates else 0.0

    def ratio(self) -> float | None:
        """Optimistic's median tokens/s over reserve's."""
        reserve = self.median_tokens_per_s(RESERVE)
        return self.median_tokens_per_s(OPTIMISTIC) / reserve if reserve > 0 else None

    def agreement(self) -> Agreement | None:
        """Optimistic's tokens against reserve's, from each mode's first good call."""
        firsts = [next((r for r in self.mode_runs(m) if not r.error), None) for m in MODES]
        if firsts[0] is None or firsts[1] is None:
            return None
        return compare(firsts[0].outputs, firsts[1].outputs)

    def repeats_agree(self) -> bool:
        """Every good call of a mode gave the tokens of that mode's first one."""
        for mode in MODES:
            outputs = [run.outputs for run in self.mode_runs(mode) if not run.error]
            if any(other != outputs[0] for other in outputs[1:]):
                return False
        return True

    @property
    def tokens_agree(self) -> bool:
        agreement = self.agreement()
        return (
            agreement is not None
            and agreement.identical == agreement.total
            and self.repeats_agree()
        )

    def as_dict(self) -> dict[str, Any]:
        options = dataclasses.asdict(self.options)
        options.update(
            model=str(self.options.model) if self.options.model else None,
            output_json=str(self.options.output_json),
        )
        agreement = self.agreement()
        return {
            "options": options,
            "environment": self.environment,
            "prompt_tokens": self.prompt_lengths,
            "max_cells": self.max_cells,
            "modes": {
                mode: {
                    "median_tokens_per_s": self.median_tokens_per_s(mode),
                    "peak_concurrent_generations": self.peak_concurrent_generations.get(mode),
                    "runs": [run.as_dict() for run in self.mode_runs(mode)],
                    "outputs": next(
                        (run.outputs for run in self.mode_runs(mode) if not run.error), []
                    ),
                }
                for mode in MODES
            },
            "ratio_optimistic_over_reserve": self.ratio(),
            "target_ratio": TARGET_RATIO,
            "agreement": None
            if agreement is None
            else {
                "identical": agreement.identical,
                "total": agreement.total,
                "divergences": [dataclasses.asdict(d) for d in agreement.divergences],
            },
            "repeats_agree": self.repeats_agree(),
        }


def parse_options(argv: Sequence[str] | None = None) -> PressureOptions:
    """Options with every default resolved; bad values exit with a usage error."""
    parser = argparse.ArgumentParser(
        prog="kv_pressure.py",
        description="tokens/s, peak concurrency and preemptions with optimistic admission "
        "vs worst-case reservation, on a KV pool that holds a few worst cases",
    )
    parser.add_argument("--model", type=Path, help="HF folder or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--quantize",
        default="none",
        choices=QUANTIZE_CHOICES,
        help="weight format of both engines (default none: the float weights)",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--generations", type=int, help=f"default {DEFAULT_GENERATIONS} (the prompts in turn)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, help=f"per generation (default {DEFAULT_MAX_NEW_TOKENS})"
    )
    parser.add_argument(
        "--worst-cases",
        type=int,
        help="the pool holds this many worst cases, longest prompt + max-new-tokens "
        f"(default {DEFAULT_WORST_CASES})",
    )
    parser.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS)
    parser.add_argument(
        "--repeats", type=int, help=f"timed calls per mode (default {DEFAULT_REPEATS})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_GENERATIONS} generations, {QUICK_MAX_NEW_TOKENS} new tokens, "
        f"{QUICK_WORST_CASES} worst cases, {QUICK_REPEATS} repeat",
    )
    parser.add_argument(
        "--output-json", type=Path, help="default benchmarks/results/kv-pressure-<dtype>.json"
    )
    args = parser.parse_args(argv)
    if args.model is not None and not args.model.exists():
        parser.error(f"--model {args.model} does not exist: give a model folder or a .gguf file")
    quick = args.quick
    resolved = {
        "generations": (args.generations, QUICK_GENERATIONS, DEFAULT_GENERATIONS),
        "max-new-tokens": (args.max_new_tokens, QUICK_MAX_NEW_TOKENS, DEFAULT_MAX_NEW_TOKENS),
        "worst-cases": (args.worst_cases, QUICK_WORST_CASES, DEFAULT_WORST_CASES),
        "repeats": (args.repeats, QUICK_REPEATS, DEFAULT_REPEATS),
        "max-sessions": (args.max_sessions, args.max_sessions, args.max_sessions),
        "threads": (args.threads, torch.get_num_threads(), torch.get_num_threads()),
    }
    values: dict[str, int] = {}
    for name, (given, quick_value, default) in resolved.items():
        value = given if given is not None else (quick_value if quick else default)
        if value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
        values[name] = value
    output = args.output_json or Path("benchmarks/results") / (
        f"kv-pressure-{args.dtype}{'-quick' if quick else ''}.json"
    )
    return PressureOptions(
        model=args.model,
        dtype=args.dtype,
        quantize=args.quantize,
        threads=values["threads"],
        generations=values["generations"],
        max_new_tokens=values["max-new-tokens"],
        worst_cases=values["worst-cases"],
        max_sessions=values["max-sessions"],
        repeats=values["repeats"],
        quick=quick,
        output_json=output,
    )


def run_benchmark(options: PressureOptions) -> PressureReport:
    from cellbatch.engine import Engine
    from cellbatch.model.default import default_model_path
    from cellbatch.model.tokenizer import load_tokenizer

    torch.set_num_threads(options.threads)
    path = options.model or default_model_path()
    tokenizer = load_tokenizer(path)
    chat = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in CHAT_PROMPTS
    ]
    prompts = [chat[index % len(chat)] for index in range(options.generations)]
    max_cells = options.worst_cases * (max(map(len, prompts)) + options.max_new_tokens)
    environment = {
        "model": str(path),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "threads": options.threads,
        "cores": os.cpu_count(),
        "load_average_1min_at_start": _load_average(),
    }
    report = PressureReport(options, environment, [len(p) for p in prompts], max_cells)
    config = GenConfig(max_new_tokens=options.max_new_tokens)  # the model's stop tokens
    engines = {}
    try:
        for mode in MODES:
            progress(f"loading {path} with {mode} admission, {max_cells} cells")
            engines[mode] = Engine.from_pretrained(
                path,
                dtype=options.dtype,
                quantize=options.quantize,
                threads=options.threads,
                admission=mode,
                max_cells=max_cells,
                max_sessions=options.max_sessions,
            )
            engines[mode].generate(prompts[:WARMUP_PROMPTS], max_new_tokens=WARMUP_TOKENS)
        for repeat in range(options.repeats):
            for mode in MODES:
                report.runs.append(_timed_call(engines[mode], mode, repeat, prompts, config))
        for mode, engine in engines.items():
            report.peak_concurrent_generations[mode] = engine.metrics().peak_concurrent_generations
    finally:
        for engine in engines.values():
            engine.close()
    report.environment["load_average_1min_at_end"] = _load_average()
    return report


def _timed_call(
    engine: Any, mode: str, repeat: int, prompts: list[list[Token]], config: GenConfig
) -> ModeRun:
    run = ModeRun(mode, repeat)
    before = engine.metrics()
    started = perf_counter()
    try:
        run.outputs, _ = cellbatch_generate(engine, prompts, config)
    except Exception as error:  # reported; the other calls still run
        run.error = f"{type(error).__name__}: {error}"
    run.seconds = perf_counter() - started
    run.count(before, engine.metrics())
    progress(
        f"{mode} #{repeat + 1}: {run.generated_tokens} tokens in {run.seconds:.1f} s "
        f"({run.tokens_per_s:.1f} tokens/s), {run.preemptions} preemptions"
        + (f"; failed: {run.error}" if run.error else "")
    )
    return run


def format_report(report: PressureReport) -> str:
    options = report.options
    longest = max(report.prompt_lengths)
    lines = [
        f"KV pressure: {options.generations} greedy generations of at most "
        f"{options.max_new_tokens} new tokens, {options.dtype}, weights {options.quantize}, "
        f"{options.threads} threads; "
        f"pool {report.max_cells} cells = {options.worst_cases} x ({longest} + "
        f"{options.max_new_tokens}), {options.max_sessions} sessions; prompts "
        f"{min(report.prompt_lengths)}-{longest} tokens",
        "",
        f"{'admission':<11} {'tokens/s':>9}  {'per call':<24} {'peak gens':>9} "
        f"{'preempt':>8} {'recomputed':>10} {'reclaimed':>9} {'dec/step':>8}",
    ]
    for mode in MODES:
        runs = report.mode_runs(mode)
        good = [run for run in runs if not run.error]
        calls = ", ".join("failed" if run.error else f"{run.tokens_per_s:.1f}" for run in runs)
        last = good[-1] if good else None
        lines.append(
            f"{mode:<11} {report.median_tokens_per_s(mode):>9.1f}  {calls:<24} "
            f"{report.peak_concurrent_generations.get(mode, 0):>9} "
            + (
                f"{_median(good, 'preemptions'):>8} {_median(good, 'recomputed_tokens'):>10} "
                f"{_median(good, 'sessions_reclaimed'):>9} "
                f"{last.mean_decode_sessions_per_step:>8.1f}"
                if last is not None
                else ""
            )
        )
    ratio = report.ratio()
    lines.append("")
    lines.append(
        "optimistic / reserve tokens/s (medians): "
        + (f"{ratio:.2f}x" if ratio is not None else "n/a")
        + f"  (issue target >= {TARGET_RATIO:g}x)"
    )
    agreement = report.agreement()
    if agreement is None:
        lines.append("greedy tokens: not compared (a mode has no successful call)")
    else:
        lines.append(
            f"greedy tokens: {agreement.identical}/{agreement.total} generations identical "
            "between the modes"
            + ("" if agreement.identical == agreement.total else " (MUST be all: a bug)")
        )
        for divergence in agreement.divergences[:5]:
            lines.append(
                f"  generation {divergence.prompt}: first differs at token {divergence.index} "
                f"(optimistic {divergence.ours}, reserve {divergence.reference})"
            )
    if not report.repeats_agree():
        lines.append("greedy tokens: a repeat of a mode differs from its first call (a bug)")
    for run in report.runs:
        if run.error:
            lines.append(f"{run.mode} #{run.repeat + 1} failed: {run.error}")
    environment = report.environment
    load = (
        environment.get("load_average_1min_at_start"),
        environment.get("load_average_1min_at_end"),
    )
    if None not in load:
        lines.append(
            f"machine: load {load[0]:.1f} at start, {load[1]:.1f} at end, on "
            f"{environment.get('cores')} cores"
        )
    lines.append(
        "(peak gens: the most generations running at once over the mode's calls; "
        "preempt/recomputed/reclaimed: per call, median; dec/step: decodes per step)"
    )
    return "\n".join(lines)


def _median(runs: list[ModeRun], name: str) -> int:
    return round(statistics.median(getattr(run, name) for run in runs))


def main(argv: Sequence[str] | None = None) -> int:
    """0 when every call succeeded and the modes' greedy tokens agree, else 1."""
    options = parse_options(argv)
    report = run_benchmark(options)
    print(format_report(report))
    dump_json(report.as_dict(), options.output_json)
    progress(f"figures written to {options.output_json}")
    return 0 if report.ok and report.tokens_agree else 1


if __name__ == "__main__":
    sys.exit(main())
