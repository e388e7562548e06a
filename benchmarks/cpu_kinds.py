"""The engine's modes as another CPU kind runs them, measured on this machine: the checkout
against an earlier commit (or alone), each mode in its own process, tokens compared.

An AVX512 CPU runs what an AVX2 CPU would when torch, oneDNN and MKL are capped at AVX2
(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2) and the
compiled kernels are built for that capability: cellbatch's own AVX512 paths ask torch's
capability beside the CPU's features (`cellbatch.model.cpu`, kernels/common.h), so they
stay off. Each tree (the checkout's `src`, and `--against REV`'s from git) is copied into
`--workdir` and its kernels built there under the caps; the checkout's own build is not
touched. The instructions are the other kind's; the memory, caches and clock stay this
machine's, so the figures compare commits and modes, not machines. Revisions older than
`cellbatch.model.cpu` chose by the CPU's features alone: under the caps their bf16 modes
pack weights for oneDNN's AVX512 bf16 path, which refuses (such a mode shows "failed").

Per mode (QUANTIZE:DTYPE, as `Engine.from_pretrained` takes them), 2 threads by default:
single = 4 chat prompts one at a time, 128 tokens each past EOS (median); P32 = the 32
chat prompts at once, at most 64 new tokens, stopping at EOS; D32 = the 32 prompts, 128
tokens each past EOS. Rounds interleave the trees, and the best of the rounds is kept.

    python benchmarks/cpu_kinds.py --kind avx2 --against 8e6ac69 \\
        --modes auto:float32,none:float32,auto:bfloat16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
# The switches that make torch, oneDNN and MKL run as on the kind, and the capability torch
# then reports (what the kernels' build must say it was built for).
KINDS: dict[str, tuple[dict[str, str], str]] = {
    "avx2": (
        {
            "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        },
        "AVX2",
    ),
}
PARTS = ("single", "p32", "d32")
TREE_FILES = ("src", "setup.py", "pyproject.toml")


def kind_environment(kind: str) -> dict[str, str]:
    """This process's environment with the kind's caps."""
    caps, _ = KINDS[kind]
    return {**os.environ, **caps, "HF_HUB_OFFLINE": "1"}


def copy_tree(revision: str | None, destination: Path) -> None:
    """The package sources of the checkout (revision None: as they are now, uncommitted
    edits included) or of a git revision, into `destination` (over what it holds)."""
    destination.mkdir(parents=True, exist_ok=True)
    if revision is None:
        shutil.rmtree(destination / "src", ignore_errors=True)  # files deleted since go too
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", *TREE_FILES],
            cwd=CHECKOUT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for name in listed:
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(CHECKOUT / name, target)
        return
    archive = destination / "tree.tar"
    with archive.open("wb") as file:
        subprocess.run(
            ["git", "archive", revision, *TREE_FILES], cwd=CHECKOUT, stdout=file, check=True
        )
    with tarfile.open(archive) as tar:
        tar.extractall(destination, filter="data")
    archive.unlink()


def build_kernels(tree: Path, kind: str) -> None:
    """Builds the tree's kernels under the kind's caps; raises with the build's last lines
    when the library is missing or was built for another capability."""
    done = subprocess.run(
        [sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"],
        cwd=tree,
        env=kind_environment(kind),
        capture_output=True,
        text=True,
    )
    info = tree / "src/cellbatch/model/kernels/_C.json"
    built = json.loads(info.read_text()) if info.is_file() else {}
    if built.get("capability") != KINDS[kind][1]:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"the kernels of {tree} did not build for {kind}:\n{tail}")


def tokens_digest(token_lists: Sequence[Sequence[int]]) -> str:
    """A short digest of generated tokens, to compare runs without printing them."""
    return hashlib.sha256(repr([tuple(tokens) for tokens in token_lists]).encode()).hexdigest()[:12]


def measure(model: str | None, mode: str, parts: Sequence[str], threads: int) -> dict[str, object]:
    """Runs in the child: loads `model` (None: the embedded default) in `mode` and times
    the parts. It calls only what older revisions have too (Engine.from_pretrained,
    generate, GenConfig), not quantized.py's measurement, which uses newer helpers."""
    from cellbatch.bench.workload import CHAT_PROMPTS
    from cellbatch.engine import Engine
    from cellbatch.generation_config import GenConfig

    quantize, dtype = mode.split(":")
    engine = Engine.from_pretrained(model, threads=threads, quantize=quantize, dtype=dtype)
    result: dict[str, object] = {"kernels": engine.kernels, "dtype": str(engine.dtype)}
    prompts = [engine.chat_tokens([{"role": "user", "content": text}]) for text in CHAT_PROMPTS]
    past_eos = GenConfig(max_new_tokens=128, stop_tokens=frozenset())
    engine.generate([prompts[0]], GenConfig(max_new_tokens=16, stop_tokens=frozenset()))
    if "single" in parts:
        rates, outputs = [], []
        for prompt in prompts[:4]:
            start = time.perf_counter()
            (output,) = engine.generate([prompt], past_eos)
            rates.append(128 / (time.perf_counter() - start))
            outputs.append(output.tokens)
        result["single"], result["single tokens"] = statistics.median(rates), tokens_digest(outputs)
    for part, config in (("p32", GenConfig(max_new_tokens=64)), ("d32", past_eos)):
        if part in parts:
            start = time.perf_counter()
            outputs = [output.tokens for output in engine.generate(prompts[:32], config)]
            seconds = time.perf_counter() - start
            result[part] = sum(len(tokens) for tokens in outputs) / seconds
            result[f"{part} tokens"] = tokens_digest(outputs)
    engine.close()
    return result


