"""The CPU-kinds benchmark (benchmarks/cpu_kinds.py): its measurement on a tiny model, the
trees it copies, and its table of ratios and token agreement."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cpu_kinds import CHECKOUT, copy_tree, kind_environment, main, measure, report


def test_a_mode_is_measured_with_its_tokens_digested(tiny_bench_model: Path) -> None:
    first = measure(str(tiny_bench_model), "none:float32", ["single", "p32"], threads=1)
    assert first["dtype"] == "torch.float32"
    assert float(first["single"]) > 0 and float(first["p32"]) > 0
    assert "d32" not in first
    again = measure(str(tiny_bench_model), "none:float32", ["p32"], threads=1)
    assert again["p32 tokens"] == first["p32 tokens"]  # greedy: the same tokens each run


def test_the_avx2_kind_caps_torch_onednn_and_mkl() -> None:
    env = kind_environment("avx2")
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"


def test_a_revision_is_copied_from_git(tmp_path: Path) -> None:
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True, check=True
    ).stdout.strip()
    copy_tree(head, tmp_path / "tree")
    assert (tmp_path / "tree/setup.py").is_file()
    assert (tmp_path / "tree/src/cellbatch/model/kernels/common.h").is_file()
    assert not (tmp_path / "tree/tests").exists()


def run(figure: float, tokens: str) -> dict[str, object]:
    return {"single": figure, "single tokens": tokens}


def test_the_table_gives_each_trees_best_figure_and_their_ratio() -> None:
    results = {
        "auto:float32": {
            "old": [run(100.0, "a"), run(110.0, "a")],
            "checkout": [run(121.0, "a"), run(90.0, "a")],
        },
        "none:float32": {"old": [run(40.0, "a")], "checkout": [run(40.0, "b")]},
    }
    lines = report(results, ["single"]).splitlines()
    assert lines[0] == "| mode | single old | single checkout | single ratio | same tokens |"
    assert lines[2] == "| auto:float32 | 110.0 | 121.0 | 1.10x | yes |"
    assert lines[3] == "| none:float32 | 40.0 | 40.0 | 1.00x | no |"


def test_a_failed_mode_is_named_not_dropped() -> None:
    results = {
        "none:bfloat16": {
            "old": [{"failed": "RuntimeError: bf16 path needs avx512bw"}],
            "checkout": [run(47.0, "a")],
        }
    }
    row = report(results, ["single"]).splitlines()[2]
    assert row == "| none:bfloat16 | failed | 47.0 | failed | no |"


def test_a_mode_without_its_dtype_is_refused_before_anything_builds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--modes", "auto:float32,auto"])
    assert "['auto'] are not QUANTIZE:DTYPE" in capsys.readouterr().err
