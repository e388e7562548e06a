"""The long-context benchmark (benchmarks/long_context.py) end to end on a tiny model, and
its prompts: each peer measured, every part reported."""

from __future__ import annotations

import json
from pathlib import Path

from long_context import PROMPT_STRIDE, long_prompts, main


def test_prompts_have_the_length_asked_and_share_no_prefix() -> None:
    stream = list(range(1000))
    prompts = long_prompts(stream, 3, 400)
    assert [len(p) for p in prompts] == [400] * 3
    assert [p[0] for p in prompts] == [0, PROMPT_STRIDE, 2 * PROMPT_STRIDE]


def test_a_quick_run_reports_every_part(tiny_bench_model: Path, tmp_path: Path) -> None:
    output = tmp_path / "long.json"
    args = ["--quick", "--model", str(tiny_bench_model), "--repeats", "1", "--threads", "1"]
    assert main([*args, "--output-json", str(output)]) == 0
    report = json.loads(output.read_text())
    assert [(r["prompts"], r["tokens_each"]) for r in report["prefill"]] == [(1, 500), (2, 300)]
    for row in report["prefill"]:
        assert set(row["tokens_per_s"]) == {
            "cellbatch",
            "transformers forward (SDPA)",
            "transformers generate",
        }
        assert row["first_tokens_agree"] == row["prompts"]
    assert [r["sessions"] for r in report["decode"]] == [1, 4]
    assert all(len(r["tokens_per_s"]) == 2 for r in report["decode"])
    assert [(p["kind"], p["context"]) for p in report["profile"]] == [
        ("decode", 64),
        ("decode", 300),
        ("prefill", 64),
        ("prefill", 300),
    ]
    assert all(0 < p["attention_share"] < 1 for p in report["profile"])
