"""Runner overhead per step: steps/s with an executor that answers instantly.

32 sessions decode side by side through the real Runner and DecodeFirstScheduler;
the executor does no work, so the figure is the runner's own Python cost per step
(target: >= 2,000 steps/s, i.e. under 0.5 ms per step).

    .venv/bin/python benchmarks/runner_overhead.py [--sessions 32] [--tokens 2000]
"""

from __future__ import annotations

import argparse
import time

from cellbatch.generation_config import GenConfig, SamplingParams
from cellbatch.runner import Runner
from cellbatch.scheduler import DecodeFirstScheduler
from cellbatch.types import BatchInput, BatchOutput, KVUsage, Output, SessionId


class InstantExecutor:
    """Answers every input at once with a fixed token; keeps no history."""

    def __init__(self) -> None:
        self._next_sid = 0
        self._output_cache: dict[SessionId, Output] = {}

    def initialize(self) -> None:
        pass

    def open_session(self) -> SessionId | None:
        self._next_sid += 1
        return self._next_sid

    def close_session(self, sid: SessionId) -> None:
        self._output_cache.pop(sid, None)

    def clone(self, source: SessionId, upto: int) -> SessionId | None:
        return None

    def truncate(self, sid: SessionId, length: int) -> None:
        pass

    def set_sampling(self, sid: SessionId, params: SamplingParams, seed: int | None) -> None:
        pass

    def set_adapter(self, sid: SessionId, adapter: int) -> None:
        pass

    def kv_usage(self) -> KVUsage | None:
        return None  # no cell limit: admission never waits for cells

    def execute(self, batch: BatchInput) -> BatchOutput:
        cache = self._output_cache
        outputs = []
        for inp in batch.inputs:
            out = None
            if inp.produce_output:
                out = cache.get(inp.sid)
                if out is None:
                    out = cache[inp.sid] = Output(inp.sid, (7,))
            outputs.append(out)
        return BatchOutput(tuple(outputs))


def measure(sessions: int, tokens: int) -> tuple[float, int]:
    """(steps per second, steps) for `sessions` generations of `tokens` tokens each."""
    runner = Runner(InstantExecutor(), DecodeFirstScheduler.create(max_decode_sequences=sessions))
    try:
        opened = [runner.open_session_async().result(10) for _ in range(sessions)]
        config = GenConfig(max_new_tokens=tokens)
        start = time.perf_counter()
        handles = [session.generate_async([1, 2, 3, 4], config) for session in opened if session]
        for handle in handles:
            handle.wait(600)
        elapsed = time.perf_counter() - start
        steps = runner.metrics().steps
    finally:
        runner.shutdown()
    return steps / elapsed, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per generation")
    args = parser.parse_args()
    rate, steps = measure(args.sessions, args.tokens)
    print(
        f"runner overhead: {rate:,.0f} steps/s ({1e3 / rate:.3f} ms/step) over {steps} steps, "
        f"{args.sessions} decoding sessions, instant executor"
    )


if __name__ == "__main__":
    main()
