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


def test_published_figures_compare_cellbatch_with_the_peer_at_each_level() -> None:
    def level(server: str, clients: int, tokens: int) -> serve_load.Level:
        return serve_load.Level(server, clients, 8, tokens, 2.0, [0.1], [0.01])

    levels = [
        level("cellbatch serve", 1, 100),
        level("cellbatch serve", 32, 600),
        level("llama.cpp", 32, 200),
    ]
    args = argparse.Namespace(
        requests=8, max_tokens=64, offline_prompts=32, peer="http://x/v1", peer_name="llama.cpp",
        json=Path("docs/results/serve_load.json"), threads=2,
    )  # fmt: skip
    published = serve_load._published(
        args, levels, ["cellbatch serve", "llama.cpp"], {"tokens_per_s": 310.0}, ["--threads", "2"]
    )
    assert published.benchmark == "serve_load"
    assert published.command == "python benchmarks/serve_load.py --threads 2"
    [headline] = published.headline  # only the level both ran
    assert headline.what == "`cellbatch serve`, 32 streaming clients"
    assert headline.ratio == 3.0 and headline.peer == "llama.cpp"
    [table] = published.tables
    assert [row[:3] for row in table.rows] == [
        ("cellbatch serve", 1, 50.0),
        ("cellbatch serve", 32, 300.0),
        ("llama.cpp", 32, 100.0),
    ]
    assert "310.0 tokens/s" in table.note
