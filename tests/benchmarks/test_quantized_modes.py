"""benchmarks/quantized.py's table and results file, over canned per-mode runs (the
children that load models are replaced: their figures are not what is tested here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import quantized


def canned(fmt: str) -> dict[str, Any]:
    tokens = [[1] * 10, [2] * 10]
    slow = fmt.startswith("none")
    return {
        "weights": "float32 x float32" if slow else "int4 x bfloat16",
        "rss_after_load": 200 * 2**20,
        "single": {"outputs": tokens, "seconds": 2.0 if slow else 1.0},
        "concurrent": {"outputs": tokens, "seconds": 0.5},
        "decode_only": {"1": 50.0 if slow else 100.0, "8": 400.0},
        "prompts": [[5, 6], [7, 8]],
        "stop": [2],
    }


def test_results_file_carries_the_table_machine_and_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(quantized, "_child", lambda args, fmt: canned(fmt))
    output = tmp_path / "quantized.json"
    argv = [
        "--formats",
        "auto:auto,none:float32",
        "--sessions",
        "1,8",
        "--output-json",
        str(output),
    ]
    assert quantized.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[:5] == ["mode", "weights", "KV", "B/cell", "RSS"]
    data = json.loads(output.read_text())
    assert data["command"] == "python benchmarks/quantized.py " + " ".join(argv)
    assert data["machine"]["cpu_kind"] and data["machine"]["threads"] == 2
    [table] = data["tables"]
    assert table["columns"][-4:] == ["dec@1", "dec@8", "agree 1", "agree 32"]
    default, parity = table["rows"]
    assert default[:2] == ["auto:auto", "int4 x bfloat16"]
    assert default[4] == pytest.approx(20.0) and parity[4] == pytest.approx(10.0)
    assert data["headline"] == []  # llama.cpp did not run: nothing to compare with
    assert set(data["runs"]) == {"auto:auto", "none:float32"}


def test_headline_compares_the_default_with_llama_cpp() -> None:
    runs = {"auto:auto": canned("auto:auto"), "llama.cpp": canned("none")}
    args = quantized.argparse.Namespace(single_prompts=8)
    single, decode = quantized._headline(runs, args)
    assert single.ratio == pytest.approx(2.0) and decode.ratio == pytest.approx(2.0)
    assert "llama.cpp" in single.peer
