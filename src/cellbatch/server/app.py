"""`cellbatch serve`: the OpenAI-compatible HTTP app on FastAPI and uvicorn.

Owns: the routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`,
`/health`, `/metrics`; the LoRA adapters' routes are `cellbatch.server.adapters`'s),
authentication by API key, the request-size and queue
limits, the mapping of every error onto OpenAI's error shape, and the server's
life: the backend (one engine, or replicas) is closed when the app stops, and on
SIGINT/SIGTERM running requests get `shutdown_timeout` seconds to finish before they
are cancelled (their streams still end with a finish chunk).
Promises: every answer that is not a success is in OpenAI's error shape, unknown
routes (404) and methods (405) included; a bad request (bad JSON, wrong types, a
prompt too long, n or top_logprobs too large, an empty stop string, a field the server
does not support given a value that asks for something) is a 400 naming the parameter
that harms no other request; a `model` that is neither the served name, one of its
aliases nor a loaded LoRA adapter, a 404 `model_not_found`; an unknown top-level field
is logged (once per name) and otherwise ignored; a body over the limit is a 413;
beyond `max_queued_requests` waiting requests, a 429 with Retry-After; a missing or
wrong key, a 401 (except `OPEN_PATHS`: the health check and the API's description); an
unexpected exception, a 500 for that request alone; a client that disconnects cancels
its generations within a step. `/openapi.json` documents each POST route's request body
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from cellbatch.engine import Engine
from cellbatch.server.adapters import (
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    add_adapter_routes,
)
from cellbatch.server.api import ApiError, Backend
from cellbatch.server.backend import LocalBackend
from cellbatch.server.batch_features import BatchFeatures, BatchSettings
from cellbatch.server.messages_api import (
    MESSAGES_EVENTS,
    MESSAGES_PATH,
    anthropic_error,
    messages_router,
)
from cellbatch.server.messages_protocol import CountTokensRequest, MessagesRequest
from cellbatch.server.observability import ServerMetrics
from cellbatch.server.openapi import GENERATION_STATUSES, Limits, answers, document
from cellbatch.server.planner import RequestPlanner
from cellbatch.server.protocol import ChatCompletionRequest, CompletionRequest
from cellbatch.server.reply_bodies import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    ModelList,
    dump,
)
from cellbatch.server.responses import Responses
from cellbatch.server.responses_api import RESPONSES_EVENTS, responses_router
from cellbatch.server.responses_protocol import ResponsesRequest
from cellbatch.server.routing import RouteContext, check_fields, error_body
from cellbatch.server.service import EngineService, Job
from cellbatch.server.storage import Storage
from cellbatch.server.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from cellbatch.types import FinishReason

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
    reasoning_parser: str = "auto"  # a reasoning parser's name, "none", or "auto": the template's
    data_dir: Path | None = None  # the database's folder (storage.py); None: kept in memory
    batches: BatchSettings = field(default_factory=BatchSettings)  # files, batches, embeddings


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
    planner = RequestPlanner(backend, settings.tool_call_parser, settings.reasoning_parser)
    metrics.watch(backend.collector(), service.load)
    responses = Responses(backend, settings.served_model_name)
    storage = Storage(settings.data_dir)
    names = (settings.served_model_name, *settings.model_aliases)
    context = RouteContext(service, planner, responses, storage, names, settings.max_request_bytes)
    batch = BatchFeatures(
        settings.batches,
        storage,
        settings.data_dir,
        backend,
        planner,
        responses,
        names,
        settings.max_request_bytes,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(_cancel_after_grace(service, stopping, settings))
        batch.start()
        try:
            yield
        finally:
            watcher.cancel()
            await batch.stop()  # before the engine: no batch line sees the stop
            service.cancel_all()
            await asyncio.to_thread(backend.close)

    app = FastAPI(title="cellbatch", lifespan=lifespan)
    app.state.service = service
    app.state.planner = planner
    app.state.storage = storage
    app.state.batch = batch
    for router in batch.routers():
        app.include_router(router)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return _error_response(error, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def bad_query(request: Request, error: RequestValidationError) -> JSONResponse:
        # A query or path parameter of the wrong kind (bodies are read by the routes).
        first = error.errors()[0]
        param = str(first["loc"][-1]) if first.get("loc") else None
        message = f"{param}: {first.get('msg', 'invalid value')} (got {first.get('input')!r})"
        return _error_response(ApiError(400, message, param), path=request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        # Starlette's own answers (no such route, method not allowed), in OpenAI's shape.
        where = f"{request.method} {request.url.path}"
        headers = dict(error.headers) if error.headers else None
        if error.status_code == 405:
            # Starlette names the first matching route's methods; a path may have several.
            headers = {**(headers or {}), "Allow": _allowed_methods(app, request.url.path)}
        allowed = (headers or {}).get("Allow")
        if error.status_code == 404:
            message = f"Invalid URL ({where})"
        elif error.status_code == 405 and allowed:
            message = f"Method not allowed ({where}); this route takes {allowed}"
        else:
            message = f"{error.detail} ({where})"
        return _error_response(ApiError(error.status_code, message), headers, request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        failure = ApiError(500, f"internal error: {error!r}", kind="server_error")
        return _error_response(failure, path=request.url.path)

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

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        return ModelList(data=context.served.cards(planner.context_limit)).model_dump(mode="json")

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
        parsed: ChatCompletionRequest | CompletionRequest = (
            await context.read(request, ChatCompletionRequest)
            if chat
            else await context.read(request, CompletionRequest)
        )
        check_fields(parsed, context.served.all_names(), context.warned)
        job = await context.start(
            lambda: (
                planner.plan_chat(parsed)
                if isinstance(parsed, ChatCompletionRequest)
                else planner.plan_completion(parsed)
            ),
            parsed.model,
        )
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            return EventSourceResponse(_stream(service, responses, job, endpoint, include_usage))
        return await _collect(context, job, request, endpoint, chat=chat)

    @app.post(
        "/v1/completions",
        responses=answers(
            CompletionResponse,
            ErrorResponse,
            *GENERATION_STATUSES,
            events="CompletionResponse",
            done_marker=True,
        ),
    )
    async def completions(request: Request) -> Response:
        return await generate(request, "completions")

    @app.post(
        "/v1/chat/completions",
        responses=answers(
            ChatCompletionResponse,
            ErrorResponse,
            *GENERATION_STATUSES,
            events="ChatCompletionChunk",
            done_marker=True,
        ),
    )
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat/completions")

    @app.post("/tokenize", responses=answers(TokenizeResponse, ErrorResponse, 400, 401, 404, 413))
    async def tokenize(request: Request) -> JSONResponse:
        parsed = await context.read(request, TokenizeRequest)
        return JSONResponse(dump(planner.tokenize(parsed)))

    @app.post(
        "/detokenize", responses=answers(DetokenizeResponse, ErrorResponse, 400, 401, 404, 413)
    )
    async def detokenize(request: Request) -> JSONResponse:
        parsed = await context.read(request, DetokenizeRequest)
        return JSONResponse(dump(planner.detokenize(parsed)))

    app.include_router(responses_router(context))
    app.include_router(messages_router(context))
    add_adapter_routes(app, backend, context.read)
    document(
        app,
        {
            "/v1/load_lora_adapter": LoadLoraAdapterRequest,
            "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/tokenize": TokenizeRequest,
            "/detokenize": DetokenizeRequest,
            "/v1/responses": ResponsesRequest,
            MESSAGES_PATH: MessagesRequest,
            f"{MESSAGES_PATH}/count_tokens": CountTokensRequest,
            **batch.request_bodies(),
        },
        {
            "CompletionResponse": CompletionResponse,
            "ChatCompletionChunk": ChatCompletionChunk,
            **RESPONSES_EVENTS,
            **MESSAGES_EVENTS,
        },
        Limits(
            backend.vocab_size,
            planner.context_limit,
            backend.shape.max_sessions,
            backend.embedding_sizes(),
        ),
        OPEN_PATHS if settings.api_key is not None else None,
    )
    return app


def _allowed_methods(app: FastAPI, path: str) -> str:
    methods: set[str] = set()
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path_regex.match(path):
            methods |= route.methods or set()
    return ", ".join(sorted(methods))


# What a client reaches without the API key: the health check, and the API's own
# description (FastAPI's schema and its pages).
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class RequireApiKey:
    """Refuses HTTP requests without `Authorization: Bearer <key>` or `x-api-key: <key>`
    (Anthropic's clients send that) (a 401 in the route's API's error shape), except to
    OPEN_PATHS. A plain ASGI middleware: Starlette's
    BaseHTTPMiddleware (`@app.middleware`) passes every streamed chunk through a memory
    stream and a task of its own, a sixth of the HTTP thread's time at 32 streaming
    clients."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = Headers(scope=scope)
            bearer = headers.get("authorization", "").encode()
            given = headers.get("x-api-key", "").encode()
            if not (
                hmac.compare_digest(bearer, b"Bearer " + self.key)
                or hmac.compare_digest(given, self.key)
            ):
                refusal = _error_response(
                    ApiError(
                        401,
                        "missing or wrong API key: send Authorization: Bearer <key> "
                        "(or x-api-key: <key>)",
                        kind="authentication_error",
                        code="invalid_api_key",
                    ),
                    path=scope["path"],
                )
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _collect(
    context: RouteContext, job: Job, request: Request, endpoint: str, chat: bool
) -> Response:
    if not await context.run_to_end(job, request, endpoint):
        return Response(status_code=499)
    responses = context.responses
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
            yield _event(error_body(failure))
        elif include_usage:
            yield _event(responses.usage_chunk(job, stream_id, created, chat))
        yield format_sse_event(data_str="[DONE]")
    finally:
        service.finish(job, endpoint)


def _event(model: BaseModel) -> bytes:
    return format_sse_event(data_str=model.model_dump_json())


def _error_response(
    error: ApiError, headers: dict[str, str] | None = None, path: str = ""
) -> JSONResponse:
    """The error in OpenAI's shape, or in Anthropic's on the Messages API's routes."""
    if error.status == 429:
        headers = {**(headers or {}), "Retry-After": "1"}
    body = (
        anthropic_error(error)
        if path.startswith(MESSAGES_PATH)
        else error_body(error).model_dump(mode="json")
    )
    return JSONResponse(body, status_code=error.status, headers=headers)


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
    storage: Storage = app.state.storage
    # uvicorn handles SIGINT/SIGTERM (stop accepting, wait, shut down), then raises the
    # signal again under the handlers it found; with these, the process then exits 0.
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda signum, frame: None)
    try:
        server.run()
    finally:
        storage.close()
