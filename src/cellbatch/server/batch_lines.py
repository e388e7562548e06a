"""One line of a batch: read from its input file, run through the same planner, backend
and answer shapes as the HTTP routes, and written as a line of the output or error file.

Owns: `LineRunner` (`read`: a line's JSON checked as OpenAI's batch input line;
`run`: its request answered at a given priority) and `LineOutcome` (what a line got:
an answer with its status, or an error without one, and the tokens it used).
Promises: a line runs exactly as the same request over HTTP would (the same parsing,
field checks, planning, generation and body), except that it is never streamed and
runs at the priority it is given; whatever a line holds (not JSON, fields missing, a
method other than POST, a url the batches do not run, a custom_id used by an earlier
line, a body the route would refuse, a generation that fails), it gets an outcome of
its own and nothing else is touched; cancelling `run` cancels the line's generations
within a step; a line whose generations the server cancelled (it stops) raises
`Interrupted`: it has no answer to write.
Never: stores anything (the batch worker and `cellbatch run-batch` do), or streams.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from cellbatch.server.api import ApiError, Backend, Interrupted
from cellbatch.server.batch_protocol import (
    BATCH_ENDPOINTS,
    BatchInputLine,
    BatchOutputLine,
    LineError,
    LineResponse,
    Usage,
)
from cellbatch.server.embeddings_api import Embedder, EmbeddingRequest
from cellbatch.server.planner import RequestPlanner
from cellbatch.server.protocol import ChatCompletionRequest, CompletionRequest
from cellbatch.server.responses import Responses
from cellbatch.server.routing import check_fields, error_body, validation_error
from cellbatch.server.service import Job, record_update
from cellbatch.types import FinishReason


@dataclass(frozen=True)
class LineOutcome:
    """What one line got: a response (its HTTP status and body) or, for a line that
    could not be sent, an error; ids are drawn once, when the outcome is made."""

    custom_id: str | None
    status: int | None  # None: no request was made (`error` says why)
    body: dict[str, Any] | None = None
    error: LineError | None = None
    usage: Usage = field(default_factory=Usage)

    @property
    def ok(self) -> bool:
        return self.status == 200

    def line(self) -> str:
        """The output (or error) file's line for it, as OpenAI writes it."""
        response = None
        if self.status is not None and self.body is not None:
            response = LineResponse(
                status_code=self.status, request_id=f"req_{uuid.uuid4().hex}", body=self.body
            )
        written = BatchOutputLine(
            id=f"batch_req_{uuid.uuid4().hex}",
            custom_id=self.custom_id,
            response=response,
            error=self.error,
        )
        return written.model_dump_json()


def failed_line(custom_id: str | None, code: str, message: str) -> LineOutcome:
    """The outcome of a line that got no answer."""
    return LineOutcome(custom_id, None, error=LineError(code=code, message=message))


class LineRunner:
    def __init__(
        self,
        backend: Backend,
        planner: RequestPlanner,
        responses: Responses,
        embedder: Embedder,
        names: tuple[str, ...],
    ) -> None:
        self.backend = backend
        self.planner = planner
        self.responses = responses
        self.embedder = embedder
        self.names = names
        self.warned: set[str] = set()  # unknown body fields logged once each

    def read(self, number: int, text: str, seen: set[str]) -> BatchInputLine | LineOutcome:
        """Line `number` (1-based) as a request to run, or the outcome of a line that
        cannot be one; `seen` holds the custom_ids of the lines before it (this one's
        is added)."""
        where = f"line {number}"
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            return failed_line(None, "invalid_json", f"{where} is not valid JSON: {error}")
        given = data.get("custom_id") if isinstance(data, dict) else None
        custom_id = given if isinstance(given, str) else None
        try:
            line = BatchInputLine.model_validate(data)
        except ValidationError as error:
            problem = validation_error(error).message
            return failed_line(custom_id, "invalid_request", f"{where}: {problem}")
        if line.method.upper() != "POST":
            return failed_line(
                custom_id,
                "invalid_method",
                f"{where}: method {line.method!r}; every batch request is a POST",
            )
        if line.url not in BATCH_ENDPOINTS:
            return failed_line(
                custom_id,
                "invalid_url",
                f"{where}: url {line.url!r} is not one a batch runs; use one of "
                f"{', '.join(BATCH_ENDPOINTS)}",
            )
        if line.custom_id in seen:
            return failed_line(
                custom_id,
                "duplicate_custom_id",
                f"{where}: custom_id {line.custom_id!r} is used by an earlier line; each "
                "line needs its own",
            )
        seen.add(line.custom_id)
        return line

    async def run(self, line: BatchInputLine, priority: int) -> LineOutcome:
        """The line's request answered, at `priority`: a 200 with the route's body, or
        the status and error body the route would have answered."""
        try:
            if line.url == "/v1/embeddings":
                request = self._body(EmbeddingRequest, line.body)
                answer = await self.embedder.answer(request, priority)
                usage = Usage(input_tokens=answer.usage.prompt_tokens)
                return LineOutcome(line.custom_id, 200, answer.model_dump(mode="json"), None, usage)
            return await self._generate(line, priority)
        except Interrupted:
            raise
        except ApiError as error:
            return LineOutcome(line.custom_id, error.status, error_body(error).model_dump())

    async def _generate(self, line: BatchInputLine, priority: int) -> LineOutcome:
        chat = line.url == "/v1/chat/completions"
        parsed = (
            self._body(ChatCompletionRequest, line.body)
            if chat
            else self._body(CompletionRequest, line.body)
        )
        check_fields(parsed, self.names, self.warned)
        if parsed.stream:
            raise ApiError(
                400,
                "stream is not available in a batch: each line's answer is written whole; "
                "leave stream out",
                "stream",
            )
        plan = (
            self.planner.plan_chat(parsed)
            if isinstance(parsed, ChatCompletionRequest)
            else self.planner.plan_completion(parsed)
        )
        plan.configs = [replace(config, priority=priority) for config in plan.configs]
        choices = await self.backend.start(plan)
        job = Job(plan, choices, time.perf_counter())
        try:
            await asyncio.gather(*(_drain(choice) for choice in choices))
        finally:
            job.cancel()  # a no-op for settled generations; a cancelled run ends them
        if any(choice.finish_reason is FinishReason.CANCELLED for choice in choices):
            raise Interrupted()
        failure = self.responses.failure(job)
        if failure is not None:
            raise failure
        body = self.responses.chat_body(job) if chat else self.responses.completion_body(job)
        usage = body.usage
        assert usage is not None
        tokens = Usage(
            usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens,
            usage.completion_tokens,
        )
        return LineOutcome(line.custom_id, 200, body.model_dump(mode="json"), None, tokens)

    @staticmethod
    def _body(model: type[Any], body: dict[str, Any]) -> Any:
        try:
            return model.model_validate(body)
        except ValidationError as error:
            raise validation_error(error) from None


async def _drain(choice: Any) -> None:
    async for update in choice.handle.stream():
        record_update(choice, update)
