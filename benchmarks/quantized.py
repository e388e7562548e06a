"""Speed, memory and greedy agreement of each weight format and mode, beside llama.cpp.

For each mode (`--formats`: QUANTIZE[:DTYPE[:ACTIVATIONS[:KV]]], the `--quantize`,
`--dtype`, `--activations` and `--kv-dtype` options of `cellbatch run`, DTYPE float32,
ACTIVATIONS auto and KV the weight dtype when left out; "auto:auto" is what a user gets by
default, "auto:auto:auto:int8" the same with the int8 KV cache)
a fresh process loads the model so and measures: RSS after load; the chat figures (the
first `--single-prompts` chat prompts one at a time, "1 request alone"; all `--prompts`
at once, "32 concurrent"), greedy, at most `--max-new-tokens` each; and
decode-only tokens/s with 1, 8 and 32 sessions decoding in lockstep; the KV bytes per
cell. Each mode's greedy tokens are compared with `--reference`'s (default: the parity
mode, none:float32): how many outputs are identical, and in brackets the mean length of
their common prefix in tokens. `--program PATH` adds the same
figures for a program of the model (`cellbatch export`, e.g. with its default `--quantize
auto`), run by ProgramExecutor. With
`--llama-python PY` (llama-cpp-python built there, see benchmarks/llama_cpp_peer.py)
llama.cpp runs the same prompt tokens one at a time on the same file (its decode-only
figure is its single-token steps).

    .venv/bin/python benchmarks/quantized.py [--threads 2]
        [--formats none,int8,int4,auto:auto,none:bfloat16] [--reference none:float32]
        [--prompts 32] [--single-prompts 8] [--max-new-tokens 64] [--sessions 1,8,32]
        [--rounds 2] [--program model.pt2] [--llama-python /tmp/llamacpp-venv/bin/python]
        [--output-json PATH]   (docs/results/quantized.json publishes it: docs/benchmarks.md)
    .venv/bin/python benchmarks/quantized.py --products [--threads 2] [--rows 1,8,32]
        [--passes 15] [--layers 30]   (the model's products alone, per kernel)
        [--shapes 1b --kernels "Q4_K a8 vnni,Q4_K a8 amx,Q6_K a8 vnni,Q6_K a8 amx"]

Owns: the per-format runs (one process each, so RSS and allocator state start clean) and
the table. Never: judges the figures against targets (it prints them and float32 ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any

from cellbatch.bench.results import (
    Headline,
    Results,
    ResultTable,
    command_line,
    machine,
    results_fields,
)

if TYPE_CHECKING:  # the parent process never imports torch: only the children run models
    import torch

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

    from cellbatch.bench.peers import cellbatch_generate, decode_sweep_point
    from cellbatch.bench.workload import CHAT_PROMPTS, WARMUP_TOKENS
    from cellbatch.engine import Engine
    from cellbatch.generation_config import GenConfig
    from cellbatch.model.default import default_model_path

    torch.set_num_threads(args.threads)
    program = args.child.endswith(".pt2")
    path = args.child if program else args.model or default_model_path()
    quantize, dtype, activations, kv_dtype = (
        ("auto", "auto", "auto", None) if program else mode_options(args.child)
    )
    before = _rss()
    started = perf_counter()
    engine = Engine.from_pretrained(
        path,
        dtype=dtype,
        kv_dtype=kv_dtype,
        quantize=quantize,
        activations=activations,
        threads=args.threads,
        max_sessions=max(args.prompts, *args.sessions),
    )
    result: dict[str, Any] = {
        "rss_before_load": before,
        "rss_after_load": _rss(),
        "load_seconds": perf_counter() - started,
        "weights": weights_label(engine.weights.format, engine.dtype),
        "weight_kernel": engine.weights.kernel,
        "weights_bytes": engine.weights_bytes,
        "kv_dtype": str(engine.kv_dtype).removeprefix("torch."),
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
        result["kv_bytes_per_cell"] = engine.kv_usage().bytes_per_cell  # the pool exists now
    return result


def mode_options(spec: str) -> tuple[str, str, str, str | None]:
    """A --formats entry, QUANTIZE[:DTYPE[:ACTIVATIONS[:KV]]] (DTYPE float32, ACTIVATIONS
    auto and KV None, the weight dtype, when left out): its quantize, dtype, activations
    and kv_dtype options, as `cellbatch run` takes them ("auto:auto" is the default)."""
    quantize, _, rest = spec.partition(":")
    dtype, _, rest = rest.partition(":")
    activations, _, kv_dtype = rest.partition(":")
    return quantize, dtype or "float32", activations or "auto", kv_dtype or None


def weights_label(weights: str, dtype: torch.dtype) -> str:
    """What a mode runs, as the tables print it: "int4, ... x bfloat16"."""
    return f"{weights} x {str(dtype).removeprefix('torch.')}"


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


# The default model's products (out, in features) per layer, and its LM head.
LAYER_SHAPES = {
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
}
HEAD_SHAPE = (49152, 576)
# Llama 3.2 1B's (benchmarks/scale_models.py's 1B shape): --shapes 1b.
LAYER_SHAPES_1B = {
    "qkv": (3072, 2048),
    "o_proj": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
}
HEAD_SHAPE_1B = (128256, 2048)
PRODUCT_KERNELS = (
    "fp32",
    "bf16",
    "bf16 fixed",
    "int4",
    "int8",
    "int4 bf16",
    "int8 bf16",
    "int4 a8",
    "int8 a8",
    "aten int4",
    "aten int8",
)
# On a CPU with AMX, the int8-input products on each path alone beside "a8" (the choice by
# width that CELLBATCH_AMX=auto makes, or what the caller's CELLBATCH_AMX says): "vnni"
# never takes the tiles, "amx" always.
AMX_KERNELS = ("int4 a8 vnni", "int8 a8 vnni", "int4 a8 amx", "int8 a8 amx")
AMX_SWITCH = {"vnni": "0", "amx": "always"}
# GGUF K-quant blocks kept as they are (`kquant_matmul_a8`, bf16 inputs), by --kernels only:
# "Q4_K a8" as CELLBATCH_AMX says, "... vnni" and "... amx" on one path.
KQUANT_KINDS = ("Q4_K", "Q5_K", "Q6_K")


def _kquant_call(kind: str, shape: tuple[int, int], switch: str | None, generator) -> Any:
    """call(x) for a product of `shape` in GGUF blocks of `kind`: random codes and integer
    scales, float16 block scales of a real weight's size (speed does not depend on them)."""
    import numpy as np
    import torch

    from cellbatch.model import kquants, ops

    n, k = shape
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind]
    seed = int(torch.randint(0, 2**31, (1,), generator=generator))
    blocks = np.random.default_rng(seed).integers(0, 256, (n, k // 256 * size), dtype=np.uint8)
    view = blocks.reshape(n, k // 256, size)
    scale = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
    for at in (size - 2,) if kind == "Q6_K" else (0, 2):  # d (and dmin): finite, small
        view[:, :, at : at + 2] = scale
    codes, scales = kquants.pack(kquants.from_blocks(blocks, kind))
    op = ops.table(ops.NAMESPACE).kquant_matmul_a8
    chosen = os.environ.get("CELLBATCH_AMX", "") if switch is None else switch

    def call(x: torch.Tensor) -> torch.Tensor:
        os.environ["CELLBATCH_AMX"] = chosen  # the kernels read it at each call
        return op(x.bfloat16(), codes, scales, n)

    return call


def _product_calls(kernel: str, shape: tuple[int, int], generator) -> Any:
    """call(x) for one product of `shape` with random weights held as `kernel` holds them:
    fp32 and bf16 as the model runs them (oneDNN-packed, PackedLinear, where it packs that
    dtype on this CPU; else torch's linear; "bf16" in one call of all rows, "bf16 fixed" in
    the calls of a fixed row count that PackedLinear makes on AMX CPUs, gemm.py), our
    int4/int8 ops, PyTorch's int4/int8
    weight-only kernels (bf16 activations, as the previous QuantizedLinear ran them)."""
    import torch

    from cellbatch.model import gemm, ops, quantized
    from cellbatch.model.transformer import can_pack_linears

    n, k = shape
    if kernel.split()[0] in KQUANT_KINDS:
        return _kquant_call(kernel.split()[0], shape, AMX_SWITCH.get(kernel.split()[-1]), generator)
    weight = torch.randn(n, k, generator=generator) * 0.05
    if kernel in ("fp32", "bf16", "bf16 fixed"):
        dtype = torch.float32 if kernel == "fp32" else torch.bfloat16
        if not can_pack_linears(dtype, "cpu"):  # oneDNN's packed bf16 needs AVX512 or AMX
            plain = weight.to(dtype)
            return lambda x: torch.nn.functional.linear(x.to(dtype), plain)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), None)
        rows = gemm.rows_per_call(dtype) if kernel == "bf16 fixed" else 0
        return lambda x: gemm.in_fixed_calls(
            lambda part: torch.ops.mkldnn._linear_pointwise(part, packed, None, "none", [], ""),
            x.to(dtype),
            rows,
        )
    if kernel.split()[0] in ("int4", "int8"):
        fmt, *activations = kernel.split()
        table = ops.table(ops.NAMESPACE)
        op = table.int4_matmul if fmt == "int4" else table.int8_matmul
        held = quantized.from_float(weight, fmt)
        if activations[:1] == ["a8"]:  # bf16 activations quantised to int8 per group
            switch = AMX_SWITCH.get(activations[-1], os.environ.get("CELLBATCH_AMX", ""))
            if isinstance(held, quantized.Int8Weight):
                codes, scales = quantized.pack_a8(held)
                a8_op = table.int8_matmul_a8
            else:
                codes, scales = quantized.pack(held)
                a8_op = table.int4_matmul_a8

            def a8_call(x: torch.Tensor) -> torch.Tensor:
                os.environ["CELLBATCH_AMX"] = switch  # the kernels read it at each call
                return a8_op(x.bfloat16(), codes, scales, n)

            return a8_call
        codes, scales = quantized.pack(held)
        if activations:  # bf16 activations: the bf16 products where the CPU has them
            return lambda x: op(x.bfloat16(), codes, scales, n)
        return lambda x: op(x, codes, scales, n)
    aten = torch.ops.aten
    if kernel == "aten int4":
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=generator)
        packed4 = aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        zeros = (torch.rand(k // 32, n, 2, generator=generator) * 0.01).bfloat16()
        return lambda x: aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed4, 32, zeros)
    codes8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    scale = (torch.rand(n, generator=generator) * 0.01).bfloat16()
    return lambda x: aten._weight_int8pack_mm(x.bfloat16(), codes8, scale)


def _as_run(kernel: str, name: str) -> str:
    """The kernel a model whose products are `kernel` runs product `name` with: the int4
    format keeps its LM head in int8, and int8 activations take only the products of
    quantized.a8_products (of bf16: the a8 calls here take bf16 inputs)."""
    import torch

    from cellbatch.model.quantized import a8_products

    if kernel.startswith("int4 a8") and name not in a8_products(torch.bfloat16):
        kernel = "int4 bf16"
    return kernel.replace("int4", "int8") if name == "lm_head" else kernel


def products(
    threads: int, rows: list[int], passes: int, layers: int, shapes: str, chosen: str
) -> None:
    """Milliseconds per forward pass of the default model's (or, shapes "1b", Llama 3.2
    1B's) products alone (`layers`
    layers of distinct random weights, so that they come from memory as in the model, and
    the LM head), per kernel and row count: best of `passes`, kernels interleaved. On a
    CPU with AMX the int8-input products also run on each of their paths alone
    (AMX_KERNELS), beside "a8" (the choice by width that `auto` makes). `chosen`, a comma
    list of kernels, runs those alone (the K-quant ones only so: "Q4_K a8 amx", ...)."""
    import torch

    from cellbatch.model import kernels
    from cellbatch.model.cpu import amx_switch, cpu_has_amx

    if not kernels.load():
        raise SystemExit(f"the compiled kernels are needed: {kernels.unavailable_reason()}")
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    tiles = cpu_has_amx() and amx_switch() != "0"
    layer_shapes, head_shape = (
        (LAYER_SHAPES_1B, HEAD_SHAPE_1B) if shapes == "1b" else (LAYER_SHAPES, HEAD_SHAPE)
    )
    kernel_names = PRODUCT_KERNELS + (AMX_KERNELS if tiles else ())
    if chosen:
        kernel_names = tuple(name.strip() for name in chosen.split(","))
    # with the kernels those models run for some products (int4's head in int8, ...)
    while more := {
        _as_run(k, n) for k in kernel_names for n in [*layer_shapes, "lm_head"]
    }.difference(kernel_names):
        kernel_names += tuple(sorted(more))
    calls = {
        kernel: {
            name: [_product_calls(kernel, shape, generator) for _ in range(layers)]
            for name, shape in layer_shapes.items()
        }
        | {"lm_head": [_product_calls(kernel, head_shape, generator)]}
        for kernel in kernel_names
    }
    names = [*layer_shapes, "lm_head"]
    print(
        f"products: {layers} layers + LM head, {threads} threads, "
        f"{torch.backends.cpu.get_cpu_capability()}: ms per pass (best of {passes})"
    )
    for count in rows:
        inputs = {name: torch.randn(count, shape[1]) for name, shape in layer_shapes.items()}
        inputs["lm_head"] = torch.randn(count, head_shape[1])
        best = {(kernel, name): float("inf") for kernel in kernel_names for name in names}
        for _ in range(passes):
            for kernel in kernel_names:  # interleaved: a load swing hits every kernel
                for name in names:
                    began = perf_counter()
                    for call in calls[kernel][name]:
                        call(inputs[name])
                    best[kernel, name] = min(best[kernel, name], perf_counter() - began)
        print(f"rows {count}: " + " ".join(f"{kernel:>12}" for kernel in kernel_names))
        for name in names:
            cells = " ".join(f"{best[k, name] * 1e3:12.2f}" for k in kernel_names)
            print(f"  {name:<8} {cells}")
        total = {
            kernel: sum(best[_as_run(kernel, name), name] for name in names)
            for kernel in kernel_names
        }
        cells = " ".join(f"{total[k] * 1e3:12.2f}" for k in kernel_names)
        first = kernel_names[0]
        ratios = " ".join(f"{total[first] / total[k]:12.2f}" for k in kernel_names)
        print(f"  {'model':<8} {cells}\n  {'x ' + first:<8} {ratios}", flush=True)


def _tokens(outputs: list[list[int]]) -> int:
    return sum(len(o) for o in outputs)


def _agreement(outputs: list[list[int]], reference: list[list[int]]) -> str:
    """Outputs identical to the reference's, and the mean length of the common prefix."""
    same = sum(a == b for a, b in zip(outputs, reference, strict=True))
    prefixes = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        for a, b in zip(outputs, reference, strict=True)
    ]
    return f"{same}/{len(reference)} ({sum(prefixes) / len(prefixes):.1f})"


def _row(
    run: dict[str, Any], name: str, sessions: list[int], reference: dict[str, Any] | None
) -> list[str | int | float | None]:
    """One mode's cells: name, weights, KV bytes per cell, RSS MiB, single and concurrent
    tokens/s, decode-only tokens/s per session count, and (beside a reference run) greedy
    agreement."""
    single = run["single"]
    conc = run.get("concurrent")
    rss = run.get("rss_after_load")
    row: list[str | int | float | None] = [
        name,
        run["weights"],
        run.get("kv_bytes_per_cell"),
        rss / 2**20 if rss else None,
        _tokens(single["outputs"]) / single["seconds"],
        _tokens(conc["outputs"]) / conc["seconds"] if conc else None,
        *(run["decode_only"].get(str(s)) for s in sessions),
    ]
    if reference is not None:
        row.append(_agreement(single["outputs"], reference["single"]["outputs"]))
        row.append(_agreement(conc["outputs"], reference["concurrent"]["outputs"]) if conc else "-")
    return row


def _fit(cell: str | int | float | None, width: int, column: int) -> str:
    if cell is None:
        text = "nan"
    elif isinstance(cell, float):
        text = f"{cell:.0f}" if column == 3 else f"{cell:.1f}"
    else:
        text = str(cell)
    return f"{text:<{width}}" if column < 2 else f"{text:>{width}}"