def run_child(
    tree: Path, kind: str, model: str | None, mode: str, parts: Sequence[str], threads: int
) -> dict:
    """One mode measured in a fresh process on `tree` under the kind's caps."""
    env = {**kind_environment(kind), "PYTHONPATH": str(tree / "src")}
    command = [sys.executable, __file__, "--child", mode, "--parts", ",".join(parts)]
    if model is not None:
        command += ["--model", model]
    done = subprocess.run(
        [*command, "--threads", str(threads)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        return {"failed": lines[-1][-300:]}
    return dict(json.loads(done.stdout.splitlines()[-1]))


def best_of(runs: list[dict], part: str) -> float | None:
    """The best figure of the runs that did not fail (None when all failed)."""
    figures = [float(run[part]) for run in runs if "failed" not in run]
    return max(figures) if figures else None


def cell(value: float | None, unit: str = "") -> str:
    return "failed" if value is None else f"{value:.{2 if unit else 1}f}{unit}"


def report(results: dict[str, dict[str, list[dict]]], parts: Sequence[str]) -> str:
    """A markdown table: each mode's best figure per tree, the ratio of the checkout to
    the earlier tree, and whether their tokens were the same."""
    trees = list(next(iter(results.values())))
    header = ["mode", *(f"{part} {tree}" for part in parts for tree in trees)]
    if len(trees) == 2:
        header += [f"{part} ratio" for part in parts] + ["same tokens"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for mode, by_tree in results.items():
        row = [mode]
        row += [cell(best_of(by_tree[tree], part)) for part in parts for tree in trees]
        if len(trees) == 2:
            earlier, now = (by_tree[tree] for tree in trees)
            for part in parts:
                before, after = best_of(earlier, part), best_of(now, part)
                row.append(cell(None if before is None or after is None else after / before, "x"))
            ran = [run for run in earlier + now if "failed" not in run]
            same = len(ran) == len(earlier + now) and all(
                run[f"{part} tokens"] == ran[0][f"{part} tokens"] for part in parts for run in ran
            )
            row.append("yes" if same else "no")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=sorted(KINDS), default="avx2")
    parser.add_argument("--against", help="a git revision to measure beside the checkout")
    parser.add_argument("--model", help="a model path (default: the embedded SmolLM2)")
    parser.add_argument("--modes", default="auto:float32,none:float32")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, help="where the trees go (default: a temp dir)")
    parser.add_argument("--child", metavar="MODE", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    parts = options.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; use some of {', '.join(PARTS)}")
    modes = options.modes.split(",")
    if malformed := [mode for mode in modes if mode.count(":") != 1]:
        parser.error(f"modes {malformed} are not QUANTIZE:DTYPE; write e.g. auto:float32")
    if options.child:
        print(json.dumps(measure(options.model, options.child, parts, options.threads)))
        return
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="cellbatch-kinds-"))
    trees = {"checkout": workdir / "checkout"}
    if options.against:
        trees = {options.against: workdir / "against", **trees}
    for name, tree in trees.items():
        # A revision's tree is reused as built; the checkout's is refreshed each run (its
        # build folder stays, so only edited kernels recompile).
        if name == "checkout" or not (tree / "src/cellbatch/model/kernels/_C.json").is_file():
            copy_tree(None if name == "checkout" else name, tree)
            build_kernels(tree, options.kind)
        print(f"{name}: {tree} (kernels built for {options.kind})", flush=True)
    results: dict[str, dict[str, list[dict]]] = {
        mode: {name: [] for name in trees} for mode in modes
    }
    for round_number in range(options.rounds):
        for mode in modes:
            for name, tree in trees.items():
                run = run_child(tree, options.kind, options.model, mode, parts, options.threads)
                results[mode][name].append(run)
                figures = run.get("failed") or ", ".join(
                    f"{part} {run[part]:.1f}" for part in parts
                )
                print(f"round {round_number + 1}, {mode}, {name}: {figures}", flush=True)
    print(report(results, parts))


if __name__ == "__main__":
    main()
