"""What the server's published schema (`/openapi.json`) says of its routes' answers.

Owns: the error answers routes document (`ERROR_STATUSES`, each in OpenAI's error
shape), the answers of a plain JSON route (`answers_of`) and of a generation route
(`generation_answers`: a body, or a stream of chunks), and `document_request_bodies`,
which puts the models of the bodies routes read themselves (the size limit first)
into the schema.
Promises: every documented status is one the route may answer; schemathesis checks
answers against this.
Never: answers or parses a request.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from cellbatch.server.protocol import ErrorResponse

# The error answers the routes document, each in OpenAI's shape.
ERROR_STATUSES = {
    400: "a bad request",
    401: "a missing or wrong API key",
    404: "the model (or the object the path names) does not exist",
    413: "the body is too large",
    429: "too many requests wait",
    500: "the generation (or the embedding) failed",
}


def error_answers(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        status: {"model": ErrorResponse, "description": ERROR_STATUSES[status]}
        for status in statuses
    }


def answers_of(
    body: type[BaseModel], errors: tuple[int, ...] = (400, 401, 404, 413)
) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI answers of a plain JSON route: its body, or an error in OpenAI's shape."""
    success = {"model": body, "description": f"a {body.__name__}"}
    return {200: success, **error_answers(*errors)}


def generation_answers(
    body: type[BaseModel], chunk: type[BaseModel]
) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI answers of a generation route: its body, or (stream: true) a stream
    of `chunk` events; errors in OpenAI's shape."""
    success: dict[str, Any] = {
        "model": body,
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
        "description": f"a {body.__name__}, or with stream: true server-sent events, "
        f"each a {chunk.__name__}, then [DONE]",
    }
    return {200: success, **error_answers(*ERROR_STATUSES)}


def document_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
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
