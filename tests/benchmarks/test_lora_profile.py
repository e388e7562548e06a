"""benchmarks/lora_profile.py: perf's samples named by kind, counted for the prompt and
thread they fell in, as CPU per generated token; the prompts alternate base and adapter
on a real engine; without perf the script says what to install."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import lora_profile
from lora_adapters import make_adapter
from lora_profile import ADAPTER, BASE, Span, attribute, kind_of, report, run_prompts

GOMP = "7fa0 0x000000000001de62 (/usr/lib/x86_64-linux-gnu/libgomp.so.1)"


def line(tid: int, at: float, text: str) -> str:
    return f"  {tid} {at:.6f}:      7fa034235c8e {text}"


def test_a_samples_symbol_names_its_kind() -> None:
    kernels = "(/work/main/src/cellbatch/model/kernels/_C.so)"
    assert kind_of(f"cellbatch::lora_rows::add_segment_pairs<1> {kernels}") == "adapter kernel"
    assert kind_of(f"(anonymous namespace)::lora_add {kernels}") == "lora_add checks and plan"
    assert kind_of(f"(anonymous namespace)::assign {kernels}") == "lora_add checks and plan"
    int4 = "cellbatch::(anonymous namespace)::rows_over_groups<1, 3, cellbatch::(anonymous "
    int4 += "namespace)::Int4Panels<c10::Half>, ...>(...)::{lambda(long, int, int)#1}&>"
    assert kind_of(f"{int4} {kernels}") == "int4 products"
    assert kind_of(f"{int4.replace('Int4', 'Int8')} {kernels}") == "int8 products"
    assert kind_of(f"cellbatch::kq::block<3> {kernels}") == "k-quant products"
    attention = "(anonymous namespace)::CellAttention<c10::BFloat16, c10::BFloat16>::run"
    assert kind_of(f"{attention} {kernels}") == "attention"
    assert kind_of(GOMP.split(" ", 1)[1]) == "OpenMP runtime"
    python = "_PyEval_EvalFrameDefault (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)"
    assert kind_of(python) == "Python"
    assert kind_of("malloc (/usr/lib/x86_64-linux-gnu/libc.so.6)") == "other"


def test_samples_count_for_the_prompt_and_thread_they_fell_in() -> None:
    spans = [Span(BASE, 10.0, 11.0, 4), Span(ADAPTER, 11.0, 13.0, 4)]
    python = "_PyEval_EvalFrameDefault (/lib/libpython3.11.so.1.0)"
    kernel = "cellbatch::lora_rows::add_segment_pairs<1> (/k/_C.so)"
    lines = [
        "perf's header or a line it could not resolve",
        line(7, 9.5, python),  # before any prompt: not counted
        line(7, 10.1, python),
        line(7, 10.2, python),
        line(8, 10.3, GOMP.split(" ", 1)[1]),
        line(7, 11.5, kernel),
        line(8, 11.6, kernel),
        line(8, 11.7, kernel),
        line(7, 12.0, python),
        line(9, 12.5, python),  # a third thread: not among the two busiest
        line(7, 13.5, kernel),  # after the last prompt
    ]
    result = attribute(lines, spans)
    rows = {(row["thread"], row["kind"]): row for row in result["rows"]}
    per_sample = 1e3 / lora_profile.SAMPLES_PER_S / 4  # ms of CPU per token, 4 tokens a mode
    assert rows["engine", "Python"][BASE] == pytest.approx(2 * per_sample, abs=1e-3)
    assert rows["engine", "Python"][ADAPTER] == pytest.approx(per_sample, abs=1e-3)
    assert rows["engine", "adapter kernel"][ADAPTER] == pytest.approx(per_sample, abs=1e-3)
    assert rows["other", "adapter kernel"][ADAPTER] == pytest.approx(2 * per_sample, abs=1e-3)
    assert rows["other", "OpenMP runtime"][BASE] == pytest.approx(per_sample, abs=1e-3)
    assert rows["other", "Python"] == {"thread": "other", "kind": "Python", BASE: 0, ADAPTER: 0}
    assert result["wall_ms_per_token"] == {BASE: 250.0, ADAPTER: 500.0}
    assert "adapter / base tokens/s 0.500x" in report(result)


def test_the_prompts_alternate_between_the_base_and_the_adapter(
    tiny_bench_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from cellbatch.engine import Engine

    base = AutoModelForCausalLM.from_pretrained(tiny_bench_model, torch_dtype=torch.float32)
    adapter = make_adapter(base, tmp_path / "adapter", rank=4)
    with Engine.from_pretrained(
        tiny_bench_model, dtype="float32", threads=1, lora_adapters={"a": str(adapter)}
    ) as engine:
        spans = run_prompts(engine, ["a"], prompts=2, new=3, rounds=2)
    assert [span.mode for span in spans] == [
        BASE, ADAPTER, ADAPTER, BASE, ADAPTER, BASE, BASE, ADAPTER,
    ]  # fmt: skip
    assert all(span.tokens == 3 for span in spans)
    assert all(a.end <= b.start for a, b in itertools.pairwise(spans))


def test_without_perf_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lora_profile.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="needs `perf`"):
        lora_profile.main([])
