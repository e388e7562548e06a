"""Where one stream's adapter time goes: perf samples of both threads, split by prompt
(base model or adapter) and by the kind of code that ran.

One engine generates --prompts chat prompts one at a time, --new tokens each with no stop
token, every prompt twice, on the base model and with one adapter (prompt i with
adapter i % N), the two in alternating order, --rounds times. `perf record -e cpu-clock`
samples the run (every thread, on the monotonic clock the prompts are timed by); each
sample counts for the prompt running at that moment and for its thread: the engine's
(the one that runs Python) or the other intra-op thread. Prints, per thread and kind
of code, the milliseconds of CPU a generated token costs on the base model and with
the adapter, and the wall time a token took in each (docs/benchmarks.md#lora-adapters).

Kinds: the adapters' kernel (kernels/lora_rows.h), lora_add's checks and plan
(kernels/lora.cpp), int4 and int8 products, attention over cells, the OpenMP runtime
(a thread starting, ending or waiting out a parallel region), Python, the rest.

Usage: .venv/bin/python benchmarks/lora_profile.py [--model PATH] [--threads 2]
       [--loras 4] [--rank 16] [--targets q_proj,v_proj] [--adapters DIR ...]
       [--rounds 3] [--prompts 8] [--new 64] [--output-json PATH]
Needs `perf` (linux-tools) allowed to sample this user's processes
(kernel.perf_event_paranoid at most 2).

Owns: this breakdown's run, its attribution of samples and its JSON.
Never: judges the figures (it prints them).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cellbatch.bench.workload import CHAT_PROMPTS
from cellbatch.model.default import default_model_path
from cellbatch.model.lora import MODULE_PRODUCTS
from lora import made_apart

BASE, ADAPTER = "base", "adapter"
SAMPLES_PER_S = 2000
# (kind, pattern on "symbol (library)"), the first that matches names a sample's kind.
KINDS = (
    ("adapter kernel", re.compile(r"lora_rows::")),
    (
        "lora_add checks and plan",
        re.compile(r"\blora_add\b|\(anonymous namespace\)::(assign|plan|segment_task)\b"),
    ),
    ("int4 products", re.compile(r"Int4(Panels|Tiles|Layout)")),
    ("int8 products", re.compile(r"Int8(Panels|Tiles|Layout)")),
    ("k-quant products", re.compile(r"cellbatch::kq::")),
    ("attention", re.compile(r"CellAttention|cell_attention")),
    ("OpenMP runtime", re.compile(r"\(\S*libgomp[^)]*\)$")),
    ("Python", re.compile(r"\(\S*libpython[^)]*\)$")),
)
OTHER = "other"
# A line of `perf script -F tid,time,ip,sym,dso`: "  1234 10651.162814:  7fa0... sym (dso)".
SAMPLE = re.compile(r"^\s*(\d+)\s+([\d.]+):\s+[0-9a-f]+\s+(.*)$")


@dataclass(frozen=True)
class Span:
    """One prompt's generation: its mode, its monotonic start and end, its tokens."""

    mode: str
    start: float
    end: float
    tokens: int


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loras", type=int, default=4, help="adapters made (default 4)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(MODULE_PRODUCTS), help="modules adapted")
    parser.add_argument("--adapters", nargs="+", default=None, help="PEFT folders instead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--spans", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def kind_of(sample: str) -> str:
    """The kind of code a sample's "symbol (library)" text names."""
    for kind, pattern in KINDS:
        if pattern.search(sample):
            return kind
    return OTHER


def run_prompts(engine: Any, names: list[str], prompts: int, new: int, rounds: int) -> list[Span]:
    """Each of the first `prompts` chat prompts alone on the base model and with adapter
    names[i % N], the order alternating from one prompt and round to the next."""
    from cellbatch.generation_config import GenConfig

    tokens = [engine.chat_tokens(text) for text in CHAT_PROMPTS[:prompts]]
    spans = []
    for round_index in range(rounds):
        for index, prompt in enumerate(tokens):
            order = [BASE, ADAPTER] if (round_index + index) % 2 == 0 else [ADAPTER, BASE]
            for mode in order:
                adapter = names[index % len(names)] if mode == ADAPTER else None
                config = GenConfig(max_new_tokens=new, stop_tokens=frozenset(), adapter=adapter)
                start = time.clock_gettime(time.CLOCK_MONOTONIC)
                (result,) = engine.generate_async([prompt], config).results()
                end = time.clock_gettime(time.CLOCK_MONOTONIC)
                assert result.ok, result.error
                spans.append(Span(mode, start, end, len(result.tokens)))
    return spans


def generate_under_perf(options: argparse.Namespace) -> None:
    """The child's part (--spans): load the engine, warm it, run the prompts, write spans."""
    from cellbatch.engine import Engine
    from cellbatch.generation_config import GenConfig

    adapters = {f"lora{index}": folder for index, folder in enumerate(options.adapters)}
    model = options.model or default_model_path()
    with Engine.from_pretrained(
        model, threads=options.threads, max_sessions=32, lora_adapters=adapters
    ) as engine:
        warm = [engine.chat_tokens(CHAT_PROMPTS[0])]
        for name in [None, *adapters]:
            list(engine.generate_async(warm, GenConfig(max_new_tokens=8, adapter=name)).results())
        spans = run_prompts(engine, list(adapters), options.prompts, options.new, options.rounds)
    options.spans.write_text(json.dumps([span.__dict__ for span in spans]))


def attribute(lines: Iterable[str], spans: list[Span]) -> dict[str, Any]:
    """Counts the samples of `perf script -F tid,time,ip,sym,dso` lines that fall in a
    span, by thread (the engine's: the busier of the two busiest threads in Python) and
    kind, as milliseconds of CPU per generated token of each mode; and the wall time a
    token took in each mode."""
    ordered = sorted(spans, key=lambda span: span.start)
    starts = [span.start for span in ordered]
    counts: Counter[tuple[str, str, str]] = Counter()
    for line in lines:
        matched = SAMPLE.match(line)
        if matched is None:
            continue
        tid, at, text = matched.group(1), float(matched.group(2)), matched.group(3).strip()
        index = bisect.bisect_right(starts, at) - 1
        if index < 0 or at > ordered[index].end:
            continue
        counts[tid, ordered[index].mode, kind_of(text)] += 1
    busy: Counter[str] = Counter()
    python: Counter[str] = Counter()
    for (tid, _, kind), count in counts.items():
        busy[tid] += count
        python[tid] += count if kind == "Python" else 0
    threads = [tid for tid, _ in busy.most_common(2)]
    threads.sort(key=lambda tid: -python[tid])
    tokens = {mode: sum(s.tokens for s in spans if s.mode == mode) for mode in (BASE, ADAPTER)}
    seconds = {mode: sum(s.end - s.start for s in spans if s.mode == mode) for mode in tokens}
    per_token = 1e3 / SAMPLES_PER_S
    rows = []
    for name, tid in zip(("engine", "other"), threads, strict=False):
        for kind in [kind for kind, _ in KINDS] + [OTHER]:
            cpu = {
                mode: round(counts[tid, mode, kind] * per_token / max(tokens[mode], 1), 3)
                for mode in tokens
            }
            rows.append({"thread": name, "kind": kind, **cpu})
    wall = {mode: round(1e3 * seconds[mode] / max(tokens[mode], 1), 3) for mode in tokens}
    return {"rows": rows, "wall_ms_per_token": wall, "tokens": tokens}


def report(result: dict[str, Any]) -> str:
    lines = [f"{'thread':7s} {'kind':26s} {'base':>7s} {'adapter':>8s} {'added':>7s}"]
    for row in result["rows"]:
        added = row[ADAPTER] - row[BASE]
        lines.append(
            f"{row['thread']:7s} {row['kind']:26s} {row[BASE]:7.3f} {row[ADAPTER]:8.3f} "
            f"{added:+7.3f}"
        )
    wall = result["wall_ms_per_token"]
    lines.append("(ms of CPU per generated token)")
    lines.append(
        f"wall ms per token: base {wall[BASE]:.3f}, adapter {wall[ADAPTER]:.3f} "
        f"(+{wall[ADAPTER] - wall[BASE]:.3f}); adapter / base tokens/s "
        f"{wall[BASE] / wall[ADAPTER]:.3f}x"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    if options.spans is not None:
        generate_under_perf(options)
        return 0
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("lora_profile needs `perf` on PATH (linux-tools): install it, then rerun")
    model = options.model or default_model_path()
    with tempfile.TemporaryDirectory(prefix="cellbatch-lora-profile-") as scratch:
        root = Path(scratch)
        folders = options.adapters or made_apart(
            model, options.loras, options.rank, options.targets.split(","), root
        )
        data, spans_file = root / "perf.data", root / "spans.json"
        child = [
            sys.executable, str(Path(__file__).resolve()), "--model", str(model),
            "--threads", str(options.threads), "--rounds", str(options.rounds),
            "--prompts", str(options.prompts), "--new", str(options.new),
            "--spans", str(spans_file), "--adapters", *map(str, folders),
        ]  # fmt: skip
        record = [perf, "record", "-q", "-k", "CLOCK_MONOTONIC", "-F", str(SAMPLES_PER_S)]
        record += ["-e", "cpu-clock", "-o", str(data), "--", *child]
        subprocess.run(record, check=True)
        # No debuginfod: offline, perf would wait on it for every library.
        environment = {**os.environ, "DEBUGINFOD_URLS": ""}
        script = [perf, "script", "-i", str(data), "-F", "tid,time,ip,sym,dso"]
        listing = subprocess.run(
            script, check=True, capture_output=True, text=True, env=environment
        ).stdout
        spans = [Span(**span) for span in json.loads(spans_file.read_text())]
    result = attribute(listing.splitlines(), spans)
    print(f"{model.name}, {options.threads} threads, {len(folders)} adapters")
    print(report(result))
    if options.output_json is not None:
        options.output_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
