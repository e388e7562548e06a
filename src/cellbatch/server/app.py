"""`cellbatch serve`: the OpenAI-compatible HTTP app on FastAPI and uvicorn.

Owns: the routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`,
`/health`, `/metrics`; the LoRA adapters' in `cellbatch.server.adapters`), authentication
by API key, the request-size and queue
limits, the mapping of every error onto OpenAI's error shape, and the server's
life: the backend (one engine, or replicas) is closed when the app stops, and on
SIGINT/SIGTERM running requests get `shutdown_timeout` seconds to finish before they
are cancelled (their streams still end with a finish chunk).
Promises: every answer that is not a success is in OpenAI's error shape, unknown routes
(404) and methods (405) included; a bad request (bad JSON, wrong types, a prompt too
long, n or top_logprobs too large, an empty stop string, a field the server does not
support given a value that asks for something) is a 400 naming the parameter that harms
no other request; a `model` that is neither the served name, one of its aliases nor a
loaded LoRA adapter, a 404 `model_not_found`; an unknown top-level field is logged (once
per name) and otherwise ignored; a body over the limit is a 413; beyond
`max_queued_requests` waiting requests, a 429 with Retry-After; a missing or wrong key,
a 401 (except `OPEN_PATHS`: the health check and the API's description); an unexpected
exception, a 500 for that request alone; a client that disconnects cancels its
generations within a step. `/openapi.json` documents each POST route's request body
(exactly the fields read) and its answers.
Never: parses HTTP or frames server-sent events by hand (FastAPI/Starlette and
`fastapi.sse` do), or touches the engine's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from cellbatch.engine import Engine
from cellbatch.server.adapters import (
    LoadLoraAdapterRequest,
    ServedModels,
    UnloadLoraAdapterRequest,
    add_adapter_routes,
    with_adapter,
)
from cellbatch.server.api import ApiError, Backend
from cellbatch.server.backend import LocalBackend
from cellbatch.server.observability import ServerMetrics
from cellbatch.server.planner import RequestPlanner
from cellbatch.server.protocol import (
    CHAT_ONLY_FIELDS,
    UNSUPPORTED_FIELDS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorBody,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    dump,
    refused_fields,
)
from cellbatch.server.responses import Responses
from cellbatch.server.service import EngineService, Job, until_disconnected
from cellbatch.types import FinishReason

ModelT = TypeVar("ModelT", bound=BaseModel)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str  # the name answers carry and /v1/models lists first
    api_key: str | None = None
    model_aliases: tuple[str, ...] = ()  # other names a request's `model` may give
    max_queued_requests: int = 256
    max_request_bytes: int = 1 << 20
    shutdown_timeout: float = 10.0
    tool_call_parser: str | None = None  # a tool_calls.formats name; None: the template's


def create_app(
    engine: Engine | Backend,
    settings: ServerSettings,
    stopping: Callable[[], bool] = lambda: False,
) -> FastAPI:
    """The app serving `engine` (or any other backend: replicas, say). `stopping()`
    turns True once the process was asked to stop (uvicorn's signal handling); running
    requests then have `shutdown_timeout` seconds before they are cancelled."""
    backend: Backend = LocalBackend(engine) if isinstance(engine, Engine) else engine
    metrics = ServerMetrics()
    service = EngineService(
        backend, settings.served_model_name, metrics, settings.max_queued_requests
    )
    planner = RequestPlanner(backend, settings.tool_call_parser)
    metrics.watch(backend.collector(), service.load)
    responses = Responses(backend, settings.served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(_cancel_after_grace(service, stopping, settings))
        try:
            yield
        finally:
            watcher.cancel()
            service.cancel_all()
            await asyncio.to_thread(backend.close)

    app = FastAPI(title="cellbatch", lifespan=lifespan)
    app.state.service = service
    app.state.planner = planner

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        # Starlette's own answers (no such route, method not allowed), in OpenAI's shape.
        where = f"{request.method} {request.url.path}"
        allowed = (error.headers or {}).get("Allow")
        if error.status_code == 404:
            message = f"Invalid URL ({where})"
        elif error.status_code == 405 and allowed:
            message = f"Method not allowed ({where}); this route takes {allowed}"
        else:
            message = f"{error.detail} ({where})"
        headers = dict(error.headers) if error.headers else None
        return _error_response(ApiError(error.status_code, message), headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        return _error_response(ApiError(500, f"internal error: {error!r}", kind="server_error"))

    if settings.api_key is not None:
        app.add_middleware(RequireApiKey, api_key=settings.api_key)

    @app.get(
        "/health",
        responses={
            200: {"description": "serving", "content": {"application/json": {}}},
            503: {
                "description": "not serving (yet, or any more)",
                "content": {"application/json": {}},
            },
        },
    )
    async def health() -> JSONResponse:
        serving, body = await backend.health()
        return JSONResponse(body, status_code=200 if serving else 503)

    names = (settings.served_model_name, *settings.model_aliases)
    served = ServedModels(names, backend)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        return ModelList(data=served.cards(planner.context_limit)).model_dump(mode="json")

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus' text format",
                "content": {CONTENT_TYPE_LATEST.split(";")[0]: {}},
            }
        },
    )
    async def prometheus() -> Response:
        # Off the event loop: a backend may read its figures from other processes.
        exposition = await asyncio.to_thread(metrics.exposition)
        return Response(exposition, media_type=CONTENT_TYPE_LATEST)

    async def generate(request: Request, endpoint: str) -> Response:
        chat = endpoint == "chat/completions"
        body = await _read_body(request, settings)
        parsed: ChatCompletionRequest | CompletionRequest = (
            _parse(ChatCompletionRequest, body) if chat else _parse(CompletionRequest, body)
        )
        adapter = served.adapter_for(parsed.model)
        _check_fields(parsed, warned)
        service.admit()
        plan = (
            planner.plan_chat(parsed)
            if isinstance(parsed, ChatCompletionRequest)
            else planner.plan_completion(parsed)
        )
        plan = with_adapter(plan, adapter)
        job = await service.start(plan)
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            return EventSourceResponse(_stream(service, responses, job, endpoint, include_usage))
        return await _collect(service, responses, job, request, endpoint, chat=chat)

    warned: set[str] = set()

    @app.post("/v1/completions", responses=_answers(CompletionResponse, CompletionResponse))
    async def completions(request: Request) -> Response:
        return await generate(request, "completions")

    @app.post(
        "/v1/chat/completions", responses=_answers(ChatCompletionResponse, ChatCompletionChunk)
    )
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat/completions")

    @app.post("/tokenize", responses=_answers_of(TokenizeResponse))
    async def tokenize(request: Request) -> JSONResponse:
        parsed = _parse(TokenizeRequest, await _read_body(request, settings))
        served.adapter_for(parsed.model)
        return JSONResponse(dump(planner.tokenize(parsed)))

    @app.post("/detokenize", responses=_answers_of(DetokenizeResponse))
    async def detokenize(request: Request) -> JSONResponse:
        parsed = _parse(DetokenizeRequest, await _read_body(request, settings))
        served.adapter_for(parsed.model)
        return JSONResponse(dump(planner.detokenize(parsed)))

    async def read(request: Request, model: type[ModelT]) -> ModelT:
        return _parse(model, await _read_body(request, settings))

    add_adapter_routes(app, backend, read)

    _document_request_bodies(
        app,
        {
            "/v1/load_lora_adapter": LoadLoraAdapterRequest,
            "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/tokenize": TokenizeRequest,
            "/detokenize": DetokenizeRequest,
        },
    )
    return app


# What a client reaches without the API key: the health check, and the API's own
# description (FastAPI's schema and its pages).
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class RequireApiKey:
    """Refuses HTTP requests without `Authorization: Bearer <key>` (a 401 in OpenAI's
    shape), except to OPEN_PATHS. A plain ASGI middleware: Starlette's
    BaseHTTPMiddleware (`@app.middleware`) passes every streamed chunk through a memory
    stream and a task of its own, a sixth of the HTTP thread's time at 32 streaming
    clients."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                refusal = _error_response(
                    ApiError(
                        401,
                        "missing or wrong API key: send Authorization: Bearer <key>",
                        kind="authentication_error",
                        code="invalid_api_key",
                    )
                )
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Unknown field names remembered so as to warn once each; past this many, no more
# warnings (a client sending random names cannot grow the set without bound).
MAX_WARNED_FIELDS = 1024


