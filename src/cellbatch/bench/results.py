"""What every published benchmark result carries: the machine it ran on, the command that
printed it, and the tables and headline figures the documentation shows.

A benchmark writes one JSON file per run; the keys below sit at its top level beside the
benchmark's own details (`results_fields`). `cellbatch bench --report`
(`cellbatch.bench.publish`) renders every such file under `docs/results/` into
README.md and docs/benchmarks.md, so no figure reaches the docs without its command and
machine.

Owns: `machine()` (CPU name and kind, cores, threads, versions, commit), `cpu_name()`,
`ResultTable`, `Headline`, `results_fields` (the published keys), `command_line` (the
command as typed).
Promises: the CPU kind is read from the CPU's own feature flags and torch's vector width,
the same questions `auto` asks (`cellbatch.model.cpu`), never assumed; every value is
JSON-ready.
Never: runs, times or renders anything.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The feature flags (as /proc/cpuinfo names them) that decide what `auto` picks.
KIND_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
)
# The keys a results file must carry to be published.
RESULTS_KEYS = ("benchmark", "title", "command", "machine", "date", "tables", "headline")


@dataclass(frozen=True)
class ResultTable:
    """One table of figures as the docs show it: a caption, column names, rows of cells
    (text or numbers; numbers are printed with one decimal)."""

    caption: str
    columns: Sequence[str]
    rows: Sequence[Sequence[str | float | int | None]]
    note: str = ""


@dataclass(frozen=True)
class Headline:
    """One comparison for the README's headline table: cellbatch's figure against a peer's,
    measured in the same run."""

    what: str
    cellbatch: float
    peer: str
    peer_value: float
    unit: str = "tokens/s"

    @property
    def ratio(self) -> float:
        return self.cellbatch / self.peer_value if self.peer_value > 0 else 0.0


@dataclass(frozen=True)
class Results:
    """The published part of one benchmark run."""

    benchmark: str  # the file's stem in docs/results: throughput, quantized, serve_load
    title: str
    command: str
    tables: Sequence[ResultTable]
    headline: Sequence[Headline] = ()
    plot: str | None = None  # a PNG beside the JSON, by file name
    machine: dict[str, Any] = field(default_factory=lambda: machine())


def results_fields(results: Results) -> dict[str, Any]:
    """The top-level keys of a results file (merge the benchmark's own details beside them)."""
    return {
        "benchmark": results.benchmark,
        "title": results.title,
        "command": results.command,
        "machine": results.machine,
        "date": datetime.date.today().isoformat(),
        "tables": [asdict(table) for table in results.tables],
        "headline": [{**asdict(line), "ratio": line.ratio} for line in results.headline],
        "plot": results.plot,
    }


def command_line(program: str, argv: Sequence[str]) -> str:
    """The command as a user types it: `program` and the arguments, shell-quoted."""
    return " ".join([program, *(shlex.quote(arg) for arg in argv)])


def machine(threads: int | None = None) -> dict[str, Any]:
    """The machine a figure was measured on: its CPU and kind, cores, threads, versions."""
    import torch

    from cellbatch.model.cpu import cpu_dtype

    flags = _cpu_flags()
    return {
        "cpu": cpu_name(),
        "cpu_kind": cpu_kind(flags, torch.backends.cpu.get_cpu_capability()),
        "flags": [flag for flag in KIND_FLAGS if flag in flags],
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "auto_dtype": str(cpu_dtype()).removeprefix("torch."),
        "cores": os.cpu_count(),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cellbatch_commit": _commit(),
    }


def cpu_kind(flags: set[str] | frozenset[str], capability: str) -> str:
    """The CPU kind in the words the docs use: the vector width torch runs at, and the
    bf16 and int8 product instructions there."""
    if capability != "AVX512":
        return "AVX2" if capability == "AVX2" else capability
    extras = [
        name
        for flag, name in (
            ("avx512_bf16", "BF16"),
            ("avx512_vnni", "VNNI"),
            ("avx512_fp16", "FP16"),
        )
        if flag in flags
    ]
    kind = "AVX512" + (f" ({', '.join(extras)})" if extras else "")
    return kind + (" + AMX" if "amx_bf16" in flags or "amx_int8" in flags else ", no AMX")


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_name() -> str:
    """The CPU's model name, as the OS gives it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str | None:
    """The checkout's commit (with `+dirty` when it has changes), None outside one."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _git(*args: str) -> str:
    """What a git command prints, run in the package's folder."""
    done = subprocess.run(
        ["git", *args],
        cwd=Path(__file__).resolve().parent,
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    return done.stdout.strip()
