"""The HTTP API fuzzed from the OpenAPI schema it publishes, with schemathesis.

Requests drawn from `/openapi.json` (valid ones and, where schemathesis mutates them,
invalid ones) go straight to the ASGI app over a tiny model: no answer is a 5xx, every
status, content type and JSON body is the one the schema documents, and every 4xx is
in OpenAI's error shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from cellbatch.engine import Engine
from cellbatch.server.app import ServerSettings, create_app
from cellbatch.server.backend import LocalBackend
from served import MODEL_NAME

EXAMPLES = 40  # per operation: bounded, so that CI stays quick


class KeptOpen(LocalBackend):
    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def api(tiny_chat_model: Path) -> Iterator[schemathesis.BaseSchema]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine.from_pretrained(
        tiny_chat_model, dtype="float32", kernels="torch", max_sessions=4
    )
    # Schemathesis runs the app's lifespan around each request, and the app closes its
    # backend when its lifespan ends; this backend leaves the engine to the fixture.
    app = create_app(KeptOpen(engine), ServerSettings(served_model_name=MODEL_NAME))
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    engine.close()
    torch.set_num_threads(threads)


READS = [
    ("GET", "/health"),
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("GET", "/v1/files"),
    ("GET", "/v1/batches"),
]
GENERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]
TOKENS = [("POST", "/tokenize"), ("POST", "/detokenize")]
# The Files, Batch and Embeddings APIs: those that take a body, and those that take an
# id alone (drawn ids name nothing: their 404s are checked; any string is a valid id,
# so no request breaks their schema).
BATCH_BODIES = [("POST", "/v1/embeddings"), ("POST", "/v1/files"), ("POST", "/v1/batches")]
BY_ID = [
    ("GET", "/v1/files/{file_id}"),
    ("GET", "/v1/files/{file_id}/content"),
    ("DELETE", "/v1/files/{file_id}"),
    ("GET", "/v1/batches/{batch_id}"),
    ("POST", "/v1/batches/{batch_id}/cancel"),
]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def test_the_schema_lists_every_route(api: schemathesis.BaseSchema) -> None:
    listed = {(op.ok().method.upper(), op.ok().path) for op in api.get_all_operations()}
    assert listed == {*READS, *GENERATIONS, *TOKENS, *BATCH_BODIES, *BY_ID}


def call_and_check(case: schemathesis.Case) -> None:
    """Call the app; the answer must be what the schema documents, a 4xx in OpenAI's
    error shape."""
    response = case.call()
    case.validate_response(response, checks=CHECKS)
    if 400 <= response.status_code < 500:
        body = response.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@pytest.mark.parametrize(("method", "path"), READS)
def test_the_reads_answer_as_documented(api: schemathesis.BaseSchema, method, path) -> None:
    call_and_check(api[path][method].Case())  # they take no parameters: one request each


@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [
        (method, path, mode)
        for method, path in GENERATIONS + TOKENS + BATCH_BODIES + BY_ID
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        if (method, path) not in BY_ID or mode is GenerationMode.POSITIVE
    ],
)
def test_no_request_drawn_from_the_schema_breaks_the_api(
    api: schemathesis.BaseSchema, method: str, path: str, mode: GenerationMode
) -> None:
    calls: list[schemathesis.Case] = []

    @given(case=api[path][method].as_strategy(mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,  # the same requests on every run: a failure is reproducible
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def call(case: schemathesis.Case) -> None:
        calls.append(case)
        call_and_check(case)

    call()
    assert len(calls) >= EXAMPLES // 2, "schemathesis drew few requests"
