"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Owns: the routes, the request as a chat conversation (`system` as the system turn,
`tool_use` blocks as calls, `tool_result` blocks as tool turns, past thinking left
out), its answer as a message (thinking, text and tool_use blocks, `stop_reason` and
the stop sequence met, usage with prefix-cache reads) or as Anthropic's event stream
(`message_start`, each block's `content_block_start`, deltas and
`content_block_stop`, `message_delta`, `message_stop`), and Anthropic's error shape
(`anthropic_error`), which the app gives every refusal under `MESSAGES_PATH`.
Promises: a request runs through the chat route's planner, so tools, `tool_choice`,
stop sequences and sampling are checked and held exactly as on chat, each refusal a
400 naming this API's field; a stream's blocks concatenate to the message's blocks;
`count_tokens` counts the prompt the same request would run.
Never: frames events by hand (`fastapi.sse` does) or reads calls out of text
(`answers` does).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel, ValidationError

from cellbatch.server.answers import AnswerDelta, AnswerStream, whole_answer
from cellbatch.server.api import ApiError
from cellbatch.server.messages_protocol import (
    ERROR_TYPES,
    MESSAGES_UNSUPPORTED,
    AnthropicError,
    AnthropicErrorBody,
    BlockDelta,
    BlockStart,
    BlockStop,
    CountTokensRequest,
    InputJsonDelta,
    MessageDelta,
    MessageObject,
    MessagesRequest,
    MessageStart,
    MessageStop,
    OutBlock,
    OutText,
    OutThinking,
    OutToolUse,
    StopDelta,
    StopReason,
    StreamEvent,
    TextBlock,
    TextDelta,
    ThinkingDelta,
    TokenCount,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
    _Conversation,
)
from cellbatch.server.openapi import GENERATION_STATUSES, answers
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
from cellbatch.server.routing import RouteContext
from cellbatch.server.service import Job
from cellbatch.server.tokenize_protocol import TokenizeMessages, TokenizeRequest
from cellbatch.tool_calls.calls import ToolCall
from cellbatch.types import FinishReason

MESSAGES_PATH = "/v1/messages"
ENDPOINT = "messages"
MESSAGES_EVENTS = {"MessagesStreamEvent": StreamEvent}

# The chat fields a refusal may name, as this API names them.
FIELD_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def anthropic_error(error: ApiError) -> dict[str, Any]:
    """The error in Anthropic's shape."""
    kind = ERROR_TYPES.get(
        error.status, "api_error" if error.status >= 500 else "invalid_request_error"
    )
    code = str(error.code) if error.code is not None else None
    body = AnthropicError(error=AnthropicErrorBody(type=kind, message=error.message, code=code))
    return body.model_dump(mode="json")


def messages_router(context: RouteContext) -> APIRouter:
    router = APIRouter()

    @router.post(
        MESSAGES_PATH,
        responses=answers(
            MessageObject,
            AnthropicError,
            *GENERATION_STATUSES,
            events="MessagesStreamEvent",
        ),
    )
    async def create(request: Request) -> Response:
        parsed = await context.read(request, MessagesRequest, MESSAGES_UNSUPPORTED)
        job = await context.start(
            lambda: context.planner.plan_chat(_chat_request(parsed)), parsed.model, _renamed
        )
        prompt_tokens = len(job.plan.prompts[0])
        message = MessageObject(
            model=context.names[0], usage=Usage(input_tokens=prompt_tokens, output_tokens=0)
        )
        if parsed.stream:
            return EventSourceResponse(_stream(context, job, message, parsed))
        if not await context.run_to_end(job, request, ENDPOINT):
            return Response(status_code=499)
        (choice,) = job.choices
        answer = whole_answer(job.plan.reading, "".join(choice.text))
        message.content = _blocks(answer.reasoning, answer.content, answer.calls)
        message.stop_reason, message.stop_sequence = _stop(context, job, parsed, bool(answer.calls))
        message.usage = _usage(context, job)
        return JSONResponse(message.model_dump(mode="json"))

    @router.post(
        f"{MESSAGES_PATH}/count_tokens",
        responses=answers(TokenCount, AnthropicError, 400, 401, 404, 413),
    )
    async def count_tokens(request: Request) -> JSONResponse:
        parsed = await context.read(request, CountTokensRequest, MESSAGES_UNSUPPORTED)
        chat = _chat_request(parsed)
        offered = chat.tools if chat.tool_choice != "none" else None
        tokenize = TokenizeRequest(
            TokenizeMessages(
                messages=chat.messages,
                tools=offered,
                chat_template_kwargs=chat.chat_template_kwargs,
            )
        )
        try:
            counted = context.planner.tokenize(tokenize)
        except ApiError as error:
            raise _renamed(error) from None
        return JSONResponse(TokenCount(input_tokens=counted.count).model_dump(mode="json"))

    return router


