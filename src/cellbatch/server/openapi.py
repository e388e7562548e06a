"""`/openapi.json`: what the server publishes about each route, exactly as it behaves.

Owns: the answers each route documents (`answers`: its body, or with `stream: true` an
event stream whose every event's data is described by `contentSchema`; its errors, in
the route's API's shape), the request bodies of the routes that read their own body
(`document`), and the bounds that depend on the served model, filled in when the schema
is built: a field marked `bound("token")` is a token id below the vocabulary size,
`bound("new_tokens")` a count of new tokens below the context, `bound("prompt_tokens")`
a token prompt that leaves room for one new token, `bound("sessions")` at most the
sessions run at once, `bound("token_keys")` an object keyed by token ids.
Promises: a request the schema allows is served, or refused only for what a schema
cannot say (`CROSS_FIELD_CODES`: a prompt and max_tokens beyond the context together,
a tool choice naming a function not among the tools, ...), each such refusal a 400
with its code; a request the schema forbids is refused.
Never: routes or answers requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, TypeAdapter

BOUND = "x-cellbatch-bound"
REF = "#/components/schemas/{model}"

# Refusals of requests that a JSON schema cannot tell from servable ones: each part is
# valid alone, the whole is not (the codes the errors carry).
CROSS_FIELD_CODES = frozenset(
    {
        "context_length_exceeded",  # the prompt and the new tokens exceed the context
        "unknown_tool",  # a tool_choice asking for a function (or any) not among the tools
        "logprobs_needed",  # top_logprobs without logprobs
        "min_tokens_above_max_tokens",  # min_tokens beyond max_tokens (or the context's room)
        "invalid_tools",  # tools named twice, or a schema the grammar library rejects
        "invalid_constraint",  # two constraints, or one the grammar library rejects
        "template_refused",  # a conversation the chat template raises on
        "empty_conversation",  # Responses input of reasoning items alone
        "lora_adapter_refused",  # ADAPTER_REFUSED
        "invalid_file_encoding",  # a batch file's bytes that are not UTF-8 text
    }
)
# A LoRA adapter that cannot load: its folder (missing, malformed, for another model),
# a name in use, or max_loras reached (what the adapter's files and the server hold).
ADAPTER_REFUSED = "lora_adapter_refused"

# The error answers the routes document.
ERROR_STATUSES = {
    400: "a bad request",
    401: "a missing or wrong API key",
    404: "the model (or the resource) does not exist",
    413: "the body is too large",
    429: "too many requests wait",
    500: "the generation failed",
}


# What a generation route may answer besides its body.
GENERATION_STATUSES = (400, 401, 404, 413, 429, 500)


def bound(kind: str) -> dict[str, Any]:
    """`json_schema_extra` marking a field whose bound depends on the served model."""
    return {BOUND: kind}


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context: int
    sessions: int
    # The hidden size and the sizes embeddings may be shortened to (None: none; (): any).
    embedding_sizes: tuple[int, tuple[int, ...] | None]


def errors(error: type[BaseModel], *statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": error, "description": ERROR_STATUSES[status]} for status in statuses}


def answers(
    body: type[BaseModel],
    error: type[BaseModel],
    *statuses: int,
    events: str | None = None,
    done_marker: bool = False,
) -> dict[int | str, dict[str, Any]]:
    """A route's answers: `body` (JSON), or, given `events` (the name of a schema that
    `document` is given), an event stream whose each event's data is JSON of that (or
    of `error`), or `[DONE]` where `done_marker`; errors in `error`'s shape."""
    success: dict[str, Any] = {"model": body, "description": f"a {body.__name__}"}
    if events is not None:
        refs = [{"$ref": REF.format(model=name)} for name in (events, error.__name__)]
        data: dict[str, Any] = {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": refs},
        }
        if done_marker:
            data = {"anyOf": [{"const": "[DONE]"}, data]}
        event = {
            "type": "object",
            "required": ["data", "event"],
            "properties": {"event": {"type": "string"}, "data": data},
        }
        success["content"] = {"text/event-stream": {"schema": event}}
        success["description"] += " or, with stream: true, server-sent events"
    return {200: success, **errors(error, *statuses)}


def document(
    app: FastAPI,
    bodies: dict[str, type[BaseModel]],
    events: dict[str, Any],
    limits: Limits,
    open_paths: frozenset[str] | None = None,
) -> None:
    """The app's schema, built once: FastAPI's, with the bodies of the routes that read
    their own (the size limit comes first), the streams' event types (name: a model or
    a union of them), and the model's bounds; with `open_paths` (an API key is
    required), the key's two headers, asked of every operation but theirs."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template=REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}
                    },
                }
            for name, kind in events.items():
                if name not in components:
                    described = TypeAdapter(kind).json_schema(ref_template=REF)
                    components.update(described.pop("$defs", {}))
                    components[name] = described
            _fill_bounds(schema, limits)
            if open_paths is not None:
                _secure(schema, open_paths)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _secure(schema: dict[str, Any], open_paths: frozenset[str]) -> None:
    schema["components"]["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    }
    for path, operations in schema["paths"].items():
        if path not in open_paths:
            for operation in operations.values():
                operation["security"] = [{"bearer": []}, {"apiKey": []}]


def _fill_bounds(node: Any, limits: Limits) -> None:
    if isinstance(node, list):
        for item in node:
            _fill_bounds(item, limits)
        return
    if not isinstance(node, dict):
        return
    kind = node.pop(BOUND, None)
    if kind == "token":
        node["maximum"] = limits.vocab_size - 1
    elif kind == "new_tokens":
        node["maximum"] = limits.context - 1
    elif kind == "prompt_tokens":
        node["maxItems"] = limits.context - 1
    elif kind == "sessions":
        node["maximum"] = limits.sessions
    elif kind == "dimensions":
        hidden, shorter = limits.embedding_sizes
        if shorter == ():
            node["maximum"] = hidden
        else:
            node["enum"] = sorted({hidden, *(shorter or ())})
    elif kind == "token_keys":
        node["propertyNames"] = {"pattern": f"^(?:{below(limits.vocab_size)})$"}
    for value in node.values():
        _fill_bounds(value, limits)


def below(limit: int) -> str:
    """A regular expression of the decimal numbers 0 to limit - 1 (no leading zeros)."""
    top = str(limit - 1)
    options = ["0"] if limit > 0 else []
    for digits in range(1, len(top)):
        options.append("[1-9]" + f"[0-9]{{{digits - 1}}}" if digits > 1 else "[1-9]")
    options += _up_to(top, first=True) if top != "0" else []
    return "|".join(dict.fromkeys(options))


def _up_to(top: str, first: bool) -> list[str]:
    """Numbers of len(top) digits up to `top` (the first digit not 0 when `first`)."""
    low = "1" if first else "0"
    head, rest = top[0], top[1:]
    if not rest:
        return [f"[{low}-{head}]"]
    options = []
    if head > low:
        below_head = str(int(head) - 1)
        options.append(f"[{low}-{below_head}][0-9]{{{len(rest)}}}")
    options += [head + tail for tail in _up_to(rest, first=False)]
    return options
