"""Anthropic's Messages API (`/v1/messages`): its request, its message, its stream
events and its errors, as pydantic models.

Owns: the fields cellbatch reads from a `POST /v1/messages` body (`system`, messages
of text, `tool_use`, `tool_result` and `thinking` blocks, client tools and
`tool_choice`, `max_tokens`, `stop_sequences`, sampling, `output_config.format`) and from
`/v1/messages/count_tokens`, and the shapes it answers with: the message (thinking,
text and tool_use blocks, `stop_reason`, usage), the stream's events, Anthropic's error
shape.
Promises: a field of the wrong type, a block the server cannot read (an image, a
document) or a tool it does not run (Anthropic's server tools) fails validation, so
the app answers 400 naming it; other top-level fields are kept in `model_extra`,
logged and ignored; the answers serialise to the shapes the official `anthropic`
client parses.
Never: plans or runs anything.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from cellbatch.server.protocol import (
    FUNCTION_NAME_PATTERN,
    INTEGRAL,
    Int,
    NewTokens,
    Text,
    document_unsupported,
)


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Loose):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Loose):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Loose):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(_Loose):
    """An earlier answer's thinking: kept in the history, not shown to the model again
    (as thinking templates drop the reasoning of past turns)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Loose):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Loose):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Loose):
    """A client tool: the model calls it, the client runs it."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceMode(_Loose):
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Loose):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


ToolChoice = Annotated[ToolChoiceMode | ToolChoiceTool, Field(discriminator="type")]


class ThinkingConfig(_Loose):
    """Whether the model thinks, for chat templates that read `enable_thinking` (Qwen3's):
    "enabled" sets it, "disabled" clears it, "adaptive" leaves the template's default;
    `budget_tokens` is not enforced (max_tokens bounds the whole answer)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int | None = None


class JsonOutputFormat(_Loose):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Loose):
    """`format`: the answer is JSON fitting the schema (structured outputs); `effort`
    is accepted and not acted on."""

    format: JsonOutputFormat | None = None
    effort: str | None = None


# Fields of Anthropic's Messages API that cellbatch does not do: a request giving one a
# value that asks for something is refused.
MESSAGES_UNSUPPORTED = ("container", "mcp_servers")


class _Conversation(BaseModel):
    # Other fields are kept (in model_extra) to be logged: none is dropped without a word.
    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra=lambda schema, model: document_unsupported(
            schema, model, MESSAGES_UNSUPPORTED
        ),
    )

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def system_text(self) -> str:
        if self.system is None:
            return ""
        if isinstance(self.system, str):
            return self.system
        return "\n".join(block.text for block in self.system)


class MessagesRequest(_Conversation):
    max_tokens: NewTokens
    stop_sequences: list[Text] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0), INTEGRAL] = 0  # 0: off
    stream: bool = False
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None  # accepted, not acted on
    service_tier: str | None = None  # accepted, not acted on


class CountTokensRequest(_Conversation):
    pass


class TokenCount(BaseModel):
    input_tokens: int


# -- the answer ----------------------------------------------------------------------------


class OutText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class OutThinking(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing signs this server's thinking


class OutToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


OutBlock = Annotated[OutText | OutThinking | OutToolUse, Field(discriminator="type")]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    input_tokens: int  # the prompt's tokens not read from the prefix cache
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageObject(BaseModel):
    id: str = Field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutBlock] = Field(default_factory=list)
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class MessageStart(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageObject


class BlockStart(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class BlockDelta(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class BlockStop(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDelta(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: Usage


class MessageStop(BaseModel):
    type: Literal["message_stop"] = "message_stop"


# -- errors --------------------------------------------------------------------------------


class AnthropicErrorBody(BaseModel):
    type: str
    message: str
    # cellbatch's code for the refusal, where it has one (as in OpenAI's shape); absent
    # otherwise.
    code: str | None = None

    @model_serializer(mode="wrap")
    def _without_null_code(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorBody


StreamEvent = MessageStart | BlockStart | BlockDelta | BlockStop | MessageDelta | MessageStop

# Anthropic's error types, by status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
