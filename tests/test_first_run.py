"""A user's first runs (issue 10): loading says what it does, option errors come before
it, a run killed while it loads exits with one line and leaves nothing that slows or
blocks the next run, and an install without a C++ compiler still runs (pure-torch ops,
one warning).

The runs are the real command in a subprocess, on a tiny random Llama with token-id
prompts (no tokenizer needed); the install is a real `pip install` of this checkout,
whose kernel build is made to fail as it would without a compiler.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cellbatch.cli import main
from cellbatch.engine import Engine
from tiny_models import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CELLBATCH = str(Path(sys.executable).with_name("cellbatch"))
TIME_LIMIT_S = 300.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model folder, token-id prompts file)."""
    root = tmp_path_factory.mktemp("first_run")
    folder = make_tiny_checkpoint(
        "llama", root / "llama", eos_token_id=None, bos_token_id=None, pad_token_id=None
    )[1]
    prompts = root / "ids.txt"
    prompts.write_text("5 17 33\n9 40 12 77\n")
    return folder, prompts


@pytest.fixture(scope="module")
def normal_run_s(tiny: tuple[Path, Path]) -> float:
    """How long an uninterrupted run takes here and now."""
    started = time.monotonic()
    process = start([CELLBATCH, *run_args(tiny)])
    _, stderr = finish(process)
    assert process.returncode == 0, stderr
    return time.monotonic() - started


def run_args(tiny: tuple[Path, Path], *extra: str) -> list[str]:
    folder, prompts = tiny
    return [
        "run", "--model", str(folder), "--prompt-tokens-file", str(prompts),
        "--max-new-tokens", "4", "--threads", "1", *extra,
    ]  # fmt: skip


def start(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """The command as a user's shell starts it: SIGINT at its default action, whatever the
    test runner's own disposition."""
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def finish(process: subprocess.Popen, timeout: float = TIME_LIMIT_S) -> tuple[str, str]:
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
        pytest.fail(f"no exit within {timeout:.0f} s:\n{stderr}")


def test_loading_says_what_it_does_phase_by_phase_and_quiet_keeps_still(tiny, tmp_path) -> None:
    report = tmp_path / "report.json"
    process = start([CELLBATCH, *run_args(tiny, "--report-json", str(report))])
    _, stderr = finish(process)
    assert process.returncode == 0, stderr
    lines = stderr.splitlines()
    assert lines[0] == f"cellbatch: loading {tiny[0]}"
    for phase in (
        "placed the threads: 1 thread (as asked) on ",
        "read the config of llama (llama, 2 layers)",
        "read and converted the weights of llama (",
        "prepared the model (",
        "found no tokenizer",
        "started the engine",
    ):
        assert any(
            line.startswith(f"cellbatch: {phase}") and line.endswith(" s") for line in lines
        ), (
            phase,
            stderr,
        )
    assert json.loads(report.read_text())["config"]["kernels"] in ("compiled", "torch")
    process = start([CELLBATCH, *run_args(tiny, "--quiet")])
    _, stderr = finish(process)
    assert process.returncode == 0, stderr
    assert "cellbatch: loading" not in stderr and " in " not in stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--max-sessions", "0"], "--max-sessions must be >= 1, got 0"),
        (["--max-decode-sequences", "-2"], "--max-decode-sequences must be >= 1, got -2"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--kv-dtype", "int4"], "--kv-dtype: unknown KV dtype 'int4'"),
        (["--numa", "nearest"], "--numa: unknown numa choice 'nearest'"),
        (["--dtype", "float64"], "--dtype: unknown dtype 'float64'"),
        (["--model", "/nonexistent/model.gguf"], "model /nonexistent/model.gguf does not exist"),
    ],
)
def test_option_errors_are_refused_before_the_model_loads(
    tiny, monkeypatch, capsys, options, message
) -> None:
    """In-process, with loading made impossible: the refusal comes first."""

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was asked for")

    monkeypatch.setattr(Engine, "from_pretrained", no_loading)
    assert main([*run_args(tiny), *options]) == 2
    stderr = capsys.readouterr().err
    assert message in stderr
    assert "cellbatch: loading" not in stderr


