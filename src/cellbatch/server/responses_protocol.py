"""OpenAI's Responses API (`/v1/responses`): its request, its response object, its
items and its stream events, as pydantic models.

Owns: the fields cellbatch reads from a `POST /v1/responses` body (input as text or
items: messages, `function_call` and `function_call_output` items, reasoning items;
function tools and `tool_choice`; `text.format`; sampling and storage), and the shapes
it answers with: the response object with its output items (`reasoning`, `message`,
`function_call`) and usage, the deletion answer, and each typed stream event.
Promises: a field of the wrong type or a value the server does not do (a tool other
than a function, `background: true`, `truncation: "auto"`) fails validation, so the app
answers 400 naming it and the published schema says so; other top-level fields are kept
in `model_extra`, logged and ignored, as on the chat route; the answers serialise to the
shapes the official `openai` client parses.
Never: plans, runs or stores anything.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag

from cellbatch.server.protocol import (
    FUNCTION_NAME_PATTERN,
    JsonSchemaFormat,
    NewTokens,
    document_unsupported,
)

# -- the request ---------------------------------------------------------------------------


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class InputText(_Loose):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str


class Refusal(_Loose):
    type: Literal["refusal"]
    refusal: str


class MessageItem(_Loose):
    """A message of the conversation (OpenAI's EasyInputMessage and message items)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | Refusal]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(
            part.text if isinstance(part, InputText) else part.refusal for part in self.content
        )


class FunctionCallItem(_Loose):
    """A call the model made (an output item, sent back as input)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text of an object
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Loose):
    """What a call returned, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningInputItem(_Loose):
    """A reasoning item of an earlier answer: kept in the history, not shown to the
    model again (as thinking templates drop the reasoning of past turns)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[InputText] = Field(default_factory=list)
    content: list[InputText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(item: Any) -> str:
    """An item's type; a message may leave it out (OpenAI's EasyInputMessage)."""
    if isinstance(item, dict):
        return str(item.get("type", "message"))
    return str(getattr(item, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Loose):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Loose):
    type: Literal["function"]
    name: str


class TextFormatText(_Loose):
    type: Literal["text"]


class TextFormatJsonObject(_Loose):
    type: Literal["json_object"]


class TextFormatJsonSchema(JsonSchemaFormat):
    """`text.format` of type json_schema: the schema sits beside the name (unlike chat's
    `response_format`, where it sits inside `json_schema`)."""

    type: Literal["json_schema"]


class TextConfig(_Loose):
    format: Annotated[
        TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
        Field(discriminator="type"),
    ] = Field(default_factory=lambda: TextFormatText(type="text"))
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not acted on


class ReasoningConfig(_Loose):
    """Accepted and not acted on: the model thinks as its template says."""

    effort: str | None = None
    summary: str | None = None


# Fields of OpenAI's Responses API that cellbatch does not do: a request giving one a
# value that asks for something is refused (as on chat).
RESPONSES_UNSUPPORTED = ("conversation", "prompt", "max_tool_calls", "top_logprobs")


def _not_true(value: bool) -> bool:
    if value:
        raise ValueError("background responses are not supported: leave background out")
    return value


class ResponsesRequest(BaseModel):
    # Other fields are kept (in model_extra) to be logged: none is dropped without a word.
    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra=lambda schema, model: document_unsupported(
            schema, model, RESPONSES_UNSUPPORTED
        ),
    )

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: NewTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    # Accepted; nothing to do: no encrypted reasoning, no tiers, no prompt cache keys.
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # What the server does not do: only the values that ask for nothing.
    background: (
        Annotated[bool, Field(json_schema_extra={"const": False}), AfterValidator(_not_true)] | None
    ) = None
    truncation: Literal["disabled"] | None = None


# -- the answer ----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: new_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: new_id("fc"))
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "completed"


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: new_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "completed"


OutputItem = Annotated[
    OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")
]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str = Field(default_factory=lambda: new_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None


class InputItemList(BaseModel):
    """A page of a kept response's input items (`GET /v1/responses/{id}/input_items`)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


# -- the stream ----------------------------------------------------------------------------


class _Event(BaseModel):
    sequence_number: int = 0  # the writer numbers the events in order


class ResponseEvent(_Event):
    """response.created, .in_progress, .completed, .incomplete, .failed."""

    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    response: ResponseObject


class ItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta", "response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None


StreamEvent = (
    ResponseEvent
    | ItemEvent
    | ContentPartEvent
    | TextDeltaEvent
    | TextDoneEvent
    | ArgumentsDeltaEvent
    | ArgumentsDoneEvent
    | ErrorEvent
)
