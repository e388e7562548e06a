"""The throughput benchmark (cellbatch.bench): prompt set, agreement, engine
windows, ratios, JSON, the matplotlib plot, options, one end-to-end run on a tiny random
model, and the `cellbatch bench` entry that runs it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import cellbatch.bench.peers as peers
import cellbatch.bench.plot as plot
import cellbatch.bench.report as report_module
import cellbatch.bench.workload as workload
from cellbatch import cli
from cellbatch.bench import throughput
from cellbatch.bench.plot import Series
from cellbatch.bench.report import (
    Agreement,
    BenchReport,
    ConcurrencyPoint,
    Divergence,
    EngineWindow,
    PeerRun,
)
from cellbatch.bench.workload import (
    CELLBATCH,
    CELLBATCH_UNSHARED,
    CHAT_PROMPTS,
    CONTINUOUS,
    PADDED,
    SINGLE,
)
from cellbatch.metrics import EngineMetrics

# -- prompt set --------------------------------------------------------------------


def test_prompt_set_is_32_distinct_requests() -> None:
    assert len(CHAT_PROMPTS) == 32
    assert len(set(CHAT_PROMPTS)) == 32
    assert all(text.strip() == text and text for text in CHAT_PROMPTS)


@pytest.mark.slow
def test_prompts_span_35_to_130_tokens_under_the_default_chat_template() -> None:
    from cellbatch.model.default import default_model_path
    from cellbatch.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    lengths = [
        len(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        for text in CHAT_PROMPTS
    ]
    assert min(lengths) >= 35 and max(lengths) <= 130
    # varied: both ends of the range are used, not just the middle
    assert min(lengths) <= 40 and max(lengths) >= 115


# -- agreement ---------------------------------------------------------------------


def test_until_stop_keeps_the_first_stop_token_and_drops_the_rest() -> None:
    assert peers.until_stop([5, 6, 2, 7, 2], frozenset({2})) == [5, 6, 2]
    assert peers.until_stop([5, 0, 2], frozenset({0, 2})) == [5, 0]
    assert peers.until_stop([5, 6], frozenset({2})) == [5, 6]


def test_first_divergence() -> None:
    assert report_module.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert report_module.first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert report_module.first_divergence([1, 2], [1, 2, 3]) == 2
    assert report_module.first_divergence([1, 2, 3], [1, 2]) == 2


def test_compare_counts_identical_prompts_and_records_divergences() -> None:
    agreement = report_module.compare([[1, 2, 3], [4, 5], [6, 7]], [[1, 2, 3], [4, 8], [6, 7, 9]])
    assert (agreement.total, agreement.identical) == (3, 1)
    assert agreement.divergences == [Divergence(1, 1, 5, 8), Divergence(2, 2, None, 9)]


def test_compare_refuses_runs_over_different_prompt_counts() -> None:
    with pytest.raises(ValueError, match="same prompts"):
        report_module.compare([[1]], [[1], [2]])


def test_parity_rule_excuses_one_near_tie_only() -> None:
    tie = Divergence(0, 3, 7, 8, top2_gap=0.004, ours_in_top2=True)
    wide = Divergence(1, 3, 7, 8, top2_gap=0.5, ours_in_top2=True)
    third = Divergence(2, 3, 7, 8, top2_gap=0.004, ours_in_top2=False)
    assert tie.near_tie and not wide.near_tie and not third.near_tie
    assert Agreement(4, []).meets_parity_rule
    assert Agreement(4, [tie]).meets_parity_rule
    assert not Agreement(4, [wide]).meets_parity_rule
    assert not Agreement(4, [third]).meets_parity_rule
    assert not Agreement(4, [tie, Divergence(3, 1, 2, 3, 0.001, True)]).meets_parity_rule


def test_probe_fills_the_reference_models_top2_gap() -> None:
    class Fixed(torch.nn.Module):
        """Logits that depend only on the context length: [.., 1.0, 0.995, 0.2]."""

        def forward(self, ids: torch.Tensor):
            logits = torch.tensor([0.0, 1.0, 0.995, 0.2]).repeat(1, ids.shape[1], 1)
            return type("Out", (), {"logits": logits})

    agreement = Agreement(1, [Divergence(0, 2, ours=2, reference=1)])
    peers.probe_divergences(Fixed(), [[3, 3]], [[1, 1, 1]], agreement)
    divergence = agreement.divergences[0]
    assert divergence.top2_gap == pytest.approx(0.005, abs=1e-6)
    assert divergence.ours_in_top2 and divergence.near_tie


# -- engine windows and ratios -------------------------------------------------------


def test_engine_window_takes_differences_and_counts_submission_as_idle() -> None:
    before = EngineMetrics(
        steps=10, step_time_sum=1.0, decode_only_steps=4, decode_only_tokens=40,
        decode_only_time=0.5, last_step_end=100.0,
    )  # fmt: skip
    after = EngineMetrics(
        steps=30, step_time_sum=2.8, decode_only_steps=19, decode_only_tokens=520,
        decode_only_time=1.7, last_step_end=103.0,
    )  # fmt: skip
    window = EngineWindow.between(before, after, started=101.0)
    assert (window.steps, window.decode_only_steps, window.decode_only_tokens) == (20, 15, 480)
    assert window.wall_seconds == pytest.approx(2.0)
    assert window.idle_fraction == pytest.approx(1 - 1.8 / 2.0)
    assert window.decode_only_tokens_per_s == pytest.approx(480 / 1.2)
    assert window.sessions_per_decode_step == pytest.approx(32)


def test_engine_window_without_steps_has_no_rates() -> None:
    metrics = EngineMetrics()
    window = EngineWindow.between(metrics, metrics, started=5.0)
    assert window.idle_fraction == 0.0
    assert window.decode_only_tokens_per_s == 0.0
    assert window.sessions_per_decode_step == 0.0


def _run(name: str, tokens: int, seconds: float, error: str = "") -> PeerRun:
    return PeerRun(name, name, 4, "float32", seconds, [[1] * tokens], error)


def _report(runs: list[PeerRun]) -> BenchReport:
    options = workload.parse_options(["--quick", "--dtype", "float32", "--output-json", "x.json"])
    window = EngineWindow(10, 1.0, 1.25, 8, 64, 0.5)
    return BenchReport(options, {"model": "tiny"}, [40, 50], runs, [ConcurrencyPoint(8, window)])


def test_ratios_divide_cellbatch_by_each_peer_that_ran() -> None:
    runs = [
        _run(PADDED, 100, 2.0),
        _run(CONTINUOUS, 100, 1.0, error="boom"),
        _run(CELLBATCH, 300, 1.5),
    ]
    report = _report(runs)
    assert report.ratios() == {f"{CELLBATCH}/{PADDED}": pytest.approx(200 / 50)}
    report.runs[2].error = "engine failed"
    assert report.ratios() == {}


def test_json_holds_peers_ratios_and_concurrency(tmp_path: Path) -> None:
    report = _report([_run(SINGLE, 10, 1.0), _run(CELLBATCH, 60, 2.0)])
    report.runs[1].agreement = Agreement(2, [Divergence(1, 4, 9, 8, 0.003, True)])
    path = tmp_path / "deep" / "figures.json"
    report_module.write_json(report, path)
    text = path.read_text()
    assert "[1, 1, 1, 1, 1, 1, 1, 1, 1, 1]" in text  # token lists stay on one line
    data = json.loads(text)
    assert data["peers"][CELLBATCH]["tokens_per_s"] == pytest.approx(30.0)
    assert data["peers"][CELLBATCH]["agreement"]["identical"] == 1
    assert data["peers"][CELLBATCH]["agreement"]["divergences"][0]["near_tie"] is True
    assert data["ratios"] == {f"{CELLBATCH}/{SINGLE}": pytest.approx(3.0)}
    assert data["concurrency"][0]["sessions"] == 8
    assert data["concurrency"][0]["decode_only_tokens_per_s"] == pytest.approx(128.0)
    assert data["concurrency"][0]["idle_fraction"] == pytest.approx(0.2)
    assert [p["tokens"] for p in data["prompts"]] == [40, 50]
    assert data["options"]["dtype"] == "float32"


# -- plot --------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_series_put_the_sweep_first_and_leave_failed_peers_out() -> None:
    report = _report([_run(PADDED, 100, 2.0), _run(CELLBATCH, 300, 1.5, error="boom")])
    series = plot.throughput_series(report)
    assert [s.joined for s in series] == [True, False]
    assert series[0].points == ((8, pytest.approx(128.0)),)
    assert series[1].points == ((4, pytest.approx(50.0)),)
    assert PADDED in series[1].label


def test_plot_is_a_png_that_matplotlib_wrote(tmp_path: Path) -> None:
    report = _report([_run(PADDED, 100, 2.0), _run(CELLBATCH, 300, 1.5)])
    path = tmp_path / "deep" / "plot.png"
    plot.write_plot(report, path)
    data = path.read_bytes()
    width, height = _png_size(data)
    assert (width, height) == tuple(round(inches * plot.DPI) for inches in plot.FIGURE_SIZE)
    assert b"Software" in data and b"matplotlib" in data.lower()  # its tEXt chunk


def test_chart_refuses_an_empty_plot() -> None:
    with pytest.raises(ValueError, match="nothing to plot"):
        plot.render_chart([Series("none", (), joined=False)], "t")


# -- options -----------------------------------------------------------------------


def test_quick_options_and_default_paths() -> None:
    options = workload.parse_options(["--quick", "--dtype", "float32"])
    assert (options.prompts, options.max_new_tokens) == (workload.QUICK_PROMPTS, 16)
    assert options.sessions == workload.QUICK_SESSIONS
    assert options.output_json == Path("benchmarks/results/throughput-float32-quick.json")
    assert options.plot == Path("benchmarks/results/throughput-float32-quick.png")
    assert not options.fp32_baseline


def test_full_options_default_to_the_issue_figures() -> None:
    options = workload.parse_options(["--dtype", "bfloat16", "--threads", "2"])
    assert (options.prompts, options.max_new_tokens, options.sessions) == (32, 64, (1, 8, 32, 64))
    assert options.output_json == Path("benchmarks/results/throughput-bfloat16.json")
    assert options.fp32_baseline and options.threads == 2
    explicit = workload.parse_options(
        ["--quick", "--prompts", "3", "--sessions", "2,5", "--no-fp32-baseline", "--no-plot"]
    )
    assert (explicit.prompts, explicit.sessions, explicit.plot) == (3, (2, 5), None)
    assert not explicit.fp32_baseline
    assert options.quantize == "none"  # float weights, as the peers have them
    assert workload.parse_options(["--quantize", "auto"]).quantize == "auto"
    assert (options.activations, options.ignore_eos) == ("auto", False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompts", "33"], "--prompts must be in 1..32"),
        (["--prompts", "0"], "--prompts must be in 1..32, got 0"),
        (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--sessions", "1,x"], "comma-separated integers"),
        (["--sessions", "0,4"], "counts must be >= 1"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--model", "/no/such/model.gguf"], "does not exist"),
    ],
)
def test_bad_options_exit_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        workload.parse_options(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_plot_without_matplotlib_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(workload.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit):
        workload.parse_options(["--quick"])
    assert "pip install -e '.[bench]'" in capsys.readouterr().err
    assert workload.parse_options(["--quick", "--no-plot"]).plot is None


def test_left_padding_puts_prompts_flush_right() -> None:
    ids, mask = peers.left_padded([[5, 6, 7], [8]], pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


# -- end to end on a tiny random model -----------------------------------------------


def test_quick_run_on_a_tiny_model_writes_every_figure(
    tiny_bench_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "figures.json"
    argv = [
        "--model", str(tiny_bench_model), "--dtype", "float32",
        "--threads", str(torch.get_num_threads()),  # the run sets it process-wide
        "--prompts", "3", "--max-new-tokens", "5", "--sessions", "1,3",
        "--output-json", str(output),
    ]  # fmt: skip
    assert throughput.main(argv) == 0
    data = json.loads(output.read_text())
    assert set(data["peers"]) == {SINGLE, PADDED, CONTINUOUS, CELLBATCH, CELLBATCH_UNSHARED}
    for name, peer in data["peers"].items():
        assert peer["error"] == "" and len(peer["outputs"]) == 3, name
        assert 3 <= peer["generated_tokens"] <= 15 and peer["tokens_per_s"] > 0
        if name != SINGLE:
            assert peer["agreement"]["total"] == 3
    # transformers agrees with itself on this well-separated random model
    for name in (PADDED, CONTINUOUS):
        assert data["peers"][name]["agreement"]["identical"] == 3
    # sharing the prompts' prefix changes no token
    assert data["peers"][CELLBATCH]["outputs"] == data["peers"][CELLBATCH_UNSHARED]["outputs"]
    others = (SINGLE, PADDED, CONTINUOUS, CELLBATCH_UNSHARED)
    assert set(data["ratios"]) == {f"{CELLBATCH}/{n}" for n in others}
    assert 0.0 <= data["peers"][CELLBATCH]["idle_fraction"] < 1.0
    assert [point["sessions"] for point in data["concurrency"]] == [1, 3]
    for point in data["concurrency"]:
        assert point["decode_only_steps"] >= 1 and point["decode_only_tokens_per_s"] > 0
        assert 0 < point["sessions_per_decode_step"] <= point["sessions"]
    assert _png_size(output.with_suffix(".png").read_bytes()) == (900, 500)
    printed = capsys.readouterr().out
    assert "transformers generate_batch" in printed and "decode-only" in printed
    # what the docs publish of it: the command as typed, the machine, tables, the plot
    assert data["command"] == "cellbatch bench " + " ".join(argv)
    assert data["machine"]["threads"] == torch.get_num_threads()
    assert data["machine"]["cpu_kind"] and data["machine"]["torch"] == torch.__version__
    assert data["plot"] == "figures.png"
    peers_table, sweep_table = data["tables"]
    assert len(peers_table["rows"]) == 5 and [r[0] for r in sweep_table["rows"]] == [1, 3]
    [headline] = data["headline"]  # transformers' continuous batching (vLLM did not run)
    assert headline["ratio"] == pytest.approx(data["ratios"][f"{CELLBATCH}/{CONTINUOUS}"])


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_ignore_eos_gives_every_peer_no_stop_tokens(
    tiny_bench_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    ignore_eos: bool,
) -> None:
    stops: list[frozenset[int]] = []

    def recording(engine: object, count: int, dtype: str, stop: frozenset[int], *args: object):
        stops.append(stop)
        return peers.cellbatch_peer(engine, count, dtype, stop, *args)

    monkeypatch.setattr(throughput, "cellbatch_peer", recording)
    output = tmp_path / "figures.json"
    argv = [
        "--model", str(tiny_bench_model), "--dtype", "float32",
        "--threads", str(torch.get_num_threads()),
        "--prompts", "3", "--max-new-tokens", "6", "--activations", "float",
        "--skip", "transformers-single", "--skip", "transformers-padded",
        "--skip", "transformers-continuous", "--skip", "sweep", "--no-fp32-baseline",
        "--no-plot", "--output-json", str(output),
        *(["--ignore-eos"] if ignore_eos else []),
    ]  # fmt: skip
    assert throughput.main(argv) == 0
    assert len(stops) == 2  # shared prefix and not
    assert all(stop == (frozenset() if ignore_eos else frozenset({2})) for stop in stops)
    data = json.loads(output.read_text())
    if ignore_eos:
        for name in (CELLBATCH, CELLBATCH_UNSHARED):
            assert [len(tokens) for tokens in data["peers"][name]["outputs"]] == [6, 6, 6]
    printed = capsys.readouterr().out
    assert ("exactly 6 new tokens (stop tokens ignored)" in printed) == ignore_eos
    assert "--activations float" in printed  # named in cellbatch's label, not being auto
    assert "float weights (--quantize none)" in printed  # the bench's, not the engine's


def test_report_text_warns_when_the_machine_was_busy() -> None:
    report = _report([_run(SINGLE, 10, 1.0), _run(CELLBATCH, 60, 2.0)])
    report.environment.update(cores=2, load_average_1min_at_start=0.4)
    report.environment["load_average_1min_at_end"] = 0.9
    text = report_module.format_report(report)
    assert "3.00x" in text and "busy" not in text
    report.environment["load_average_1min_at_end"] = 3.5
    assert "load 0.4 at start, 3.5 at end, on 2 cores" in report_module.format_report(report)


def test_reference_is_the_single_run_else_the_padded_one() -> None:
    report = _report([_run(SINGLE, 10, 1.0), _run(PADDED, 10, 1.0), _run(CELLBATCH, 9, 1.0)])
    assert report.reference() is report.runs[0]
    report.runs[0].error = "interrupted"
    assert report.reference() is report.runs[1]
    assert _report([_run(CONTINUOUS, 10, 1.0)]).reference() is None


# -- `cellbatch bench` -----------------------------------------------------------------


def test_cellbatch_bench_runs_the_packaged_benchmark(
    tiny_bench_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "usage: cellbatch bench" in capsys.readouterr().out
    output = tmp_path / "figures.json"
    skips = [word for name in workload.SKIPPABLE for word in ("--skip", name)]
    argv = ["bench", "--model", str(tiny_bench_model), "--prompts", "2", *skips]
    argv += ["--no-fp32-baseline", "--dtype", "float32", "--output-json", str(output)]
    assert cli.main(argv) == 0
    data = json.loads(output.read_text())
    assert data["peers"] == {} and data["options"]["prompts"] == 2
