"""A `cellbatch serve` process killed (SIGKILL) in the middle of a batch and started again
on the same `--data-dir` finishes the batch: every line answered exactly once, and the
lines answered before the kill kept as they were (not run again)."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

LINES = 160
TERMINAL = ("completed", "failed", "cancelled", "expired")


def start(model: Path, data: Path, port: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "cellbatch.cli", "serve", "--model", str(model), "--port", str(port),
        "--data-dir", str(data), "--dtype", "float32", "--kernels", "torch", "--threads", "1",
        "--max-sessions", "8", "--quiet",
    ]  # fmt: skip
    server = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert server.poll() is None, "the server exited while starting"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.kill()
    raise AssertionError("the server did not start")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def answered_lines(data: Path, batch_id: str) -> dict[int, str]:
    with sqlite3.connect(data / "cellbatch.sqlite3") as db:
        rows = db.execute(
            "SELECT line, answer FROM batch_answers WHERE batch_id = ?", (batch_id,)
        ).fetchall()
    return dict(rows)


def test_a_server_killed_mid_batch_finishes_it_after_a_restart(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    data, port = tmp_path / "data", free_port()
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions" if i % 2 else "/v1/completions",
            "body": (
                {"messages": [{"role": "user", "content": f"Go {i}"}], "max_tokens": 40}
                if i % 2
                else {"prompt": f"Go {i}", "max_tokens": 40}
            )
            | {"ignore_eos": True, "temperature": 0},
        }
        for i in range(LINES)
    ]
    server = start(tiny_chat_model, data, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        text = "\n".join(json.dumps(line) for line in lines)
        file_id = client.files.create(
            file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch"
        ).id
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 120
        while client.batches.retrieve(batch.id).request_counts.completed < 12:
            assert time.monotonic() < deadline, "the batch made no progress"
            time.sleep(0.02)
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        before = answered_lines(data, batch.id)
        assert 12 <= len(before) < LINES, "the kill came after the batch had ended"

        server = start(tiny_chat_model, data, port)
        deadline = time.monotonic() + 120
        while (resumed := client.batches.retrieve(batch.id)).status not in TERMINAL:
            assert time.monotonic() < deadline, "the batch did not finish after the restart"
            time.sleep(0.1)
        assert resumed.status == "completed", resumed
        counts = resumed.request_counts
        assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
        output = client.files.content(resumed.output_file_id).text.splitlines()
        assert resumed.error_file_id is None
        ids = [json.loads(line)["custom_id"] for line in output]
        assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
        # The lines answered before the kill are the very lines written (not run again).
        for number, answer in before.items():
            assert output[number - 1] == answer
        for line in output:
            choice = json.loads(line)["response"]["body"]["choices"][0]
            assert choice["finish_reason"] == "length"  # none cut short by the kill
    finally:
        server.kill()
        server.wait(30)
