"""`cellbatch run` interrupted during generation keeps what it has: the first SIGINT or
SIGTERM cancels what still runs, prints every answer so far and writes the report,
then exits 130 (143 for SIGTERM) without a traceback.

Runs the real command in a subprocess on a tiny random model (token-id prompts, so no
tokenizer is needed) with one session, so that the prompts run one after another and
the signal, sent once the progress bar has counted two prompts' tokens, lands midway.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tiny_models import make_tiny_checkpoint

PROMPTS = 200
NEW_TOKENS = 60
TIME_LIMIT_S = 120.0


def generated(stderr: str) -> int:
    """The progress bar's last count of generated tokens."""
    counts = re.findall(r"generating: (\d+)tok", stderr)
    return int(counts[-1]) if counts else 0


def read_until(terminal: int, process: subprocess.Popen[bytes], done: Callable[[str], bool]) -> str:
    """What the process writes to `terminal` until `done(all of it)` or it closes it."""
    deadline = time.monotonic() + TIME_LIMIT_S
    seen = b""
    while not done(seen.decode(errors="replace")):
        assert time.monotonic() < deadline, f"timed out; the process wrote:\n{seen!r}"
        ready, _, _ = select.select([terminal], [], [], 0.1)
        if not ready:
            continue
        try:
            part = os.read(terminal, 65536)
        except OSError:  # the process closed its end
            part = b""
        if not part:
            break
        seen += part
    return seen.decode(errors="replace")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("interrupt")
    folder = make_tiny_checkpoint(
        "llama", root / "llama", eos_token_id=None, bos_token_id=None, pad_token_id=None
    )[1]
    prompts = root / "ids.txt"
    lines = (f"{i % 90 + 1} {i % 90 + 2} {i // 90 + 3}\n" for i in range(PROMPTS))
    prompts.write_text("".join(lines))  # ids inside the tiny model's vocabulary of 96
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
    # stderr on a pseudo-terminal: the progress bar counts the tokens generated, so the
    # signal comes once some generations have finished and most have not, on any CPU.
    terminal, stderr_end = pty.openpty()
    termios.tcsetwinsize(stderr_end, (24, 100))  # tqdm draws nothing 0 columns wide
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr_end, env=env)
    os.close(stderr_end)
    try:
        seen = read_until(terminal, process, lambda text: generated(text) >= 2 * NEW_TOKENS)
        process.send_signal(signum)
        stdout = process.communicate(timeout=TIME_LIMIT_S)[0].decode()
        stderr = seen + read_until(terminal, process, lambda text: False)
    finally:
        os.close(terminal)
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr
    assert f"interrupted by {signal.Signals(signum).name}" in stderr
    reasons = [entry["finish_reason"] for entry in json.loads(report.read_text())["generations"]]
    assert len(reasons) == PROMPTS
    assert "token_limit" in reasons and "cancelled" in reasons
    assert set(reasons) <= {"token_limit", "cancelled"}
    assert "cancelled" in stdout  # the printout marks them too
