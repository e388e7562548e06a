"""Per-step bookkeeping time of the executor path, without a model
(docs/design.md#executors, #cell-kv-cache-and-kv-pool).

Times what every step pays before the forward: `SessionTable.pack`, `declare_step`,
`place_step` and `attention_plan`, for
  (a) 32 decode sessions of 2,048 tokens each in a full 65,536-cell pool, and
  (b) one 256-token prompt chunk beside the same 32 decodes.
Every iteration feeds each decode at position 2,047 (and the chunk at 256..511 of a
512-token session), so `pack` rewinds them by one token (256 for the chunk) and the
state stays the same from step to step; the figures thus include those rewinds.
Target: (a) under 1 ms per step. Prints medians over `--steps` steps.

Usage: .venv/bin/python benchmarks/bookkeeping.py [--steps 500]
"""

from __future__ import annotations

import argparse
import statistics
import time

from cellbatch.cache import CellCache
from cellbatch.executor.session_table import SessionTable
from cellbatch.types import BatchInput, Input

DECODES = 32
CONTEXT = 2048
POOL_CELLS = DECODES * CONTEXT  # 65,536: the decodes fill the pool exactly
CHUNK = 256
PHASES = ("pack", "declare+place", "attention_plan")


def _filled_table(cells: int, lengths: list[int]) -> tuple[SessionTable, list[int]]:
    """A table whose sessions hold `lengths` tokens each, placed in one step."""
    table = SessionTable(CellCache(cells), max_sessions=len(lengths), max_session_tokens=4096)
    sids = [table.open() for _ in lengths]
    prompts = tuple(
        Input(sid, False, 0, length, tuple(range(length)), 0)
        for sid, length in zip(sids, lengths, strict=True)
    )
    step = table.pack(BatchInput(prompts))
    assert table.cache.declare_step(step.seq_ids)
    table.cache.place_step(step.seq_ids, step.positions)
    return table, sids


def _time_steps(table: SessionTable, batch: BatchInput, steps: int) -> dict[str, list[float]]:
    """Per-phase microseconds of each step (after a short warm-up)."""
    cache = table.cache
    times: dict[str, list[float]] = {phase: [] for phase in (*PHASES, "total")}
    for index in range(steps + 20):
        t0 = time.perf_counter_ns()
        step = table.pack(batch)
        t1 = time.perf_counter_ns()
        if not cache.declare_step(step.seq_ids):
            raise RuntimeError("the pool is full: the benchmark's state drifted")
        cells = cache.place_step(step.seq_ids, step.positions)
        t2 = time.perf_counter_ns()
        cache.attention_plan(step.seq_ids, step.positions, cells, "cpu")
        t3 = time.perf_counter_ns()
        if index >= 20:
            spans = zip((*PHASES, "total"), (t0, t1, t2, t0), (t1, t2, t3, t3), strict=True)
            for phase, start, end in spans:
                times[phase].append((end - start) / 1e3)
    return times


def _report(title: str, times: dict[str, list[float]]) -> None:
    print(title)
    for phase, samples in times.items():
        median = statistics.median(samples)
        p90 = sorted(samples)[int(0.9 * len(samples))]
        print(f"  {phase:>15}: median {median:8.1f} us   p90 {p90:8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="timed steps per scenario")
    args = parser.parse_args()

    table, sids = _filled_table(POOL_CELLS, [CONTEXT] * DECODES)
    decodes = tuple(Input(sid, True, 0, 1, (7,), CONTEXT - 1) for sid in sids)
    decode_times = _time_steps(table, BatchInput(decodes), args.steps)
    _report(
        f"(a) {DECODES} decodes of {CONTEXT} tokens, {POOL_CELLS}-cell pool "
        f"(target total < 1000 us):",
        decode_times,
    )

    table, sids = _filled_table(POOL_CELLS + 2 * CHUNK, [CONTEXT] * DECODES + [2 * CHUNK])
    decodes = tuple(Input(sid, True, 0, 1, (7,), CONTEXT - 1) for sid in sids[:-1])
    chunk = Input(sids[-1], True, CHUNK, CHUNK, tuple(range(2 * CHUNK)), 0)
    mixed_times = _time_steps(table, BatchInput((*decodes, chunk)), args.steps)
    _report(
        f"(b) one {CHUNK}-token chunk beside {DECODES} decodes, "
        f"{POOL_CELLS + 2 * CHUNK}-cell pool:",
        mixed_times,
    )
    target_met = statistics.median(decode_times["total"]) < 1000.0
    print(f"target (a) < 1 ms/step: {'met' if target_met else 'NOT met'}")


if __name__ == "__main__":
    main()
