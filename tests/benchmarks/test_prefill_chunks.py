"""The chunk-size benchmark (benchmarks/prefill_chunks.py) on a tiny model: every (length,
chunk) pair measured every round, and a chunked prefill that fills the pool as one would."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from long_context import Stepper
from prefill_chunks import main, prefill_seconds


def test_every_length_and_chunk_is_measured_each_round(
    tiny_bench_model: Path, tmp_path: Path
) -> None:
    output = tmp_path / "chunks.json"
    args = ["--model", str(tiny_bench_model), "--chunks", "16,64", "--lengths", "100,200"]
    assert main([*args, "--rounds", "3", "--threads", "1", "--output-json", str(output)]) == 0
    rows = json.loads(output.read_text())["rows"]
    assert [(row["tokens"], row["chunk"]) for row in rows] == [
        (100, 16),
        (100, 64),
        (200, 16),
        (200, 64),
    ]
    for row in rows:
        assert len(row["rounds_tokens_per_s"]) == 3
        assert row["tokens_per_s"] > 0


def test_a_chunked_prefill_leaves_the_cache_as_it_found_it(tiny_bench_model: Path) -> None:
    """Each prefill releases its sequence, so the pool (one prompt long) serves every run."""
    from cellbatch.model.loading import load_model

    _, model = load_model(tiny_bench_model, "float32")
    stepper = Stepper(model, 201)
    free = stepper.cache.free_cells()
    with torch.inference_mode():
        for chunk in (7, 64, 200):
            assert prefill_seconds(stepper, 200, chunk) > 0
            assert stepper.cache.free_cells() == free
