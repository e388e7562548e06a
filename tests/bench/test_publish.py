"""`cellbatch bench --report`: results files rendered into the README's headline table and
the benchmarks page, between their markers and nowhere else; and the checkout's own
published figures are what its results files give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cellbatch.bench import publish, results
from cellbatch.bench.results import Headline, Results, ResultTable, results_fields
from cellbatch.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
MACHINE = {
    "cpu": "Test CPU",
    "cpu_kind": "AVX512 (BF16, VNNI) + AMX",
    "cores": 2,
    "threads": 2,
    "torch": "2.13.0",
    "cellbatch_commit": "abc1234",
}


def write_results(folder: Path, name: str, *, headline: bool = True) -> Path:
    data = results_fields(
        Results(
            benchmark=name,
            title=f"The {name} run",
            command=f"python benchmarks/{name}.py --threads 2",
            tables=[ResultTable("tokens/s", ("mode", "tokens/s"), [("default", 123.456)])],
            headline=[Headline("32 prompts", 300.0, "vLLM", 200.0)] if headline else [],
            plot=f"{name}.png",
            machine=MACHINE,
        )
    )
    path = folder / f"{name}.json"
    path.write_text(json.dumps({**data, "details": [1, 2]}))
    return path


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "README.md").write_text(
        "# x\n\nbefore\n<!-- results:headline -->\nold\n<!-- /results:headline -->\nafter\n"
    )
    (tmp_path / "docs" / "benchmarks.md").write_text(
        "# B\n<!-- results:tables -->\n<!-- /results:tables -->\nend\n"
    )
    return tmp_path


def test_report_renders_between_the_markers(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_results(checkout / "docs" / "results", "serve_load")
    write_results(checkout / "docs" / "results", "quantized", headline=False)
    monkeypatch.chdir(checkout)
    assert cli_main(["bench", "--report"]) == 0
    readme = (checkout / "README.md").read_text()
    assert readme.startswith("# x\n\nbefore\n<!-- results:headline -->\n")
    assert readme.endswith("<!-- /results:headline -->\nafter\n") and "old" not in readme
    assert "| 32 prompts | 300.0 tokens/s | vLLM: 200.0 | **1.50x** | 1 |" in readme
    assert "Test CPU (AVX512 (BF16, VNNI) + AMX), 2 cores, 2 threads" in readme
    assert "(docs/benchmarks.md#results-serve-load)" in readme
    page = (checkout / "docs" / "benchmarks.md").read_text()
    # sections in file-name order, each with its command, machine, table and plot
    assert page.index("The quantized run") < page.index("The serve_load run")
    assert "### The serve_load run {#results-serve-load}" in page
    assert "python benchmarks/serve_load.py --threads 2\n" in page
    assert "| default | 123.5 |" in page
    assert "![The serve_load run](results/serve_load.png)" in page
    assert "cellbatch abc1234" in page and page.endswith("<!-- /results:tables -->\nend\n")
    # the same results give the same text, and --check agrees
    assert publish.main(["--check"]) == 0
    (checkout / "docs" / "results" / "quantized.json").unlink()
    assert publish.main(["--check"]) == 1


def test_report_refuses_files_without_machine_or_command(
    checkout: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (checkout / "docs" / "results" / "old.json").write_text(json.dumps({"tokens_per_s": 1.0}))
    monkeypatch.chdir(checkout)
    assert publish.main([]) == 2
    error = capsys.readouterr().err
    assert "old.json lacks benchmark, title, command, machine" in error


def test_report_refuses_a_target_without_markers(
    checkout: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_results(checkout / "docs" / "results", "throughput")
    (checkout / "README.md").write_text("# no markers\n")
    monkeypatch.chdir(checkout)
    assert publish.main([]) == 2
    assert "has no <!-- results:headline -->" in capsys.readouterr().err
    assert (checkout / "README.md").read_text() == "# no markers\n"


def test_cpu_kind_names_the_width_and_the_product_instructions() -> None:
    sapphire = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16"}
    assert results.cpu_kind(sapphire, "AVX512") == "AVX512 (BF16, VNNI, FP16) + AMX"
    assert results.cpu_kind({"avx512_bf16", "avx512_vnni"}, "AVX512") == (
        "AVX512 (BF16, VNNI), no AMX"
    )
    assert results.cpu_kind(sapphire, "AVX2") == "AVX2"  # capped: the width torch runs at


def test_the_checkouts_figures_are_what_its_results_give(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    status = publish.main(["--check"])
    assert status == 0, capsys.readouterr().out
    for path in (ROOT / "docs" / "results").glob("*.json"):
        data = json.loads(path.read_text())
        assert data["machine"]["cpu_kind"] and data["command"], path
        if data.get("plot"):
            assert (path.parent / data["plot"]).is_file(), f"{path} names a missing plot"
