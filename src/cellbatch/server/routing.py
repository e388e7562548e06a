"""What every route of the server shares: reading and checking a request's body, the
served model's names, and what the routes of each API are given to work with.

Owns: `RouteContext` (the service, the planner, the chat answers' shapes, the storage,
the served names and the body limit, as the app hands them to each API's router; the
prelude every generation route shares, a request read and checked then admitted,
planned and started under its adapter; a job followed to its end unless the client
leaves),
`read_body` (the size limit, before anything is parsed), `parse` (pydantic's verdict
as an `ApiError` naming the field: `validation_error`), `check_model`, the LoRA
adapters a `model` may also name (`ServedModels`), `check_fields` (a generation
request's unsupported fields refused) and `note_unknown_fields` (each
unknown top-level field logged once per name), and `error_body` (an `ApiError` in
OpenAI's error shape). A batch line's body is checked with the same functions, so a
line is refused exactly where the same request over HTTP would be.
Promises: a body over the limit is refused (413) before it is read whole; a body that is
not JSON or breaks its model is a 400 naming the first field at fault.
Never: runs or answers requests (the routes do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from cellbatch.server.adapters import ServedModels, with_adapter
from cellbatch.server.api import ApiError, Plan
from cellbatch.server.planner import RequestPlanner
from cellbatch.server.protocol import (
    CHAT_ONLY_FIELDS,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    refused_fields,
)
from cellbatch.server.reply_bodies import ErrorBody, ErrorResponse
from cellbatch.server.responses import Responses
from cellbatch.server.service import EngineService, Job, until_disconnected
from cellbatch.server.storage import Storage

ModelT = TypeVar("ModelT", bound=BaseModel)

log = logging.getLogger("cellbatch.server.app")

# Unknown field names remembered so as to warn once each; past this many, no more
# warnings (a client sending random names cannot grow the set without bound).
MAX_WARNED_FIELDS = 1024


@dataclass
class RouteContext:
    service: EngineService
    planner: RequestPlanner
    responses: Responses
    storage: Storage
    names: tuple[str, ...]  # the served model's name, then its aliases
    max_request_bytes: int
    warned: set[str] = field(default_factory=set)

    @property
    def served(self) -> ServedModels:
        """What a request's `model` may name: the served names, or an adapter loaded now."""
        return ServedModels(self.names, self.service.backend)

    async def read(
        self,
        request: Request,
        model: type[ModelT],
        unsupported: tuple[str, ...] | None = None,
    ) -> ModelT:
        """The request's body as `model`, its `model` field checked when it has one, and
        with `unsupported` given, its extra fields checked against it (`check_extras`)."""
        parsed = parse(model, await read_body(request, self.max_request_bytes))
        self.served.adapter_for(getattr(parsed, "model", None))
        if unsupported is not None:
            self.check_extras(parsed.model_extra, unsupported)
        return parsed

    async def start(
        self,
        plan: Callable[[], Plan],
        model: str | None,
        renamed: Callable[[ApiError], ApiError] | None = None,
    ) -> Job:
        """A generation request's start, once read: admitted (a 429 when too many wait),
        planned by `plan` (its refusal as `renamed` gives it, in the route's API's field
        names), run under the adapter its `model` names."""
        self.service.admit()
        try:
            planned = plan()
        except ApiError as error:
            if renamed is None:
                raise
            raise renamed(error) from None
        return await self.service.start(with_adapter(planned, self.served.adapter_for(model)))

    async def run_to_end(self, job: Job, request: Request, endpoint: str) -> bool:
        """Follows `job` to its end and accounts for it; False if the client left first
        (the job is then cancelled); a failed generation raises its ApiError."""

        async def drain() -> None:
            async for _ in self.service.follow(job):
                pass

        work = asyncio.ensure_future(drain())
        try:
            if await until_disconnected(work, request.is_disconnected):
                job.cancel()
                with contextlib.suppress(Exception):
                    await work
                return False
            await work
        finally:
            self.service.finish(job, endpoint)
        failure = self.responses.failure(job)
        if failure is not None:
            raise failure
        return True

    def check_extras(self, extra: dict[str, Any] | None, unsupported: tuple[str, ...]) -> None:
        """Refuses the unsupported fields that ask for something; logs unknown ones."""
        refused = refused_fields(extra, unsupported)
        if refused:
            raise ApiError(
                400,
                f"{refused[0]} is not supported by this server, and a request that asks for "
                "it is refused rather than answered without it; leave it out",
                refused[0],
            )
        self.note_unknown_fields(set(extra or ()) - set(unsupported))

    def note_unknown_fields(self, names: Iterable[str]) -> None:
        note_unknown_fields(names, self.warned)


def note_unknown_fields(names: Iterable[str], warned: set[str]) -> None:
    """Logs each name not in `warned` once (and remembers it)."""
    for name in names:
        if name not in warned and len(warned) < MAX_WARNED_FIELDS:
            warned.add(name)
            log.warning("ignoring the unknown request field %r (said once per field name)", name)


def check_fields(
    request: CompletionRequest | ChatCompletionRequest,
    names: tuple[str, ...],
    warned: set[str],
) -> None:
    """Refuse a model that is not served and the fields that ask for what the server
    does not do; log each unknown field name once."""
    check_model(request.model, names)
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
    # An unsupported field that passed asks for nothing: not unknown, nothing to say.
    note_unknown_fields(set(request.model_extra or ()) - set(UNSUPPORTED_FIELDS), warned)


def error_body(error: ApiError) -> ErrorResponse:
    return ErrorResponse(
        error=ErrorBody(message=error.message, type=error.kind, param=error.param, code=error.code)
    )


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes, above the {limit}-byte limit")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"the request body is above the {limit}-byte limit")
    return bytes(body)


def parse(model: type[ModelT], body: bytes | str) -> ModelT:
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise validation_error(error) from None


def validation_error(error: ValidationError) -> ApiError:
    """pydantic's verdict as a 400 naming the field at fault: of a union's branches, the
    one that got furthest, and there a value's fault (too short, too big) before a
    branch of the wrong type (an empty list is "too short", not "not a string")."""
    first = max(
        error.errors(),
        key=lambda found: (
            len(_field_path(found.get("loc", ()))),
            not str(found.get("type", "")).endswith("_type"),
        ),
    )
    where = ".".join(_field_path(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}")
    return ApiError(400, f"{where or 'body'}: {first.get('msg')}", param=where or None)


# The names pydantic gives a union's branches in an error's location (not fields).
_BRANCHES = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "constrained-str"})


def _field_path(location: tuple[int | str, ...]) -> list[str]:
    """An error's location as the request names it: fields and indices, without the
    union branches pydantic tried."""
    return [
        str(part)
        for part in location
        # Branches: pydantic's type names, and the models' (CamelCase) names.
        if not (isinstance(part, str) and (part in _BRANCHES or "[" in part or part[:1].isupper()))
    ]


def check_model(model: str | None, names: tuple[str, ...]) -> None:
    if model is not None and model not in names:
        raise ApiError(
            404,
            f"the model `{model}` does not exist; this server serves "
            f"{', '.join(repr(name) for name in names)} (GET /v1/models lists them)",
            "model",
            code="model_not_found",
        )
