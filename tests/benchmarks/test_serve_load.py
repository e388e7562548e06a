"""benchmarks/serve_load.py's load generator against a live server of a tiny model."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import serve_load
from served import MODEL_NAME, start_live_server


def test_the_lean_client_counts_what_the_server_generated(tiny_bench_model: Path) -> None:
    live = start_live_server(tiny_bench_model, api_key=None)
    try:
        base = live.base_url + "/v1"
        assert serve_load._served_model(base) == MODEL_NAME
        before = live.engine.metrics().generated_tokens
        args = argparse.Namespace(requests=6, max_tokens=5)
        level = asyncio.run(serve_load._run_level(base, "tiny", MODEL_NAME, 3, args))
        generated = live.engine.metrics().generated_tokens - before
    finally:
        live.stop()
    assert level.requests == 6 and level.counted_from_deltas == 0  # every usage chunk read
    assert level.generated_tokens == generated > 0
    assert len(level.ttft_s) <= 6 and all(t > 0 for t in level.ttft_s + level.itl_s)
    assert level.wall_s > 0 and level.client_cpu_s > 0
    summary = level.summary()
    assert summary["tokens_per_s"] == generated / level.wall_s
