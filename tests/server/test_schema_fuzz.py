"""The published schema and the server agree, in both directions, on every route:
schemathesis runs against a live server from its `/openapi.json` with every check on
(`schemathesis run URL/openapi.json -c all`), deterministically.

Requests the schema allows are served (or refused only for what a schema cannot say:
`accepted_unless_cross_field` in `schema_checks.py` stands in for
`positive_data_acceptance` and lets through exactly the 400s whose code is in
`CROSS_FIELD_CODES`); requests it forbids are refused; no answer is a 5xx; every
status, content type, header, JSON body and streamed event is the one documented; the
API key is asked where the schema says so; the method a path lacks is a 405 naming
those it has.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from served import LiveServer, start_live_server
from tiny_models import make_tiny_chat_checkpoint

# One torch thread, as the other live servers of tests/server have (conftest's
# start_server): on a tiny model a second one only spins, and the run's time is the
# server's. A short context keeps each generation short: the run sends thousands of
# requests (4295, nearly all in the coverage phase).
pytestmark = pytest.mark.usefixtures("one_thread")
CONTEXT = 64
EXAMPLES = 10  # per operation in the fuzzing phase (the coverage phase is exhaustive)
# Only a hung server fails on time: `--checks all` would otherwise fail any answer
# slower than 10 s, as a paused machine can make of a 0.2 s one. Latency is the
# benchmarks' question.
HUNG_S = 60
HERE = Path(__file__).parent
ROUTES = {
    ("GET", "/health"),
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("GET", "/v1/responses/{response_id}/input_items"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/files"),
    ("GET", "/v1/files"),
    ("GET", "/v1/files/{file_id}"),
    ("GET", "/v1/files/{file_id}/content"),
    ("DELETE", "/v1/files/{file_id}"),
    ("POST", "/v1/batches"),
    ("GET", "/v1/batches"),
    ("GET", "/v1/batches/{batch_id}"),
    ("POST", "/v1/batches/{batch_id}/cancel"),
}


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = make_tiny_chat_checkpoint(tmp_path_factory.mktemp("fuzzed") / "llama", CONTEXT)
    server = start_live_server(model, api_key=None, max_sessions=4, prefix_cache_entries=4)
    yield server
    server.stop()


def test_the_schema_lists_every_route(fuzzed: LiveServer) -> None:
    schema = httpx.get(f"{fuzzed.base_url}/openapi.json").json()
    listed = {(method.upper(), path) for path, item in schema["paths"].items() for method in item}
    assert listed == ROUTES


def test_schemathesis_finds_no_disagreement(fuzzed: LiveServer) -> None:
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{fuzzed.base_url}/openapi.json",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--max-examples", str(EXAMPLES), "--generation-deterministic",
        "--continue-on-failure", "--output-sanitize", "false", "--no-color",
        "--request-timeout", str(HUNG_S), "--max-response-time", str(HUNG_S),
    ]  # fmt: skip
    environment = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "schema_checks",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-20000:]