def _headline(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[Headline]:
    """The default mode against llama.cpp on the same file, where both ran."""
    ours, theirs = runs.get("auto:auto"), runs.get("llama.cpp")
    if ours is None or theirs is None:
        return []
    rate = _tokens(ours["single"]["outputs"]) / ours["single"]["seconds"]
    peer_rate = _tokens(theirs["single"]["outputs"]) / theirs["single"]["seconds"]
    return [
        Headline(
            f"{args.single_prompts} chat prompts one at a time, the default mode",
            rate,
            "llama.cpp on the same GGUF file",
            peer_rate,
        ),
        Headline(
            "decode, one sequence, the default mode",
            ours["decode_only"]["1"],
            "llama.cpp on the same GGUF file",
            theirs["decode_only"]["1"],
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    argv_given = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="default: SmolLM2-135M-Instruct Q4_1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--formats", default="none,int8,int4")
    parser.add_argument(
        "--reference", default="none:float32", help="the mode greedy agreement compares with"
    )
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--single-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--sessions", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 32]
    )
    parser.add_argument(
        "--program", type=Path, help="also a program of the model (`cellbatch export`), as is"
    )
    parser.add_argument("--llama-python", help="Python with llama-cpp-python (optional)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per format, best kept")
    parser.add_argument("--products", action="store_true", help="only the per-kernel products")
    parser.add_argument("--rows", default="1,8,32", help="--products: rows per product")
    parser.add_argument("--passes", type=int, default=15, help="--products: passes, best kept")
    parser.add_argument("--layers", type=int, default=30, help="--products: layers")
    parser.add_argument(
        "--shapes", choices=("default", "1b"), default="default", help="--products: whose"
    )
    parser.add_argument("--kernels", default="", help="--products: these kernels alone")
    parser.add_argument("--output-json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv_given)
    if args.products:
        rows = [int(count) for count in args.rows.split(",")]
        products(args.threads, rows, args.passes, args.layers, args.shapes, args.kernels)
        return 0
    if args.child:
        json.dump(measure(args), sys.stdout)
        return 0

    runs: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):  # formats alternate, so a load swing hits them all
        for fmt in args.formats.split(","):
            runs[fmt] = _best(runs.get(fmt), _child(args, fmt))
        if args.program:
            runs["program"] = _best(runs.get("program"), _child(args, str(args.program)))
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

    # The reference mode, where it ran (by default the parity mode: float32, unquantised).
    wanted = mode_options(args.reference)
    reference = next((runs[f] for f in runs if mode_options(f) == wanted), None)
    columns = [
        "mode", "weights", "KV B/cell", "RSS MiB", "single t/s", "32-conc t/s",
        *(f"dec@{s}" for s in args.sessions),
        *(("agree 1", "agree 32") if reference is not None else ()),
    ]  # fmt: skip
    rows = [_row(run, name, args.sessions, reference) for name, run in runs.items()]
    widths = [
        22, 44, 9, 8, 10, 11, *(8 for _ in args.sessions),
        *((12, 12) if reference is not None else ()),
    ]  # fmt: skip
    print(
        " ".join(
            _fit(column, width, i)
            for i, (column, width) in enumerate(zip(columns, widths, strict=True))
        )
    )
    for row in rows:
        print(
            " ".join(
                _fit(cell, width, i)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
        )
    if args.output_json:
        published = Results(
            benchmark=args.output_json.stem,
            title="Weight formats and modes (benchmarks/quantized.py)",
            command=command_line("python benchmarks/quantized.py", argv_given),
            tables=[
                ResultTable(
                    caption=f"tokens/s: {args.single_prompts} chat prompts one at a time "
                    f"(single), {args.prompts} at once (conc), decode-only at N sessions in "
                    f"lockstep (dec@N); at most {args.max_new_tokens} new tokens, greedy; "
                    f"agreement: greedy answers identical to {args.reference}'s "
                    "(mean common prefix)",
                    columns=columns,
                    rows=rows,
                )
            ],
            headline=_headline(runs, args),
            machine=machine(args.threads),
        )
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        details = {"options": vars(args) | {"model": str(args.model)}, "runs": runs}
        args.output_json.write_text(
            json.dumps({**results_fields(published), **details}, indent=1, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