@pytest.mark.parametrize(
    ("signum", "after"),
    [
        (signal.SIGTERM, "cellbatch: loading"),
        (signal.SIGINT, "cellbatch: loading"),
        (signal.SIGINT, "cellbatch: read the config"),
        (signal.SIGTERM, "cellbatch: prepared the model"),
    ],
)
def test_a_run_killed_while_loading_exits_in_one_line_and_the_next_run_is_normal(
    tiny, normal_run_s, signum, after
) -> None:
    """Killed right after a phase line: it exits at once with one line, no traceback, no
    abort (if the load was faster than the signal, the generation's own handling answers
    instead, with the same status). The next run is not held up by anything left behind."""
    process = start([CELLBATCH, *run_args(tiny)])
    assert process.stderr is not None
    seen = ""
    while after not in seen:
        line = process.stderr.readline()
        assert line, f"exited before {after!r}:\n{seen}"
        seen += line
    process.send_signal(signum)
    _, rest = finish(process)
    stderr = seen + rest
    assert process.returncode == 128 + signum, stderr
    assert f"interrupted by {signal.Signals(signum).name}" in stderr
    assert "Traceback" not in stderr and "terminate called" not in stderr

    # A hang (a lock left behind, say) would run into the time limit.
    process = start([CELLBATCH, *run_args(tiny)])
    _, stderr = finish(process, timeout=3 * normal_run_s + 30)
    assert process.returncode == 0, stderr


def test_an_install_without_a_compiler_runs_on_torch_ops_with_one_warning(tiny, tmp_path) -> None:
    """`pip install` of this checkout with no usable C++ compiler: the install succeeds
    without the kernels and says why; `cellbatch run` from that install runs the pure-torch
    ops and warns once."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "src",
        source / "src",
        ignore=shutil.ignore_patterns("_C.so", "_C.json", "__pycache__", "*.egg-info"),
    )
    target = tmp_path / "site"
    missing = str(tmp_path / "no-compiler" / "c++")
    command = [sys.executable, "-m", "pip", "install", "--verbose", "--no-deps", "--no-index"]
    command += ["--no-build-isolation", "--target", str(target), str(source)]
    install = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, "CC": missing, "CXX": missing},
        timeout=TIME_LIMIT_S,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    assert "compiled kernels not built" in install.stdout + install.stderr
    kernels = target / "cellbatch" / "model" / "kernels"
    assert kernels.is_dir() and not (kernels / "_C.so").exists()

    report = tmp_path / "report.json"
    process = start(
        [sys.executable, "-m", "cellbatch.cli", *run_args(tiny, "--report-json", str(report))],
        env={"PYTHONPATH": str(target)},
    )
    _, stderr = finish(process)
    assert process.returncode == 0, stderr
    warnings = [line for line in stderr.splitlines() if "compiled kernels unavailable" in line]
    assert len(warnings) == 1 and "not built when cellbatch was installed" in warnings[0]
    assert json.loads(report.read_text())["config"]["kernels"] == "torch"
    refused = start(
        [sys.executable, "-m", "cellbatch.cli", *run_args(tiny, "--kernels", "compiled")],
        env={"PYTHONPATH": str(target)},
    )
    _, stderr = finish(refused)
    assert refused.returncode == 2 and "compiled kernels are not available" in stderr
    assert "cellbatch: loading" in stderr and "read the weights" not in stderr


def test_the_int8_kv_cache_runs_from_the_command_line(tiny, tmp_path, capsys) -> None:
    report = tmp_path / "report.json"
    assert main(run_args(tiny, "--kv-dtype", "int8", "--report-json", str(report))) == 0
    assert json.loads(report.read_text())["config"]["kv_dtype"] == "int8"