def _chat_request(request: _Conversation) -> ChatCompletionRequest:
    """The request as the chat route takes it: the same planner plans both."""
    fields: dict[str, Any] = {"messages": _messages(request)}
    if request.tools:
        fields["tools"] = [
            ToolDefinition(
                function=FunctionDefinition(
                    name=tool.name, description=tool.description, parameters=tool.input_schema
                )
            )
            for tool in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, ToolChoiceTool):
        fields["tool_choice"] = NamedToolChoice(function=NamedFunction(name=choice.name))
    elif choice is not None and (request.tools or choice.type == "any"):
        fields["tool_choice"] = TOOL_CHOICES[choice.type]
    if choice is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if request.thinking is not None and request.thinking.type != "adaptive":
        fields["chat_template_kwargs"] = {"enable_thinking": request.thinking.type == "enabled"}
    if isinstance(request, MessagesRequest):
        fields.update(
            max_tokens=request.max_tokens,
            stop=request.stop_sequences or None,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
        )
        form = request.output_config.format if request.output_config else None
        if form is not None:
            fields["response_format"] = ResponseFormat(
                type="json_schema", json_schema=JsonSchemaFormat(schema=form.json_schema)
            )
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as error:
        raise ApiError(400, f"messages: {error.errors()[0].get('msg')}", "messages") from None


def _messages(request: _Conversation) -> list[ChatMessage | ToolMessage]:
    """The conversation as chat messages: tool results as tool turns (before the text
    of their user turn), an assistant's tool_use blocks as its calls."""
    messages: list[ChatMessage | ToolMessage] = []
    system = request.system_text()
    if system:
        messages.append(ChatMessage(role="system", content=system))
    for message in request.messages:
        if isinstance(message.content, str):
            messages.append(ChatMessage(role=message.role, content=message.content))
            continue
        texts = [block.text for block in message.content if isinstance(block, TextBlock)]
        if message.role == "assistant":
            calls = [
                ToolCallMessage(
                    id=block.id,
                    function=FunctionCall(name=block.name, arguments=json.dumps(block.input)),
                )
                for block in message.content
                if isinstance(block, ToolUseBlock)
            ]
            messages.append(
                ChatMessage(
                    role="assistant", content="".join(texts) or None, tool_calls=calls or None
                )
            )
            continue
        results = [block for block in message.content if isinstance(block, ToolResultBlock)]
        for block in results:
            text = f"Error: {block.text()}" if block.is_error else block.text()
            messages.append(ToolMessage(role="tool", content=text, tool_call_id=block.tool_use_id))
        if texts or not results:  # a turn of thinking blocks alone is still a turn
            messages.append(ChatMessage(role="user", content="".join(texts)))
    return messages


def _renamed(error: ApiError) -> ApiError:
    param, message = error.param, error.message
    for chat, ours in FIELD_NAMES.items():
        if param is not None and param.partition(".")[0] == chat:
            param, message = ours, message.replace(f"{chat}:", f"{ours}:")
    return ApiError(error.status, message, param, error.kind, error.code)


