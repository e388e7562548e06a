"""`cellbatch export`: a model compiled into a program file that `run --model` runs.

Owns: the export options' checks and the progress lines.
Promises: a bad option or a missing model is a `UsageError` (exit 2) before any work.
Never: compiles anything itself; `cellbatch.export` does.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cellbatch.cli.options import UsageError, usage_error


def export_command(args: argparse.Namespace) -> int:
    from cellbatch.export.exporter import ExportOptions, export_program

    try:
        widths = tuple(int(width) for width in args.decode_widths.split(","))
    except ValueError:
        raise UsageError(
            f"--decode-widths takes comma-separated integers, got {args.decode_widths!r}"
        ) from None
    if args.model is not None and not Path(args.model).exists():
        raise UsageError(f"model {args.model} does not exist (give a folder or a .gguf file)")
    options = ExportOptions(
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        quantize=args.quantize,
        activations=args.activations,
        max_step_tokens=args.max_step_tokens,
        decode_widths=widths,
        min_prefill_tokens=args.min_prefill_tokens,
        threads=args.threads,
    )
    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr, flush=True)

    # ValueError: InvalidArgumentError among them.
    with usage_error(errors=(ValueError, FileNotFoundError)):
        export_program(args.model, args.output, options, progress)
    return 0