def _check_fields(
    request: CompletionRequest | ChatCompletionRequest,
    warned: set[str],
) -> None:
    """Refuse the fields that ask for what the server does not do; log each unknown
    field name once."""
    refused = refused_fields(request.model_extra)
    if refused and refused[0] in CHAT_ONLY_FIELDS:
        raise ApiError(
            400,
            f"{refused[0]} works on /v1/chat/completions only: a completion has no tool "
            "calls; send the request there as messages",
            refused[0],
        )
    if refused:
        raise ApiError(
            400,
            f"{refused[0]} is not supported by this server, and a request that asks for it "
            "is refused rather than answered without it; leave it out",
            refused[0],
        )
    for name in request.model_extra or ():
        # An unsupported field that passed asks for nothing: not unknown, nothing to say.
        known = name in UNSUPPORTED_FIELDS or name in warned
        if not known and len(warned) < MAX_WARNED_FIELDS:
            warned.add(name)
            log.warning("ignoring the unknown request field %r (said once per field name)", name)


# The error answers the routes document, each in OpenAI's shape.
ERROR_STATUSES = {
    400: "a bad request",
    401: "a missing or wrong API key",
    404: "the model is not served",
    413: "the body is too large",
    429: "too many requests wait",
    500: "the generation failed",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        status: {"model": ErrorResponse, "description": ERROR_STATUSES[status]}
        for status in statuses
    }


