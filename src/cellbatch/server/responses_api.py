"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`.

Owns: the routes, the request as a chat conversation (instructions as the system turn,
input items as messages, calls and results, a previous response's conversation
first), its answer as a response object (reasoning, message and function call items;
usage with reasoning tokens; `incomplete` at `max_output_tokens`) or as the typed event
stream, and keeping it (`store`, default true) in the `ResponseStore`.
Promises: a request runs through the chat route's planner, so tools, `tool_choice`,
`text.format` and sampling are checked and held exactly as on chat, each refusal a 400
naming this API's field; a streamed response and the same response fetched afterwards
agree item for item; a `previous_response_id` that is not kept is a 404 naming it, and
so is a GET or DELETE of one; instructions are not carried over from the previous
response (OpenAI's rule), its input and output are.
Never: frames events by hand (`fastapi.sse` does) or reads calls out of text
(`answers` does).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import ValidationError

from cellbatch.server.answers import AnswerStream, whole_answer
from cellbatch.server.api import ApiError
from cellbatch.server.openapi import GENERATION_STATUSES, answers, errors
from cellbatch.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCallMessage,
    ToolDefinition,
    ToolMessage,
)
from cellbatch.server.reply_bodies import ErrorResponse
from cellbatch.server.responses_protocol import (
    RESPONSES_UNSUPPORTED,
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputItem,
    InputItemList,
    InputTokensDetails,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)
from cellbatch.server.responses_store import ResponseStore, conversation_json
from cellbatch.server.responses_stream import ResponseEvents
from cellbatch.server.routing import RouteContext
from cellbatch.server.service import Job
from cellbatch.types import FinishReason

ENDPOINT = "responses"
RESPONSES_EVENTS = {"ResponseStreamEvent": StreamEvent}

# The chat fields a refusal may name, as this API names them.
FIELD_NAMES = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}


def responses_router(context: RouteContext) -> APIRouter:
    router = APIRouter()
    store = ResponseStore(context.storage)
    refusals = (400, 401, 404)

    @router.post(
        "/v1/responses",
        responses=answers(
            ResponseObject,
            ErrorResponse,
            *GENERATION_STATUSES,
            events="ResponseStreamEvent",
        ),
    )
    async def create(request: Request) -> Response:
        parsed = await context.read(request, ResponsesRequest, RESPONSES_UNSUPPORTED)
        history: list[InputItem] = []
        if parsed.previous_response_id is not None:
            kept = await asyncio.to_thread(store.history, parsed.previous_response_id)
            if kept is None:
                raise _not_kept(parsed.previous_response_id, "previous_response_id")
            history = kept
        items = history + _input_items(parsed)
        chat = _chat_request(parsed, items)
        job = await context.start(lambda: context.planner.plan_chat(chat), parsed.model, _renamed)
        response = _response_shell(parsed, context.names[0])
        conversation = conversation_json(items)
        if parsed.stream:
            events = _stream(context, store, job, response, conversation)
            return EventSourceResponse(events)
        if not await context.run_to_end(job, request, ENDPOINT):
            return Response(status_code=499)
        (choice,) = job.choices
        answer = whole_answer(job.plan.reading, "".join(choice.text))
        response.output = _output_items(answer.reasoning, answer.content, answer.calls)
        _settle(context, job, response, answer.reasoning)
        if parsed.store:
            await asyncio.to_thread(store.put, response, conversation)
        return JSONResponse(response.model_dump(mode="json"))

    @router.get(
        "/v1/responses/{response_id}",
        response_model=ResponseObject,
        responses=errors(ErrorResponse, *refusals),
    )
    async def get(response_id: str) -> JSONResponse:
        kept = await asyncio.to_thread(store.get, response_id)
        if kept is None:
            raise _not_kept(response_id, "response_id")
        return JSONResponse(kept.model_dump(mode="json"))

    @router.get(
        "/v1/responses/{response_id}/input_items",
        response_model=InputItemList,
        responses=errors(ErrorResponse, *refusals),
    )
    async def input_items(
        response_id: str,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
        before: str | None = None,
        include: Annotated[list[str] | None, Query()] = None,  # nothing more to include
    ) -> JSONResponse:
        items = await asyncio.to_thread(store.input_items, response_id)
        if items is None:
            raise _not_kept(response_id, "response_id")
        page = _page(items[::-1] if order == "desc" else items, after, before, limit)
        return JSONResponse(page.model_dump(mode="json"))

    @router.delete(
        "/v1/responses/{response_id}",
        response_model=DeletedResponse,
        responses=errors(ErrorResponse, *refusals),
    )
    async def delete(response_id: str) -> JSONResponse:
        if not await asyncio.to_thread(store.delete, response_id):
            raise _not_kept(response_id, "response_id")
        return JSONResponse(DeletedResponse(id=response_id).model_dump(mode="json"))

    return router


def _page(
    items: list[dict[str, Any]], after: str | None, before: str | None, limit: int
) -> InputItemList:
    """`limit` items, in the order given, after the item `after` and before `before`."""
    ids = [str(item["id"]) for item in items]
    for cursor, param in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise ApiError(404, f"no input item {cursor!r} in this response", param, "not_found")
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(items)
    chosen = items[start:end][:limit]
    return InputItemList(
        data=chosen,
        first_id=chosen[0]["id"] if chosen else None,
        last_id=chosen[-1]["id"] if chosen else None,
        has_more=start + len(chosen) < end,
    )


def _input_items(request: ResponsesRequest) -> list[InputItem]:
    if isinstance(request.input, str):
        return [MessageItem(role="user", content=request.input)]
    return list(request.input)


