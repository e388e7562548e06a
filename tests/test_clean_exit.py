"""A process that uses cellbatch exits with its own status, whatever it left open.

An engine thread still inside a torch call when the interpreter finalizes is unwound
through C++ frames and the process aborts (exit 134, "terminate called without an
active exception"), at random; before the runner's exit hook, 6 of 10 runs of the
script below did. So each case runs many times, two processes at a time (10 runs miss a
fault that strikes 6 runs in 10 once in about 10,000 suites).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tiny_models import make_tiny_chat_checkpoint

RUNS = 10
CLI_RUNS = 6

LEFT_OPEN = """
import sys

from cellbatch.engine import Engine
from cellbatch import FinishReason, GenConfig

idle = Engine.from_pretrained(sys.argv[1], dtype="float32", max_sessions=2)
engine = Engine.from_pretrained(sys.argv[1], dtype="float32", max_sessions=4)
session = engine.open_session()
for question in ("Say something.", "More."):
    turn = session.generate_async(engine.chat_tokens(question), GenConfig(max_new_tokens=8))
    assert turn.result().finish_reason is not FinishReason.FAILED
cancelled = session.generate_async(engine.chat_tokens("Again."), GenConfig(max_new_tokens=9999))
cancelled.cancel()
assert cancelled.result().finish_reason is FinishReason.CANCELLED
running = engine.open_session()
endless = running.generate_async(
    engine.chat_tokens("Go on."), GenConfig(max_new_tokens=200, stop_tokens=frozenset())
)
while not endless.tokens():  # it is generating: the engine thread is in torch now
    pass
print("left open", flush=True)
"""


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_checkpoint(tmp_path_factory.mktemp("exit") / "llama")


def run_many(command: list[str], runs: int) -> list[subprocess.CompletedProcess[str]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def once(_: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(once, range(runs)))


def assert_all_clean(processes: list[subprocess.CompletedProcess[str]], expect: str) -> None:
    unclean = [
        f"exit {p.returncode}: {p.stderr[-600:]}"
        for p in processes
        if p.returncode != 0 or "terminate" in p.stderr or expect not in p.stdout
    ]
    assert not unclean, f"{len(unclean)} of {len(processes)} runs did not exit cleanly:\n" + (
        "\n".join(unclean)
    )


def test_a_script_leaving_engines_and_a_running_generation_open_exits_cleanly(
    chat_model: Path, tmp_path: Path
) -> None:
    script = tmp_path / "left_open.py"
    script.write_text(LEFT_OPEN)
    assert_all_clean(run_many([sys.executable, str(script), str(chat_model)], RUNS), "left open")


def test_cellbatch_run_exits_cleanly(chat_model: Path) -> None:
    cellbatch = Path(sys.executable).with_name("cellbatch")
    command = [
        str(cellbatch), "run", "--model", str(chat_model), "--dtype", "float32",
        "--max-new-tokens", "16", "Hello there.", "Count to ten.", "Name a colour.",
    ]  # fmt: skip
    assert_all_clean(run_many(command, CLI_RUNS), "Hello there.")