def _answers_of(body: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI answers of a plain JSON route: its body, or an error in OpenAI's shape."""
    success = {"model": body, "description": f"a {body.__name__}"}
    return {200: success, **_errors(400, 401, 404, 413)}


def _answers(body: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI answers of a generation route: its body, or (stream: true) a stream
    of `chunk` events; errors in OpenAI's shape."""
    success: dict[str, Any] = {
        "model": body,
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
        "description": f"a {body.__name__}, or with stream: true server-sent events, "
        f"each a {chunk.__name__}, then [DONE]",
    }
    return {200: success, **_errors(*ERROR_STATUSES)}


def _document_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """FastAPI documents the bodies it parses itself; these routes read theirs (the size
    limit comes first), so the published schema gets their models here."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                        }
                    },
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _collect(
    service: EngineService,
    responses: Responses,
    job: Job,
    request: Request,
    endpoint: str,
    chat: bool,
) -> Response:
    async def drain() -> None:
        async for _ in service.follow(job):
            pass

    work = asyncio.ensure_future(drain())
    try:
        if await until_disconnected(work, request.is_disconnected):
            job.cancel()
            with contextlib.suppress(Exception):
                await work
            return Response(status_code=499)
        await work
    finally:
        service.finish(job, endpoint)
    failure = responses.failure(job)
    if failure is not None:
        raise failure
    body = responses.chat_body(job) if chat else responses.completion_body(job)
    return JSONResponse(body.model_dump(mode="json"))


async def _stream(
    service: EngineService,
    responses: Responses,
    job: Job,
    endpoint: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The OpenAI event stream: (chat: a role chunk per choice,) content chunks as
    text comes, a finish chunk per choice, the usage chunk when asked, `[DONE]`. A
    dropped connection cancels the generations (the generator is closed)."""
    chat = endpoint == "chat/completions"
    stream_id, created = responses.new_stream_id(chat), int(time.time())
    try:
        if chat:
            for choice in job.choices:
                yield _event(responses.chat_chunk(stream_id, created, choice, None, job.plan))
        async for choice, update in service.follow(job):
            if update.finish_reason is FinishReason.FAILED:
                continue  # told once, as an error event, after the others
            chunk = (
                responses.chat_chunk(stream_id, created, choice, update, job.plan)
                if chat
                else responses.completion_chunk(job, stream_id, choice, update)
            )
            yield _event(chunk)
        failure = responses.failure(job)
        if failure is not None:
            yield _event(_error_body(failure))
        elif include_usage:
            yield _event(responses.usage_chunk(job, stream_id, created, chat))
        yield format_sse_event(data_str="[DONE]")
    finally:
        service.finish(job, endpoint)


def _event(model: BaseModel) -> bytes:
    return format_sse_event(data_str=model.model_dump_json())


async def _read_body(request: Request, settings: ServerSettings) -> bytes:
    limit = settings.max_request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes, above the {limit}-byte limit")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"the request body is above the {limit}-byte limit")
    return bytes(body)


def _parse(model: type[ModelT], body: bytes) -> ModelT:
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        if first.get("type") == "json_invalid":
            raise ApiError(400, f"the body is not valid JSON: {first.get('msg')}") from None
        raise ApiError(400, f"{where or 'body'}: {first.get('msg')}", param=where or None) from None


def _error_body(error: ApiError) -> ErrorResponse:
    return ErrorResponse(
        error=ErrorBody(message=error.message, type=error.kind, param=error.param, code=error.code)
    )


def _error_response(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    if error.status == 429:
        headers = {**(headers or {}), "Retry-After": "1"}
    return JSONResponse(
        _error_body(error).model_dump(mode="json"), status_code=error.status, headers=headers
    )


async def _cancel_after_grace(
    service: EngineService, stopping: Callable[[], bool], settings: ServerSettings
) -> None:
    while not stopping():
        await asyncio.sleep(0.05)
    # Leave a little of the grace period for the cancelled streams to send their ends.
    await asyncio.sleep(max(0.0, settings.shutdown_timeout - 0.5))
    service.cancel_all()


def serve(engine: Engine | Backend, settings: ServerSettings, host: str, port: int) -> None:
    """Run the server until SIGINT/SIGTERM; returns once everything has stopped."""
    box: list[uvicorn.Server] = []
    app = create_app(engine, settings, stopping=lambda: bool(box and box[0].should_exit))
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout)),
    )
    server = uvicorn.Server(config)
    box.append(server)
    # uvicorn handles SIGINT/SIGTERM (stop accepting, wait, shut down), then raises the
    # signal again under the handlers it found; with these, the process then exits 0.
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda signum, frame: None)
    server.run()