def _chat_request(request: ResponsesRequest, items: list[InputItem]) -> ChatCompletionRequest:
    """The request as the chat route takes it: the same planner plans both."""
    messages = _messages(request.instructions, items)
    if not messages:
        raise ApiError(
            400,
            "input holds no message: give text or message items",
            "input",
            code="empty_conversation",
        )
    fields: dict[str, Any] = {
        "messages": messages,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    if request.tools:
        fields["tools"] = [
            ToolDefinition(
                function=FunctionDefinition(
                    name=tool.name, description=tool.description, parameters=tool.parameters
                )
            )
            for tool in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else NamedToolChoice(function=NamedFunction(name=choice.name))
        )
    form = request.text.format if request.text is not None else None
    if isinstance(form, TextFormatJsonObject):
        fields["response_format"] = ResponseFormat(type="json_object")
    elif isinstance(form, TextFormatJsonSchema):
        fields["response_format"] = ResponseFormat(
            type="json_schema",
            json_schema=JsonSchemaFormat(name=form.name, schema=form.json_schema),
        )
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as error:  # the history's own messages, say
        raise ApiError(400, f"input: {error.errors()[0].get('msg')}", "input") from None


def _messages(instructions: str | None, items: list[InputItem]) -> list[ChatMessage | ToolMessage]:
    """The conversation as chat messages: the developer's turns as system turns,
    consecutive calls as one assistant turn (after its text, if any), results as tool
    turns; reasoning items are left out (templates drop past reasoning)."""
    messages: list[ChatMessage | ToolMessage] = []
    if instructions:
        messages.append(ChatMessage(role="system", content=instructions))
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = ToolCallMessage(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(
                ToolMessage(role="tool", content=item.text(), tool_call_id=item.call_id)
            )
    return messages


def _renamed(error: ApiError) -> ApiError:
    """A planner's refusal, naming the field as this API names it."""
    param, message = error.param, error.message
    for chat, ours in FIELD_NAMES.items():
        message = message.replace(chat, ours)
        if param is not None and param.partition(".")[0] == chat:
            param = ours
    return ApiError(error.status, message, param, error.kind, error.code)


def _not_kept(response_id: str, param: str) -> ApiError:
    return ApiError(
        404,
        f"no response with id {response_id!r} is kept here (it was made with store: false, "
        "deleted, or never made)",
        param,
        code="not_found",
    )


def _response_shell(request: ResponsesRequest, model: str) -> ResponseObject:
    """The response object as it starts: the request's settings, no output yet."""
    fields: dict[str, Any] = {
        "model": model,
        "instructions": request.instructions,
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "store": request.store,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "tools": request.tools or [],
        "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
        "metadata": request.metadata or {},
        "user": request.user,
    }
    if request.text is not None:
        fields["text"] = request.text
    return ResponseObject(**fields)


def _output_items(reasoning: str | None, content: str | None, calls: Any) -> list[OutputItem]:
    items: list[OutputItem] = []
    if reasoning:
        items.append(OutputReasoning(content=[ReasoningText(text=reasoning)]))
    if content or not calls:
        items.append(OutputMessage(content=[OutputText(text=content or "")]))
    items += [
        OutputFunctionCall(call_id=call.id, name=call.name, arguments=call.arguments)
        for call in calls
    ]
    return items


def _settle(
    context: RouteContext, job: Job, response: ResponseObject, reasoning: str | None
) -> None:
    """The finished response's status and usage."""
    (choice,) = job.choices
    if choice.finish_reason is FinishReason.FAILED:
        response.status = "failed"
        response.error = ResponseError(code="server_error", message=choice.error)
    elif choice.finish_reason is FinishReason.TOKEN_LIMIT:
        response.status = "incomplete"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        for item in response.output:
            item.status = "incomplete"
    else:
        response.status = "completed"
    usage = context.responses.usage(job)
    tokenizer = context.planner.backend.tokenizer
    thought = len(tokenizer.encode(reasoning, False)) if reasoning and tokenizer else 0
    response.usage = ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.prompt_tokens_details.cached_tokens
        ),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=min(thought, usage.completion_tokens)
        ),
        total_tokens=usage.total_tokens,
    )


async def _stream(
    context: RouteContext,
    store: ResponseStore,
    job: Job,
    response: ResponseObject,
    conversation: list[dict[str, Any]],
) -> AsyncIterator[bytes]:
    """The typed events: created, in_progress, the items' events, then completed
    (incomplete, failed); the response is kept once whole. A dropped connection cancels
    the generation (the generator is closed)."""
    events = ResponseEvents(response)
    (choice,) = job.choices
    reader = AnswerStream(job.plan.reading)
    reasoning: list[str] = []
    try:
        for event in events.start():
            yield _event(event)
        async for _, update in context.service.follow(job):
            if update.finish_reason is FinishReason.FAILED:
                break
            delta = reader.feed(update.text, update.finish_reason is not None)
            reasoning.append(delta.reasoning)
            for event in events.feed(delta):
                yield _event(event)
        _settle(context, job, response, "".join(reasoning))
        if response.status == "failed":
            yield _event(events.error(choice.error))
        for event in events.finish(response):
            yield _event(event)
        if response.store and response.status != "failed":
            await asyncio.to_thread(store.put, response, conversation)
    finally:
        context.service.finish(job, ENDPOINT)


def _event(event: StreamEvent) -> bytes:
    return format_sse_event(event=event.type, data_str=event.model_dump_json())
