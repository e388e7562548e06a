"""Which prompt chunk long prompts want: one prompt prefilled in chunks of several sizes (issue 14).

Each prompt length is prefilled straight through the model (no engine, no scheduler), as
consecutive chunks of one sequence over a CellCache and KVPool, once per chunk size, the
sizes' order alternating from round to round in one process so that the machine's drift
hits every size alike. Prints prompt tokens/s per (length, chunk): the median of the
rounds and each round's figure. The chunk is what `max_prefill_chunk` cuts a prompt into
(the engine's default is max_batch_tokens minus its decode slots: 480 of 544); a step
that carries decodes waits for its chunk, so a wider chunk trades their latency for
whatever prefill speed it buys.

Usage: .venv/bin/python benchmarks/prefill_chunks.py [--model PATH] [--dtype float32]
       [--threads 2] [--chunks 480,1024,2048] [--lengths 2000,4000] [--rounds 4]
       [--output-json PATH]

Owns: this comparison's run and its JSON.
Never: judges the figures (it prints them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from long_context import Stepper


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model to run (default: SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunks", default="480,1024,2048", help="chunk sizes, comma-separated")
    parser.add_argument("--lengths", default="2000,4000", help="prompt lengths, comma-separated")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output-json", type=Path)
    return parser.parse_args(argv)


def prefill_seconds(stepper: Stepper, length: int, chunk: int) -> float:
    """One prompt of `length` tokens, `chunk` tokens a forward, in a fresh sequence."""
    seq = stepper.cache.seq_alloc()
    try:
        started = time.perf_counter()
        for start in range(0, length, chunk):
            end = min(length, start + chunk)
            _, run = stepper.step(np.full(end - start, seq), np.arange(start, end))
            run()
        return time.perf_counter() - started
    finally:
        stepper.cache.seq_release(seq)


def measure(model: Any, lengths: list[int], chunks: list[int], rounds: int) -> list[dict]:
    stepper = Stepper(model, max(lengths) + 1)
    seconds: dict[tuple[int, int], list[float]] = {}
    with torch.inference_mode():
        prefill_seconds(stepper, min(lengths), min(chunks))  # warm-up
        for round_index in range(rounds):
            order = chunks if round_index % 2 == 0 else chunks[::-1]
            for length in lengths:
                for chunk in order:
                    spent = prefill_seconds(stepper, length, chunk)
                    seconds.setdefault((length, chunk), []).append(spent)
    return [
        {
            "tokens": length,
            "chunk": chunk,
            "tokens_per_s": round(length / statistics.median(spent), 1),
            "rounds_tokens_per_s": [round(length / s, 1) for s in spent],
        }
        for (length, chunk), spent in sorted(seconds.items())
    ]


def main(argv: Sequence[str] | None = None) -> int:
    from cellbatch.model.default import default_model_path
    from cellbatch.model.loading import load_model

    args = parse(argv)
    torch.set_num_threads(args.threads)
    chunks = [int(size) for size in args.chunks.split(",")]
    lengths = [int(size) for size in args.lengths.split(",")]
    path = Path(args.model) if args.model else default_model_path()
    _, model = load_model(path, args.dtype, quantize="none")
    rows = measure(model, lengths, chunks, args.rounds)
    print(f"prefill of one prompt by chunk size ({args.dtype}, {args.threads} threads)")
    print("| prompt tokens | chunk | tokens/s (median) | rounds |")
    print("|---|---|---|---|")
    for row in rows:
        rounds = ", ".join(f"{value:.0f}" for value in row["rounds_tokens_per_s"])
        print(f"| {row['tokens']} | {row['chunk']} | {row['tokens_per_s']:.0f} | {rounds} |")
    if args.output_json:
        report = {"model": str(path), "dtype": args.dtype, "threads": args.threads, "rows": rows}
        args.output_json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
