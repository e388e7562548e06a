"""Speed, memory and greedy agreement of each weight format (issue 17), beside llama.cpp.

For each format (float32 "none", int8, int4) a fresh process loads the model with that
`quantize` and measures: RSS after load; the chat figures of issue 17's table (the first
`--single-prompts` chat prompts one at a time, "1 request alone"; all `--prompts` at once,
"32 concurrent"), greedy, at most `--max-new-tokens` each; and decode-only tokens/s with
1, 8 and 32 sessions decoding in lockstep. Each format's greedy tokens are compared with
float32's. With `--llama-python PY` (llama-cpp-python built there, see
benchmarks/llama_cpp_peer.py) llama.cpp runs the same prompt tokens one at a time on the
same file (its decode-only figure is its single-token steps).

    .venv/bin/python benchmarks/quantized.py [--threads 2] [--formats none,int8,int4]
        [--prompts 32] [--single-prompts 8] [--max-new-tokens 64] [--sessions 1,8,32]
        [--rounds 2] [--llama-python /tmp/llamacpp-venv/bin/python] [--output-json PATH]
    .venv/bin/python benchmarks/quantized.py --products [--threads 2]   (kernels alone)

Owns: the per-format runs (one process each, so RSS and allocator state start clean) and
the table. Never: judges the figures against targets (it prints them and float32 ratios).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from time import perf_counter
from typing import Any

HERE = Path(__file__).resolve().parent


def _rss() -> int:
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One format, in this process (the child side)."""
    import torch

    from cellbatch.engine import Engine
    from cellbatch.model.default import default_model_path
    from cellbatch.types import GenConfig
    from throughput_peers import cellbatch_generate, decode_sweep_point
    from throughput_workload import CHAT_PROMPTS, WARMUP_TOKENS

    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    before = _rss()
    started = perf_counter()
    engine = Engine.from_pretrained(
        path,
        dtype="float32",
        quantize=args.child,
        threads=args.threads,
        max_sessions=max(args.prompts, *args.sessions),
    )
    result: dict[str, Any] = {
        "rss_before_load": before,
        "rss_after_load": _rss(),
        "load_seconds": perf_counter() - started,
        "weights": engine.weights.format,
        "weight_kernel": engine.weights.kernel,
        "weights_bytes": engine.weights_bytes,
    }
    with engine:
        tokenizer = engine.tokenizer
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": text}])
            for text in CHAT_PROMPTS[: args.prompts]
        ]
        config = GenConfig(max_new_tokens=args.max_new_tokens, stop_tokens=tokenizer.stop_tokens)
        cellbatch_generate(engine, prompts[:2], GenConfig(max_new_tokens=WARMUP_TOKENS))
        single, seconds = [], 0.0
        for prompt in prompts[: args.single_prompts]:
            began = perf_counter()
            single += cellbatch_generate(engine, [prompt], config)[0]
            seconds += perf_counter() - began
        result["single"] = {"outputs": single, "seconds": seconds}
        began = perf_counter()
        outputs, _ = cellbatch_generate(engine, prompts, config)
        result["concurrent"] = {"outputs": outputs, "seconds": perf_counter() - began}
        sweep = {}
        for sessions in args.sessions:
            point = decode_sweep_point(engine, prompts, sessions, args.max_new_tokens)
            sweep[str(sessions)] = point.window.decode_only_tokens_per_s
        result["decode_only"] = sweep
        result["prompts"] = prompts
        result["stop"] = sorted(tokenizer.stop_tokens)
    return result


