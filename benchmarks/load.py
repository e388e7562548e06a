"""Load time and peak memory of each model, first start and second start (issue 40).

For each model of `--models` (GGUF files or Hugging Face folders), a fresh process loads
it with `Engine.from_pretrained` twice in a row, each in its own process: the first start
with an empty weights cache (`--cache-dir`, emptied first: it reads and converts the
file, then writes the cache), the second with the cache the first wrote (it maps it).
Each reports the load's wall time and its phases (the lines `cellbatch run` prints), the
process's peak RSS (ru_maxrss: anonymous memory and the file pages it touched), its RSS
once loaded, the weights' bytes, and the time to its first generated token (the first
step touches every weight: on the second start that reads the cache's pages). The ratio
printed is peak RSS over the model's files' size. The page cache is not dropped (it
needs root): a second start reads the cache from memory when the machine has room for
it, as a server restarted on the same machine does.

    .venv/bin/python benchmarks/load.py --models A.gguf,B/hf [--threads 2]
        [--cache-dir /tmp/cellbatch-load-cache] [--output-json PATH]

Owns: the two starts per model and the table. Never: judges the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from time import perf_counter
from typing import Any

from cellbatch.machine import process_memory

HERE = Path(__file__).resolve().parent


def measure(model: str, cache: str, threads: int) -> dict[str, Any]:
    """One start, in this process (the child side)."""
    from cellbatch.engine import Engine
    from cellbatch.generation_config import GenConfig

    phases: list[tuple[str, float]] = []
    started = perf_counter()
    engine = Engine.from_pretrained(
        model,
        threads=threads,
        weights_cache=cache,
        max_sessions=1,
        progress=lambda what, seconds: phases.append((what, seconds)),
    )
    loaded = perf_counter()
    result: dict[str, Any] = {
        "load_seconds": loaded - started,
        "phases": phases,
        "rss_after_load": process_memory("VmRSS"),
        "rss_file_after_load": process_memory("RssFile"),
        "weights_bytes": engine.weights_bytes,
        "weights": engine.weight_format,
    }
    with engine:
        engine.generate([[1, 2, 3, 4]], GenConfig(max_new_tokens=1))
    result["first_token_seconds"] = perf_counter() - loaded
    # ru_maxrss is in KiB on Linux.
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def _files_bytes(model: Path) -> int:
    if model.is_file():
        return model.stat().st_size
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


def _child(model: str, cache: Path, threads: int) -> dict[str, Any]:
    command = [
        sys.executable,
        str(HERE / "load.py"),
        "--child",
        model,
        "--cache-dir",
        str(cache),
        "--threads",
        str(threads),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{model}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _gib(count: float) -> str:
    return f"{count / 2**30:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated GGUF files or folders")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/cellbatch-load-cache"))
    parser.add_argument("--output-json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, str(args.cache_dir), args.threads)))
        return 0
    if not args.models:
        parser.error("--models is required")
    runs: dict[str, dict[str, Any]] = {}
    for model in args.models.split(","):
        shutil.rmtree(args.cache_dir, ignore_errors=True)
        size = _files_bytes(Path(model))
        for start in ("first", "second"):
            print(f"load bench: {model}, {start} start ...", file=sys.stderr, flush=True)
            result = _child(model, args.cache_dir, args.threads)
            result["files_bytes"] = size
            runs[f"{model} {start}"] = result
            for what, seconds in result["phases"]:
                print(f"    {seconds:7.2f} s  {what}", file=sys.stderr)
    shutil.rmtree(args.cache_dir, ignore_errors=True)
    print(
        f"{'model, start':<60} {'files GiB':>9} {'load s':>7} {'1st tok s':>9} "
        f"{'peak RSS GiB':>12} {'/ files':>7} {'RSS loaded':>10} {'weights GiB':>11}"
    )
    for name, run in runs.items():
        print(
            f"{name[-60:]:<60} {_gib(run['files_bytes']):>9} {run['load_seconds']:>7.1f} "
            f"{run['first_token_seconds']:>9.1f} {_gib(run['peak_rss']):>12} "
            f"{run['peak_rss'] / run['files_bytes']:>7.2f} {_gib(run['rss_after_load']):>10} "
            f"{_gib(run['weights_bytes']):>11}"
        )
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(
            json.dumps({"options": vars(args), "runs": runs}, indent=1, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
