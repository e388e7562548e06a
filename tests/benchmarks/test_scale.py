"""The scale benchmark (benchmarks/scale.py): one stream alternated with llama.cpp's, and the
table's line of their medians. (The runs themselves need the scale models and the llama.cpp
peer, which a fresh checkout does not have.)"""

from __future__ import annotations

from typing import Any

import pytest

import scale


def test_the_rounds_alternate_the_engines_and_keep_each_round(monkeypatch) -> None:
    calls: list[str] = []
    llama_rates = iter([(0.5, 3.0), (0.4, 2.9), (0.6, 3.2)])  # (T_PP, T_TG) per round

    def batched_rows(command: list[str]) -> dict[int, dict[str, float]]:
        calls.append("llama.cpp")
        assert command[command.index("-npl") + 1] == "1" and "/model.gguf" in command
        t_pp, t_tg = next(llama_rates)
        return {1: {"T_PP": t_pp, "S_PP": 64 / t_pp, "T_TG": t_tg, "S_TG": 128 / t_tg}}

    def first() -> float:
        calls.append("first")
        return 0.25

    seconds = iter([4.25, 4.5, 4.0])

    def whole() -> tuple[float, int]:
        calls.append("cellbatch")
        return next(seconds), 128

    monkeypatch.setattr(scale, "_batched_rows", batched_rows)
    monkeypatch.setattr(scale.llama_cpp_tools, "binary", lambda name: f"/peers/{name}")
    found = scale.alternated_single(first, whole, "/model.gguf", 2, 3)
    assert calls == ["first", "cellbatch", "llama.cpp"] * 3
    assert found["cellbatch"] == pytest.approx([128 / 4.25, 128 / 4.5, 128 / 4.0])
    assert found["cellbatch_decode"] == pytest.approx([127 / 4.0, 127 / 4.25, 127 / 3.75])
    assert found["llama_cpp"] == pytest.approx([128 / 3.5, 128 / 3.3, 128 / 3.8])
    assert found["llama_cpp_decode"] == pytest.approx([128 / 3.0, 128 / 2.9, 128 / 3.2])


def _results(rounds: dict[str, list[float]] | None) -> dict[str, Any]:
    cellbatch: dict[str, Any] = {
        "load_seconds": 20.0, "peak_rss": 2**30, "single": 30.0, "single_decode": 32.0,
        "p32": 100.0, "d32": 120.0, "prefill": 230.0, "weights": "Q4_K+Q6_K",
    }  # fmt: skip
    if rounds is not None:
        cellbatch["single_rounds"] = rounds
    run = {
        "cellbatch": cellbatch, "bandwidth_rate": 60.0, "cellbatch_bytes_per_token": 0.81e9,
    }  # fmt: skip
    return {
        "cpu": "a CPU", "cpu_kind": "AVX512", "threads": 2, "bandwidth_gbs": 50.0,
        "models": {"model.gguf": run},
    }  # fmt: skip


def test_the_table_gives_the_rounds_medians_and_their_ratio() -> None:
    rounds = {
        "cellbatch": [31.0, 35.0, 30.0], "cellbatch_decode": [33.0, 36.0, 32.0],
        "llama_cpp": [32.0, 36.0, 20.0], "llama_cpp_decode": [40.0, 35.0, 36.0],
    }  # fmt: skip
    line = next(
        row for row in scale.table(_results(rounds)).splitlines() if "alternated" in row
    )
    assert "3 rounds" in line
    assert "31.0 / 32.0 = 0.97x" in line
    assert "33.0 / 36.0 = 0.92x" in line
    assert "alternated" not in scale.table(_results(None))