def _child(args: argparse.Namespace, fmt: str) -> dict[str, Any]:
    command = [sys.executable, str(HERE / "quantized.py"), "--child", fmt]
    for name in ("threads", "prompts", "single_prompts", "max_new_tokens"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--sessions", ",".join(map(str, args.sessions))]
    if args.model:
        command += ["--model", str(args.model)]
    print(f"quantized bench: {fmt} ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{fmt} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout)


def _best(kept: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The faster of two runs of one format, figure by figure (RSS: the lower)."""
    if kept is None:
        return new
    for part in ("single", "concurrent"):
        if new[part]["seconds"] < kept[part]["seconds"]:
            kept[part] = new[part]
    for sessions, rate in new["decode_only"].items():
        kept["decode_only"][sessions] = max(rate, kept["decode_only"][sessions])
    kept["rss_after_load"] = min(kept["rss_after_load"], new["rss_after_load"])
    return kept


def products(threads: int) -> None:
    """Microseconds per call of the default model's product shapes, per kernel and row
    count (interleaved, best of 5): what `quantized.weight_kernel` chose from."""
    import torch

    torch.set_num_threads(threads)
    shapes = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    shapes["lm_head"] = (49152, 576)
    group = 32
    print(f"products, {threads} threads, {torch.backends.cpu.get_cpu_capability()}: us per call")
    for name, (n, k) in shapes.items():
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        zeros = torch.rand(k // group, n, 2) * 0.01
        codes8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale8 = torch.rand(n) * 0.01
        dense = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k) * 0.02, None)
        for rows in (1, 8, 32):
            x = torch.randn(rows, k)
            xb = x.bfloat16()
            aten, mkldnn = torch.ops.aten, torch.ops.mkldnn
            zeros16, scale16 = zeros.bfloat16(), scale8.bfloat16()
            calls = {
                "fp32 oneDNN": (mkldnn._linear_pointwise, (x, dense, None, "none", [], "")),
                "int4 bf16": (aten._weight_int4pack_mm_for_cpu, (xb, packed4, group, zeros16)),
                "int8 bf16": (aten._weight_int8pack_mm, (xb, codes8, scale16)),
                "int4 fp32": (aten._weight_int4pack_mm_for_cpu, (x, packed4, group, zeros)),
                "int8 fp32": (aten._weight_int8pack_mm, (x, codes8, scale8)),
            }
            best = dict.fromkeys(calls, float("inf"))
            for _ in range(5):
                for label, (op, operands) in calls.items():
                    began = perf_counter()
                    op(*operands)
                    best[label] = min(best[label], perf_counter() - began)
            cells = " ".join(f"{label} {seconds * 1e6:8.0f}" for label, seconds in best.items())
            print(f"{name:<8} rows {rows:>2}: {cells}", flush=True)


def _tokens(outputs: list[list[int]]) -> int:
    return sum(len(o) for o in outputs)


def _agreement(outputs: list[list[int]], reference: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(outputs, reference, strict=True))
    return f"{same}/{len(reference)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="default: SmolLM2-135M-Instruct Q4_1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--formats", default="none,int8,int4")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--single-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--sessions", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 32]
    )
    parser.add_argument("--llama-python", help="Python with llama-cpp-python (optional)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per format, best kept")
    parser.add_argument("--products", action="store_true", help="only the per-kernel products")
    parser.add_argument("--output-json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.products:
        products(args.threads)
        return 0
    if args.child:
        json.dump(measure(args), sys.stdout)
        return 0

    runs: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):  # formats alternate, so a load swing hits them all
        for fmt in args.formats.split(","):
            runs[fmt] = _best(runs.get(fmt), _child(args, fmt))
    first = next(iter(runs.values()))
    if args.llama_python:
        from cellbatch.model.default import default_model_path
        from llama_cpp_peer import ask

        request = {
            "task": "generate",
            "model": str(args.model or default_model_path()),
            "threads": args.threads,
            "prompts": first["prompts"][: args.single_prompts],
            "max_new_tokens": args.max_new_tokens,
            "stop": first["stop"],
        }
        try:
            answer = ask(args.llama_python, request)
            runs["llama.cpp"] = {
                "weights": "the file (Q4_1 here)",
                "single": {"outputs": answer["outputs"], "seconds": answer["seconds"]},
                "decode_only": {"1": answer["decode_tokens"] / answer["decode_seconds"]},
            }
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
            print(f"llama.cpp skipped: {error}", file=sys.stderr)
    else:
        print("llama.cpp skipped: no --llama-python given", file=sys.stderr)

    reference = runs.get("none")
    header = (
        f"{'peer':<10} {'weights':<34} {'RSS MiB':>8} {'single t/s':>10} {'32-conc t/s':>11} "
        + " ".join(f"{'dec@' + str(s):>8}" for s in args.sessions)
        + f" {'agree 1':>8} {'agree 32':>8}"
    )
    print(header)
    for name, run in runs.items():
        single = run["single"]
        conc = run.get("concurrent")
        rss = run.get("rss_after_load")
        row = (
            f"{name:<10} {run['weights']:<34} "
            f"{rss / 2**20 if rss else float('nan'):>8.0f} "
            f"{_tokens(single['outputs']) / single['seconds']:>10.1f} "
            f"{_tokens(conc['outputs']) / conc['seconds'] if conc else float('nan'):>11.1f} "
            + " ".join(
                f"{run['decode_only'].get(str(s), float('nan')):>8.1f}" for s in args.sessions
            )
        )
        if reference is not None:
            row += f" {_agreement(single['outputs'], reference['single']['outputs']):>8}"
            agree = _agreement(conc["outputs"], reference["concurrent"]["outputs"]) if conc else "-"
            row += f" {agree:>8}"
        print(row)
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(
            json.dumps(
                {"options": vars(args) | {"model": str(args.model)}, "runs": runs},
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
