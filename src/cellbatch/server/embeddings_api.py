"""`POST /v1/embeddings`: each input's pooled last hidden states, as OpenAI answers.

Owns: the embeddings request and answer shapes, `Embedder` (an input's token prompts
checked, pooled on the backend through the same engine as generations, shortened and
normalised, written as floats or base64) and the route.
Promises: `input` is a string, token ids, or a list of either (at most MAX_INPUTS); an
empty item, a token outside the vocabulary, an input longer than the context, a
`dimensions` the model does not allow or a `model` that is not served is a 400 (404 for
the model) naming the parameter, before anything runs; `encoding_format: "base64"`
gives each vector's little-endian float32 bytes in base64, as the official client
decodes them; vectors have unit length (L2).
Never: pools anything itself (the executor does), or waits for a generation's turn
beyond its priority (batch lines embed at BATCH_PRIORITY).
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from cellbatch.engine.embedding import finish_embedding
from cellbatch.generation_config import POOLING_CHOICES
from cellbatch.server.api import ApiError, Backend, Interrupted
from cellbatch.server.openapi import answers, bound
from cellbatch.server.planner import RequestPlanner
from cellbatch.server.protocol import INTEGRAL, Text, TokenPrompt
from cellbatch.server.reply_bodies import ErrorResponse
from cellbatch.server.routing import check_model, parse, read_body
from cellbatch.types import DEFAULT_PRIORITY, FinishReason, InvalidArgumentError

# OpenAI's limit on the inputs of one request.
MAX_INPUTS = 2048


# Sizes the served model's embeddings may have (the schema lists them).
Dimensions = Annotated[int, Field(ge=1, json_schema_extra=bound("dimensions")), INTEGRAL]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    input: (
        Text
        | Annotated[list[Text], Field(min_length=1)]
        | TokenPrompt
        | Annotated[list[TokenPrompt], Field(min_length=1)]
    )
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions | None = None
    user: str | None = None  # accepted and ignored
    # cellbatch's: "last" or "mean" (default: the server's --embedding-pooling).
    pooling: Literal["last", "mean"] | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class Embedder:
    def __init__(
        self,
        backend: Backend,
        planner: RequestPlanner,
        model_name: str,
        names: tuple[str, ...],
        pooling: str = "last",
    ) -> None:
        if pooling not in POOLING_CHOICES:
            raise InvalidArgumentError(
                f"embedding pooling must be one of {', '.join(POOLING_CHOICES)}, got {pooling!r}"
            )
        self.backend = backend
        self.planner = planner
        self.model_name = model_name
        self.names = names
        self.pooling = pooling

    async def answer(
        self, request: EmbeddingRequest, priority: int = DEFAULT_PRIORITY
    ) -> EmbeddingResponse:
        check_model(request.model, self.names)
        prompts = self.planner.token_prompts(request.input, "input")
        if len(prompts) > MAX_INPUTS:
            raise ApiError(
                400,
                f"input holds {len(prompts)} items, above the {MAX_INPUTS} a request takes; "
                "split it over several requests",
                "input",
            )
        limit = self.planner.context_limit - 1
        for index, prompt in enumerate(prompts):
            if len(prompt) > limit:
                raise ApiError(
                    400,
                    f"input item {index} has {len(prompt)} tokens, above the {limit} an "
                    "embedding input holds here; shorten it",
                    "input",
                    code="context_length_exceeded",
                )
        try:
            size = self.backend.embedding_size(request.dimensions)
        except InvalidArgumentError as error:
            raise ApiError(400, str(error), "dimensions") from error
        summaries = await self.backend.embed(prompts, request.pooling or self.pooling, priority)
        data = []
        for index, summary in enumerate(summaries):
            if summary.finish_reason is FinishReason.CANCELLED:
                raise Interrupted()
            if summary.finish_reason is not FinishReason.TOKEN_LIMIT or not summary.embedding:
                why = summary.error or summary.finish_reason
                raise ApiError(500, f"input item {index} failed: {why}", kind="server_error")
            vector = finish_embedding(summary.embedding, size)
            encoded: list[float] | str = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                if request.encoding_format == "base64"
                else vector.tolist()
            )
            data.append(EmbeddingData(index=index, embedding=encoded))
        tokens = sum(len(prompt) for prompt in prompts)
        return EmbeddingResponse(
            data=data,
            model=self.model_name,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )


def embeddings_router(embedder: Embedder, max_request_bytes: int) -> APIRouter:
    router = APIRouter()

    documented = answers(EmbeddingResponse, ErrorResponse, 400, 401, 404, 413, 500)

    @router.post("/v1/embeddings", responses=documented)
    async def embeddings(request: Request) -> JSONResponse:
        body = await read_body(request, max_request_bytes)
        answer = await embedder.answer(parse(EmbeddingRequest, body))
        return JSONResponse(answer.model_dump(mode="json"))

    return router
