"""vLLM as a throughput peer: the answer its driver writes among vLLM's own log lines
is read, its own time is the run's, and a missing environment is a failing run that
says how to build it. A stand-in script plays the driver's Python here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cellbatch.bench import vllm_driver
from cellbatch.bench.peers import time_peer
from cellbatch.bench.vllm_peer import ANSWER_MARK, vllm_peer

STAND_IN = f"""#!{sys.executable}
import json, sys
request = json.load(sys.stdin)
assert sys.argv[2] == "generate" and request["dtype"] == "float32"
print("INFO vLLM is starting")
outputs = [prompt[:1] * request["max_new_tokens"] for prompt in request["prompts"]]
print({ANSWER_MARK!r} + json.dumps({{"outputs": outputs, "seconds": 1.5, "version": "x"}}))
print("INFO shutting down")
"""


def test_the_driver_and_its_reader_agree_on_the_mark() -> None:
    assert vllm_driver.ANSWER_MARK == ANSWER_MARK


def test_the_peer_reads_the_answer_and_its_own_time(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    peer = vllm_peer(python, tmp_path, 2, "float32", 2, frozenset({2}))
    run = time_peer(peer, [[5, 6], [7]], 3)
    assert run.ok, run.error
    assert run.outputs == [[5, 5, 5], [7, 7, 7]] and run.seconds == 1.5


def test_a_missing_environment_says_how_to_build_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make peers"):
        vllm_peer(tmp_path / "nope", tmp_path, 2, "float32", 2, frozenset({2}))
