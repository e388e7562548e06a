"""Live `cellbatch serve` apps for tests: the app of `create_app` under uvicorn in a
thread on 127.0.0.1, reached with the official `openai` and `anthropic` clients."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from cellbatch.engine import Engine
from cellbatch.server.api import Backend
from cellbatch.server.app import ServerSettings, create_app
from cellbatch.server.batch_features import BatchSettings

API_KEY = "test-key"
MODEL_NAME = "tiny"
CONTEXT = 256  # the tiny served model's max_position_embeddings
START_TIMEOUT_S = 30.0


@dataclass
class LiveServer:
    engine: Engine
    base_url: str
    server: uvicorn.Server
    thread: threading.Thread

    def client(self, **options: object):  # -> openai.OpenAI
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", **{"api_key": API_KEY, **options})

    def anthropic(self, **options: object):  # -> anthropic.Anthropic
        import anthropic

        return anthropic.Anthropic(base_url=self.base_url, **{"api_key": API_KEY, **options})

    def kv_cells_in_use(self) -> int:
        return self.engine.kv_usage().cells_in_use

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(START_TIMEOUT_S)


def start_live_server(
    model: Path,
    *,
    api_key: str | None = API_KEY,
    max_queued_requests: int = 256,
    tool_call_parser: str | None = None,
    data_dir: Path | None = None,
    reasoning_parser: str = "auto",
    batches: BatchSettings | None = None,
    **engine: object,
) -> LiveServer:
    """A server over a new Engine of `model` (engine options as in from_pretrained)."""
    options = {"dtype": "float32", "kernels": "torch", "max_sessions": 16, **engine}
    made = Engine.from_pretrained(model, **options)  # type: ignore[arg-type]
    base_url, server, thread = serve_in_thread(
        made,
        api_key,
        max_queued_requests,
        tool_call_parser,
        data_dir=data_dir,
        reasoning_parser=reasoning_parser,
        batches=batches,
    )
    return LiveServer(made, base_url, server, thread)


def serve_in_thread(
    backend: Engine | Backend,
    api_key: str | None = API_KEY,
    max_queued_requests: int = 256,
    tool_call_parser: str | None = None,
    served_model_name: str = MODEL_NAME,
    data_dir: Path | None = None,
    reasoning_parser: str = "auto",
    batches: BatchSettings | None = None,
) -> tuple[str, uvicorn.Server, threading.Thread]:
    """The app over `backend` under uvicorn on a free port of 127.0.0.1, started."""
    settings = ServerSettings(
        served_model_name=served_model_name,
        api_key=api_key,
        max_queued_requests=max_queued_requests,
        max_request_bytes=64 * 1024,
        shutdown_timeout=2.0,
        tool_call_parser=tool_call_parser,
        data_dir=data_dir,
        reasoning_parser=reasoning_parser,
        batches=batches or BatchSettings(),
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    box: list[uvicorn.Server] = []
    app = create_app(backend, settings, stopping=lambda: bool(box and box[0].should_exit))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    box.append(server)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread
