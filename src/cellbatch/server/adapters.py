"""LoRA adapters over HTTP, as vLLM serves them: listed beside the base model, picked by a
request's `model`, loaded and unloaded while serving.

Owns: `ServedModels` (the names a request's `model` may give: the served model's, its
aliases and the adapters loaded now, and the model cards `/v1/models` lists) and the
routes `POST /v1/load_lora_adapter` (`{"lora_name", "lora_path"}`) and
`POST /v1/unload_lora_adapter` (`{"lora_name"}`), with their request bodies.
Promises: a request naming an adapter runs every one of its generations with it; one
naming neither the model nor a loaded adapter is a 404 `model_not_found` that lists
them; `/v1/models` lists each adapter after the base names, its `parent` the served
model's name and its `root` its folder. Loading answers 200 with vLLM's text once the
adapter serves, 400 naming the file and the mismatch for an adapter that cannot run on
the model (nothing loads), 400 for a name in use or past `--max-loras`; unloading
answers 200 at once (the adapter's running generations finish with it; new requests
cannot name it), 404 for a name not loaded. Both routes sit behind `--api-key` like
every route.
Never: reads adapter files itself (the engine does, off the event loop).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from cellbatch.server.api import ApiError, Backend, Plan
from cellbatch.server.openapi import ADAPTER_REFUSED, errors
from cellbatch.server.reply_bodies import ErrorResponse, ModelCard
from cellbatch.types import InvalidArgumentError, OutOfResourcesError

ModelT = TypeVar("ModelT", bound=BaseModel)


class BodyReader(Protocol):
    """How the app reads a route's body: the size limit, then the model's validation."""

    async def __call__(self, request: Request, model: type[ModelT]) -> ModelT: ...


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's `/v1/load_lora_adapter` body."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's `/v1/unload_lora_adapter` body (`lora_int_id`, vLLM's own id, is not read)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)


@dataclasses.dataclass(frozen=True)
class ServedModels:
    """The served model's names (`names[0]` the one answers carry) and the backend whose
    adapters are served beside them."""

    names: tuple[str, ...]
    backend: Backend

    def adapter_for(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model); a 404 naming
        what is served when it is neither."""
        if model is None or model in self.names:
            return None
        adapters = [info.name for info in self.backend.adapters()]
        if model in adapters:
            return model
        served = ", ".join(repr(name) for name in (*self.names, *adapters))
        raise ApiError(
            404,
            f"the model `{model}` does not exist; this server serves {served} "
            "(GET /v1/models lists them)",
            "model",
            code="model_not_found",
        )

    def all_names(self) -> tuple[str, ...]:
        """Every name a request's `model` may give now: the served names, then the
        adapters loaded."""
        return (*self.names, *(info.name for info in self.backend.adapters()))

    def cards(self, context_limit: int) -> list[ModelCard]:
        base = [ModelCard(id=name, max_model_len=context_limit) for name in self.names]
        return base + [
            ModelCard(
                id=info.name,
                max_model_len=context_limit,
                parent=self.names[0],
                root=str(info.path),
            )
            for info in self.backend.adapters()
        ]


def with_adapter(plan: Plan, adapter: str | None) -> Plan:
    """`plan` with every generation running `adapter` (None: as it is)."""
    if adapter is None:
        return plan
    configs = [dataclasses.replace(config, adapter=adapter) for config in plan.configs]
    return dataclasses.replace(plan, configs=configs)


def add_adapter_routes(app: FastAPI, backend: Backend, read: BodyReader) -> None:
    """The load and unload routes; `read(request, model)` reads and checks a body."""

    @app.post(
        "/v1/load_lora_adapter",
        response_class=Response,  # errors are JSON, the success vLLM's text
        responses=_answers("the adapter serves"),
    )
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read(request, LoadLoraAdapterRequest)
        try:
            await backend.load_adapter(body.lora_name, body.lora_path)
        except (InvalidArgumentError, OutOfResourcesError) as error:
            raise ApiError(400, str(error), "lora_path", code=ADAPTER_REFUSED) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post(
        "/v1/unload_lora_adapter",
        response_class=Response,
        responses=_answers("the adapter no longer serves new requests", 404),
    )
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read(request, UnloadLoraAdapterRequest)
        try:
            await backend.unload_adapter(body.lora_name)
        except InvalidArgumentError as error:
            raise ApiError(404, str(error), "lora_name", code="model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _answers(success: str, *statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI answers of an adapter route: vLLM's text, or an error in OpenAI's shape."""
    ok: dict[str, Any] = {
        "description": success,
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
    return {200: ok, **errors(ErrorResponse, *sorted({400, 401, 413, *statuses}))}