def _blocks(
    reasoning: str | None, content: str | None, calls: tuple[ToolCall, ...]
) -> list[OutBlock]:
    blocks: list[OutBlock] = []
    if reasoning:
        blocks.append(OutThinking(thinking=reasoning))
    if content or not calls:
        blocks.append(OutText(text=content or ""))
    blocks += [
        OutToolUse(id=call.id, name=call.name, input=_input(call.arguments)) for call in calls
    ]
    return blocks


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object ({} for a call cut short by max_tokens)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(
    context: RouteContext, job: Job, request: MessagesRequest, called: bool
) -> tuple[StopReason, str | None]:
    """Why the message stopped, and the stop sequence it met (Anthropic's names)."""
    (choice,) = job.choices
    if choice.finish_reason is FinishReason.TOKEN_LIMIT:
        return "max_tokens", None
    if called:
        return "tool_use", None
    if choice.finish_reason is FinishReason.STOP_STRING:
        # The text ends before the stop sequence; the tokens hold it.
        shown = "".join(choice.text)
        rest = context.planner.backend.decode(choice.tokens)[len(shown) :]
        met = [stop for stop in request.stop_sequences or () if stop in rest]
        return "stop_sequence", min(met, key=rest.find) if met else None
    return "end_turn", None


def _usage(context: RouteContext, job: Job) -> Usage:
    usage = context.responses.usage(job)
    cached = usage.prompt_tokens_details.cached_tokens
    return Usage(
        input_tokens=usage.prompt_tokens - cached,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=cached,
    )


class _Blocks:
    """The stream's content blocks as they open and close."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text", "tool_use"

    def feed(self, delta: AnswerDelta) -> Iterator[StreamEvent]:
        if delta.reasoning:
            yield from self.open_block("thinking", OutThinking(thinking=""))
            yield BlockDelta(index=self.index, delta=ThinkingDelta(thinking=delta.reasoning))
        if delta.content:
            yield from self.open_block("text", OutText(text=""))
            yield BlockDelta(index=self.index, delta=TextDelta(text=delta.content))
        for piece in delta.calls:
            if piece.id is not None:
                yield from self.close()
                yield from self.open_block(
                    "tool_use", OutToolUse(id=piece.id, name=piece.name or "", input={})
                )
            if piece.arguments:
                yield BlockDelta(
                    index=self.index, delta=InputJsonDelta(partial_json=piece.arguments)
                )

    def close(self) -> Iterator[StreamEvent]:
        if self.open is not None:
            self.open = None
            yield BlockStop(index=self.index)

    def open_block(self, kind: str, block: OutBlock) -> Iterator[StreamEvent]:
        if self.open == kind:
            return
        yield from self.close()
        self.index += 1
        self.open = kind
        yield BlockStart(index=self.index, content_block=block)


async def _stream(
    context: RouteContext, job: Job, message: MessageObject, request: MessagesRequest
) -> AsyncIterator[bytes]:
    """Anthropic's events; a dropped connection cancels the generation (the generator
    is closed)."""
    reader = AnswerStream(job.plan.reading)
    blocks = _Blocks()
    try:
        yield _event(MessageStart(message=message))
        async for _, update in context.service.follow(job):
            if update.finish_reason is FinishReason.FAILED:
                break
            for event in blocks.feed(reader.feed(update.text, update.finish_reason is not None)):
                yield _event(event)
        failure = context.responses.failure(job)
        if failure is not None:
            yield format_sse_event(event="error", data_str=json.dumps(anthropic_error(failure)))
            return
        if blocks.index < 0:  # nothing was said: one empty text block, as the body has
            for event in blocks.open_block("text", OutText(text="")):
                yield _event(event)
        for event in blocks.close():
            yield _event(event)
        reason, sequence = _stop(context, job, request, reader.made_calls)
        yield _event(
            MessageDelta(
                delta=StopDelta(stop_reason=reason, stop_sequence=sequence),
                usage=_usage(context, job),
            )
        )
        yield _event(MessageStop())
    finally:
        context.service.finish(job, ENDPOINT)


def _event(event: BaseModel) -> bytes:
    return format_sse_event(event=event.type, data_str=event.model_dump_json())  # type: ignore[attr-defined]
