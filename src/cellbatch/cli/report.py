"""The report of `cellbatch run`: memory probes, the JSON report and its printout.

Owns: `rss_bytes`, `memory_snapshot`, `RunRecord` (what a run hands the report),
`build_report` (the JSON report, whose schema docs/running.md documents) and
`print_report`.
Promises: one entry per prompt line, in input order, failed lines included with their
problem; where torch sees a CUDA GPU, each memory snapshot holds its allocated and
reserved bytes (torch's caching allocator), and a run on a GPU reports its executor
(graphs captured and replayed, decode widths, weight copies).
Never: runs generations.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from cellbatch.cli.prompts import PromptLine
from cellbatch.executor.cuda_executor import CudaExecutor
from cellbatch.generation_config import GenConfig
from cellbatch.types import Token

if TYPE_CHECKING:
    from cellbatch.engine import Engine, GenerationResult
    from cellbatch.metrics import EngineMetrics


def rss_bytes() -> int:
    """The process's resident set size now (not its peak)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_snapshot() -> dict[str, int]:
    # torch first, so that "before load" holds the runtime however far the imports got.
    import torch

    snapshot = {"rss_bytes": rss_bytes()}
    if torch.cuda.is_available():
        snapshot["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        snapshot["cuda_reserved_bytes"] = torch.cuda.memory_reserved()
    return snapshot


@dataclass(frozen=True)
class RunRecord:
    """What one run did, for its report: the prompt lines, the (index, tokens) of those
    that ran with their results, the others' problems, the options and the figures."""

    prompts: list[PromptLine]
    inputs: list[tuple[int, list[Token]]]
    failures: dict[int, str]
    results: list[GenerationResult]
    config: GenConfig
    stop: list[str]
    memory: dict[str, dict[str, int]]
    generate_seconds: float
    load_seconds: float


def build_report(run: RunRecord, engine: Engine, metrics: EngineMetrics) -> dict[str, Any]:
    prompts = run.prompts
    generations: list[dict[str, Any]] = [{} for _ in prompts]
    for index, problem in run.failures.items():
        generations[index] = _generation_entry(prompts[index], [], 0, [], "", "failed", problem)
    for (index, tokens), result in zip(run.inputs, run.results, strict=True):
        error = f"{prompts[index].source}: {result.error}" if result.error else ""
        generations[index] = _generation_entry(
            prompts[index],
            tokens,
            result.shared_prefix_tokens,
            result.tokens,
            result.text,
            str(result.finish_reason),
            error,
        )
    generated = sum(len(entry["tokens"]) for entry in generations)
    executor = engine.executor
    return {
        "generations": generations,
        "memory": run.memory,
        "kv": asdict(engine.kv_usage()),
        "weights_bytes": engine.weights_bytes,
        "config": {
            "model": str(engine.model_path),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_dtype": str(engine.kv_dtype).removeprefix("torch."),
            "kernels": engine.kernels,
            "executor": engine.executor_kind,
            "device": str(engine.device),
            "weight_format": engine.weights.format,
            "weight_formats": engine.weights.formats,
            "weight_kernel": engine.weights.kernel,
            "weights_bytes_by_format": engine.weights.bytes_by_format,
            "admission": engine.admission.value,
            "speculative": asdict(engine.speculative) if engine.speculative else None,
            "threads": _threads(),
            "placement": engine.placement.reason if engine.placement else "",
            "max_new_tokens": run.config.max_new_tokens,
            "temperature": run.config.sampling.temperature,
            "top_p": run.config.sampling.top_p,
            "top_k": run.config.sampling.top_k,
            "seed": run.config.seed,
            "stop": list(run.stop),
            "stop_tokens": sorted(engine.stop_tokens),
            **asdict(engine.shape),
        },
        "timing": {
            "load_seconds": run.load_seconds,
            "generate_seconds": run.generate_seconds,
            "generated_tokens": generated,
            "tokens_per_second": generated / run.generate_seconds
            if run.generate_seconds > 0
            else 0.0,
        },
        "engine": metrics.as_dict(),
        **({"cuda": executor.stats()} if isinstance(executor, CudaExecutor) else {}),
    }


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _generation_entry(
    prompt: PromptLine,
    prompt_tokens: list[Token],
    shared_prefix_tokens: int,
    tokens: list[Token],
    text: str,
    finish_reason: str,
    error: str,
) -> dict[str, Any]:
    return {
        "source": prompt.source,
        "prompt": prompt.raw,
        "prompt_tokens": len(prompt_tokens),
        "shared_prefix_tokens": shared_prefix_tokens,
        "tokens": tokens,
        "text": text,
        "finish_reason": finish_reason,
        "error": error,
        "adapter": prompt.adapter,
    }


def print_report(report: dict[str, Any], engine_text: str) -> None:
    kv = report["kv"]
    for number, entry in enumerate(report["generations"], start=1):
        adapter = f" (adapter {entry['adapter']})" if entry["adapter"] else ""
        print(f"=== [{number}] {entry['source']}{adapter} ===")
        print(f">>> {entry['prompt']}")
        if entry["error"]:
            print(f"!!! {entry['finish_reason']}: {entry['error']}")
        else:
            print(entry["text"])
        print(
            f"--- {entry['finish_reason']}, {entry['prompt_tokens']} prompt tokens "
            f"({entry['shared_prefix_tokens']} shared with the other prompts), "
            f"{len(entry['tokens'])} generated"
        )
        print()
    print("=== engine ===")
    print(engine_text)
    print("=== KV pool ===")
    print(
        f"cells in use {kv['cells_in_use']} of {kv['max_cells']}, pool rows {kv['pool_rows']}, "
        f"allocated {_mib(kv['allocated_bytes'])}, growths {kv['growth_count']}, "
        f"{kv['bytes_per_cell']} bytes per cell ({report['config']['kv_dtype']}: "
        f"{_mib(1000 * kv['bytes_per_cell'])} per 1,000 tokens of a session)"
    )
    print("=== memory ===")
    for stage in ("before_load", "after_load", "after_generate"):
        snapshot = report["memory"][stage]
        extra = (
            f", CUDA allocated {_mib(snapshot['cuda_allocated_bytes'])}, reserved "
            f"{_mib(snapshot['cuda_reserved_bytes'])}"
            if "cuda_allocated_bytes" in snapshot
            else ""
        )
        print(f"{stage.replace('_', ' '):>15}: RSS {_mib(snapshot['rss_bytes'])}{extra}")
    by_format = report["config"]["weights_bytes_by_format"]
    parts = ", ".join(f"{name} {_mib(count)}" for name, count in by_format.items())
    print(
        f"{'weights':>15}: {_mib(report['weights_bytes'])} ({parts}; "
        f"{report['config']['weight_format']})"
    )
    cuda = report.get("cuda")
    if cuda is not None:
        graphs = cuda["graphs"]
        print(f"=== {cuda['device']} ===")
        print(
            f"CUDA graphs {'on' if cuda['cuda_graph'] else 'off'}: {graphs['captures']} "
            f"captured ({graphs['recaptures']} again after {cuda['pool_growths']} pool "
            f"growths), {graphs['replays']} replays, {graphs['eager_runs']} eager decode "
            f"calls; decode widths {cuda['decode_widths']}, prefill from "
            f"{cuda['min_prefill_tokens']} tokens; {cuda['attention']} attention; "
            f"{cuda['weight_copies']} copy(ies) of the weights"
        )
    timing = report["timing"]
    print("=== throughput ===")
    print(
        f"{timing['generated_tokens']} tokens in {timing['generate_seconds']:.2f} s: "
        f"{timing['tokens_per_second']:.1f} tokens/s (load {timing['load_seconds']:.2f} s)"
    )


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"
