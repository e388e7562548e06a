"""The KV-pressure benchmark (benchmarks/kv_pressure.py): options, the report's figures and
agreement, and one small run of both admission modes on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kv_pressure
from cellbatch.bench.report import Divergence
from cellbatch.runner.admission import GROWTH_CELLS
from kv_pressure import OPTIMISTIC, RESERVE, ModeRun, PressureReport

# -- options -----------------------------------------------------------------------


def test_defaults_are_the_issue_figures() -> None:
    options = kv_pressure.parse_options([])
    assert (options.generations, options.max_new_tokens) == (64, 256)
    assert (options.worst_cases, options.max_sessions, options.dtype) == (16, 64, "float32")
    assert options.repeats >= 3
    assert options.output_json == Path("benchmarks/results/kv-pressure-float32.json")
    quick = kv_pressure.parse_options(["--quick", "--dtype", "bfloat16", "--repeats", "2"])
    assert (quick.generations, quick.repeats) == (kv_pressure.QUICK_GENERATIONS, 2)
    assert quick.output_json == Path("benchmarks/results/kv-pressure-bfloat16-quick.json")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--generations", "0"], "--generations must be >= 1, got 0"),
        (["--max-new-tokens", "-3"], "--max-new-tokens must be >= 1, got -3"),
        (["--worst-cases", "0"], "--worst-cases must be >= 1"),
        (["--max-sessions", "0"], "--max-sessions must be >= 1"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--dtype", "float16"], "invalid choice"),
        (["--model", "/no/such/model.gguf"], "does not exist"),
    ],
)
def test_bad_options_exit_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        kv_pressure.parse_options(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# -- the report --------------------------------------------------------------------


def _report(runs: list[ModeRun]) -> PressureReport:
    options = kv_pressure.parse_options(["--quick"])
    return PressureReport(options, {}, [40, 90], 4 * (90 + 64), runs)


def _run(mode: str, repeat: int, tokens: list[list[int]], seconds: float) -> ModeRun:
    return ModeRun(mode, repeat, seconds, tokens)


def test_medians_ratio_and_agreement() -> None:
    same = [[1, 2, 3], [4, 5]]
    report = _report(
        [
            _run(OPTIMISTIC, 0, same, 1.0),
            _run(RESERVE, 0, same, 4.0),
            _run(OPTIMISTIC, 1, same, 2.0),
            _run(RESERVE, 1, same, 2.0),
            _run(OPTIMISTIC, 2, same, 0.5),
            _run(RESERVE, 2, same, 5.0),
        ]
    )
    assert report.median_tokens_per_s(OPTIMISTIC) == pytest.approx(5.0)
    assert report.median_tokens_per_s(RESERVE) == pytest.approx(1.25)
    assert report.ratio() == pytest.approx(4.0)
    assert report.ok and report.tokens_agree


def test_differing_tokens_are_counted_and_fail_the_run() -> None:
    report = _report(
        [_run(OPTIMISTIC, 0, [[1, 2, 3], [4, 5]], 1.0), _run(RESERVE, 0, [[1, 2, 3], [4, 6]], 1.0)]
    )
    agreement = report.agreement()
    assert agreement is not None and (agreement.identical, agreement.total) == (1, 2)
    assert agreement.divergences == [Divergence(1, 1, 5, 6)]
    assert not report.tokens_agree
    assert "1/2 generations identical" in kv_pressure.format_report(report)


def test_a_repeat_that_differs_from_its_first_call_fails_the_run() -> None:
    report = _report(
        [
            _run(OPTIMISTIC, 0, [[1, 2]], 1.0),
            _run(RESERVE, 0, [[1, 2]], 1.0),
            _run(OPTIMISTIC, 1, [[1, 3]], 1.0),
            _run(RESERVE, 1, [[1, 2]], 1.0),
        ]
    )
    assert report.agreement().identical == 1  # type: ignore[union-attr]
    assert not report.repeats_agree() and not report.tokens_agree


def test_a_failed_call_is_reported_and_left_out_of_the_medians() -> None:
    failed = ModeRun(RESERVE, 1, 3.0, error="RuntimeError: prompt 0: failed")
    report = _report([_run(OPTIMISTIC, 0, [[1, 2]], 1.0), _run(RESERVE, 0, [[1, 2]], 2.0), failed])
    assert report.median_tokens_per_s(RESERVE) == pytest.approx(1.0)
    assert not report.ok
    assert "reserve #2 failed: RuntimeError" in kv_pressure.format_report(report)


# -- end to end on a tiny random model -----------------------------------------------


def test_both_modes_run_on_a_tiny_model_with_the_same_tokens(
    tiny_bench_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "kv.json"
    new_tokens = 4 * GROWTH_CELLS  # optimistic starts more than reserve only well past it
    argv = [
        "--model", str(tiny_bench_model),
        "--threads", str(torch.get_num_threads()),  # the run sets it process-wide
        "--generations", "8", "--max-new-tokens", str(new_tokens), "--worst-cases", "2",
        "--max-sessions", "8", "--repeats", "1", "--output-json", str(output),
    ]  # fmt: skip
    assert kv_pressure.main(argv) == 0
    data = json.loads(output.read_text())
    assert data["max_cells"] == 2 * (max(data["prompt_tokens"]) + new_tokens)
    optimistic, reserve = data["modes"][OPTIMISTIC], data["modes"][RESERVE]
    assert optimistic["outputs"] == reserve["outputs"] and len(reserve["outputs"]) == 8
    assert data["agreement"] == {"identical": 8, "total": 8, "divergences": []}
    for mode in (optimistic, reserve):
        (run,) = mode["runs"]
        assert run["error"] == "" and 8 <= run["generated_tokens"] <= 8 * new_tokens
        assert run["tokens_per_s"] > 0
    # A pool of two worst cases: reserve runs at most two at once and never preempts;
    # optimistic starts more, and has to preempt to finish them.
    assert reserve["peak_concurrent_generations"] <= 2
    assert reserve["runs"][0]["preemptions"] == 0
    assert optimistic["peak_concurrent_generations"] > reserve["peak_concurrent_generations"]
    assert optimistic["runs"][0]["preemptions"] > 0
    assert optimistic["runs"][0]["recomputed_tokens"] > 0
    printed = capsys.readouterr().out
    assert "8/8 generations identical" in printed and "optimistic / reserve" in printed
