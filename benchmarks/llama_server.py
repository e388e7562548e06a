"""llama.cpp's `llama-server` for the benchmarks that run it as a peer (scale.py,
speculative_peers.py): started on a GGUF file, used once it answers `/health`, stopped
after.

Owns: the server process and its log. Its log goes to a temporary file, never a pipe: a
pipe nobody reads fills up and stalls the server. Never: sends requests of its own beyond
the health check (each benchmark feeds it its own workload).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import llama_cpp_tools


@dataclass(frozen=True)
class RunningServer:
    url: str
    load_seconds: float  # from the start to the first healthy answer


@contextmanager
def running_llama_server(
    model: str | Path, threads: int, slots: int, context: int, extra: Sequence[str] = ()
) -> Iterator[RunningServer]:
    """llama-server on `model` with `slots` slots over one KV buffer of `context` tokens
    (`-kvu`), `threads` threads for prompts and decoding, and `extra` arguments; the
    server's last log lines are in the error when it exits before it is healthy."""
    import httpx

    port = 18000 + os.getpid() % 1000
    command = [
        str(llama_cpp_tools.binary("llama-server")), "-m", str(model), "-t", str(threads),
        "-tb", str(threads), "-np", str(slots), "-kvu", "-c", str(context),
        "--host", "127.0.0.1", "--port", str(port), "--no-webui", *extra,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            began = time.perf_counter()
            with httpx.Client(timeout=10) as client:
                while True:
                    if server.poll() is not None:
                        log.seek(0)
                        raise RuntimeError(f"llama-server exited: {log.read()[-3000:]}")
                    try:
                        if client.get(f"{url}/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.3)
            yield RunningServer(url, time.perf_counter() - began)
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
