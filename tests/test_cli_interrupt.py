"""`cellbatch run` interrupted during generation keeps what it has: the first SIGINT or
SIGTERM cancels what still runs, prints every answer so far and writes the report,
then exits 130 (143 for SIGTERM) without a traceback.

Runs the real command in a subprocess on a tiny random model (token-id prompts, so no
tokenizer is needed) with one session, so that generation lasts long enough to be
interrupted midway.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny_models import make_tiny_checkpoint

PROMPTS = 80
NEW_TOKENS = 60
TIME_LIMIT_S = 120.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("interrupt")
    folder = make_tiny_checkpoint(
        "llama", root / "llama", eos_token_id=None, bos_token_id=None, pad_token_id=None
    )[1]
    prompts = root / "ids.txt"
    prompts.write_text("".join(f"{i + 1} {i + 2} {i + 3}\n" for i in range(PROMPTS)))
    return folder, prompts


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_generation_keeps_the_results(
    setup: tuple[Path, Path], tmp_path: Path, signum: int
) -> None:
    folder, prompts = setup
    report = tmp_path / "report.json"
    command = [
        str(Path(sys.executable).with_name("cellbatch")),
        "run",
        "--model", str(folder),
        "--prompt-tokens-file", str(prompts),
        "--max-new-tokens", str(NEW_TOKENS),
        "--max-sessions", "1",
        "--kernels", "torch",
        "--threads", "1",
        "--report-json", str(report),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert process.stderr is not None
    deadline = time.monotonic() + TIME_LIMIT_S
    seen = ""
    while "prompts started" not in seen:
        line = process.stderr.readline()
        assert line or process.poll() is None, f"exited early:\n{seen}"
        seen += line
        assert time.monotonic() < deadline
    time.sleep(5.0)  # some generations finish (each takes ~0.2 s), most are still to come
    process.send_signal(signum)
    stdout, rest = process.communicate(timeout=TIME_LIMIT_S)
    stderr = seen + rest
    assert process.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr
    assert f"interrupted by {signal.Signals(signum).name}" in stderr
    reasons = [entry["finish_reason"] for entry in json.loads(report.read_text())["generations"]]
    assert len(reasons) == PROMPTS
    assert "token_limit" in reasons and "cancelled" in reasons
    assert set(reasons) <= {"token_limit", "cancelled"}
    assert "cancelled" in stdout  # the printout marks them too
