"""What every route that reads a JSON body does first: the size limit, the model's
verdict on the body, the served model's name, and the fields a request may not give.

Owns: `read_body` (the size limit, before the body is read whole), `parse` (pydantic's
verdict as an `ApiError` naming the field), `check_model` (the served names),
`check_fields` (generation requests' unsupported fields refused, unknown ones logged
once per name) and `error_body` (an `ApiError` in OpenAI's error shape). A batch line's
body is checked with the same functions, so a line is refused exactly where the same
request over HTTP would be.
Promises: a body over the limit is a 413 before it is read whole; a body that is not
JSON or breaks its model is a 400 naming the first field at fault; a `model` that is
not served is a 404 `model_not_found`.
Never: runs or answers requests (the routes do).
"""

from __future__ import annotations

import logging
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from cellbatch.server.api import ApiError
from cellbatch.server.protocol import (
    CHAT_ONLY_FIELDS,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    refused_fields,
)

ModelT = TypeVar("ModelT", bound=BaseModel)

log = logging.getLogger("cellbatch.server.app")

# Unknown field names remembered so as to warn once each; past this many, no more
# warnings (a client sending random names cannot grow the set without bound).
MAX_WARNED_FIELDS = 1024


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
    """pydantic's verdict as a 400 naming the first field at fault."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}")
    return ApiError(400, f"{where or 'body'}: {first.get('msg')}", param=where or None)


def check_model(model: str | None, names: tuple[str, ...]) -> None:
    if model is not None and model not in names:
        raise ApiError(
            404,
            f"the model `{model}` does not exist; this server serves "
            f"{', '.join(repr(name) for name in names)} (GET /v1/models lists them)",
            "model",
            code="model_not_found",
        )


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
    for name in request.model_extra or ():
        # An unsupported field that passed asks for nothing: not unknown, nothing to say.
        known = name in UNSUPPORTED_FIELDS or name in warned
        if not known and len(warned) < MAX_WARNED_FIELDS:
            warned.add(name)
            log.warning("ignoring the unknown request field %r (said once per field name)", name)


def error_body(error: ApiError) -> ErrorResponse:
    return ErrorResponse(
        error=ErrorBody(message=error.message, type=error.kind, param=error.param, code=error.code)
    )
