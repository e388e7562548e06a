"""The GPU check (benchmarks/cuda_check.py) rehearsed on the CPU: `--device cpu --tiny` runs
every part end to end on tiny random models (the CUDA executor with the CPU stand-in for
graphs, transformers beside it) and prints its table with every check and target."""

from __future__ import annotations

import json
from pathlib import Path

import cuda_check


def test_the_tiny_rehearsal_runs_every_part(tmp_path: Path, capsys) -> None:
    output = tmp_path / "cuda_check.json"
    status = cuda_check.main(["--device", "cpu", "--tiny", "--output-json", str(output)])
    table = capsys.readouterr().out
    assert status == 0, table
    assert "FAILED" not in table
    for check in (
        "run report memory",
        "greedy bf16: graph replay = eager",
        "greedy fp32 (TF32 off) = transformers fp32",
        "device sampler = host sampler",
        "default: cellbatch graphs tok/s",
        "1B: transformers generate batch tok/s",
        "target: graphs >= 3x eager at 1 session",
        "target: 4 sessions >= 10x transformers padded",
        "attention: decode tok/s sdpa vs flex",
    ):
        assert check in table, check
    data = json.loads(output.read_text())
    # The stand-in replays the eager forwards' operations: graph = eager, and the host
    # and device samplers are one sampler on the CPU.
    assert data["graph_vs_eager_identical"] == 6 and data["sampler_identical"] == 3
    assert data["default"]["executor"]["graphs"]["captures"] > 0
