"""The OpenAI API's request shapes, as pydantic models.

Owns: the fields cellbatch reads from `/v1/completions` and `/v1/chat/completions`
requests, named as the OpenAI API names them (plus vLLM's `top_k`, `min_p` and
`repetition_penalty`): history messages, tool definitions and calls (`ToolCallMessage`,
which answers reuse), tool choices, response formats and the constraint a request asks
for among them; the fields that peers take and cellbatch does not
(`UNSUPPORTED_FIELDS`), and which of their values ask for something. (The bodies and
stream chunks answered, the `/v1/models` list and the error body are `reply_bodies`';
the tokenize routes' shapes are `tokenize_protocol`'s.)
Promises: a field of the wrong type or out of range fails validation (the app
answers 400 in OpenAI's error shape, naming the field); a request's other top-level
fields are kept in `model_extra` for the app to refuse (an unsupported field that
asks for something) or log (an unknown one).
Never: tokenizes, generates or touches the engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from cellbatch.generation_config import Constraint
from cellbatch.server.openapi import bound

MAX_TOP_LOGPROBS = 20


def _integral(value: object) -> object:
    """A JSON number without a fraction (5.0) is an integer, as JSON Schema says."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer field of a request (strict models take no "5", but do take 5.0): last in
# its Annotated, so that its bounds stay JSON Schema's minimum and maximum.
INTEGRAL = BeforeValidator(_integral)
Int = Annotated[int, INTEGRAL]
MAX_SEED = 2**63 - 1

# A token id of the served model's vocabulary; new tokens, within its context.
TokenId = Annotated[int, Field(ge=0, json_schema_extra=bound("token")), INTEGRAL]
TokenPrompt = Annotated[
    list[TokenId], Field(min_length=1, json_schema_extra=bound("prompt_tokens"))
]
NewTokens = Annotated[int, Field(ge=1, json_schema_extra=bound("new_tokens")), INTEGRAL]
# Text that must hold something (a prompt, a stop string).
Text = Annotated[str, Field(min_length=1)]
# A logit_bias key: a token id written in decimal.
TOKEN_KEY = re.compile(r"0|[1-9][0-9]*")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


def _asks_nothing(name: str, value: Any) -> bool:
    if name == "best_of":
        return value in (None, 1)
    return value in (None, False, 0, "", [], {}, "none") or value == {"type": "text"}


# Fields of OpenAI's, vLLM's or llama.cpp's requests that change what is generated and
# that cellbatch does not do yet: a request giving one a value that asks for something
# (not null, false, 0, empty, "none", {"type": "text"}, or best_of 1) is refused, never answered
# as if the field were absent.
# (`tools` and `tool_choice` are the chat route's: a completion asking for them is refused.)
UNSUPPORTED_FIELDS = (
    "tools", "tool_choice", "functions", "function_call",
    "best_of", "suffix", "prompt_logprobs", "logits_processors",
)  # fmt: skip


# Of those, the ones the chat route takes (a completion asking for them is sent there).
CHAT_ONLY_FIELDS = ("tools", "tool_choice")


# The JSON schema of a value that asks for nothing (see _asks_nothing).
ASKS_NOTHING: dict[str, Any] = {
    "anyOf": [
        {"type": "null"},
        {"const": False},
        {"const": 0},
        {"const": ""},
        {"const": "none"},
        {"type": "array", "maxItems": 0},
        {"type": "object", "maxProperties": 0},
        {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"],
         "additionalProperties": False},
    ]
}  # fmt: skip


def _unsupported_schema(declared: set[str], fields: tuple[str, ...]) -> dict[str, Any]:
    """The unsupported `fields` a request body does not declare, each allowed only the
    values that ask for nothing."""
    return {
        name: {"anyOf": [{"type": "null"}, {"const": 1}]} if name == "best_of" else ASKS_NOTHING
        for name in fields
        if name not in declared
    }


def document_unsupported(
    schema: dict[str, Any], model: type[BaseModel], fields: tuple[str, ...] = UNSUPPORTED_FIELDS
) -> None:
    """`json_schema_extra` of a request model: its unsupported fields documented."""
    schema["properties"].update(_unsupported_schema(set(model.model_fields), fields))


def refused_fields(
    extra: dict[str, Any] | None, fields: tuple[str, ...] = UNSUPPORTED_FIELDS
) -> list[str]:
    """The unsupported fields of a request's extras that ask for something."""
    return [
        name for name in fields
        if extra and name in extra and not _asks_nothing(name, extra[name])
    ]  # fmt: skip


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON fitting a schema."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of a schema, a regex, a choice or a grammar."""

    model_config = ConfigDict(extra="ignore", strict=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Request(BaseModel):
    # Other fields are kept (in model_extra), for the app to refuse or log: none is
    # dropped without a word.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: (
        Annotated[int, Field(ge=0, json_schema_extra=bound("new_tokens")), INTEGRAL] | None
    ) = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1), INTEGRAL] = 0  # vLLM's: 0 or -1 is off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED), INTEGRAL] | None = None
    stop: Text | list[Text] | None = None
    n: Annotated[int, Field(ge=1, json_schema_extra=bound("sessions")), INTEGRAL] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    # Bounded where float32 arithmetic stays finite (vLLM's only asks for > 0).
    repetition_penalty: Annotated[float, Field(ge=0.01, le=100.0)] = 1.0
    user: str | None = None  # accepted and ignored
    # What the text must be: OpenAI's, vLLM's (and its older guided_*) and llama.cpp's
    # ways of saying it; a request gives at most one (`constraint`).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None  # llama.cpp's: GBNF
    json_schema: dict[str, Any] | None = None  # llama.cpp's
    # Token rules and stopping (OpenAI's logit_bias; vLLM's others), per request.
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
            Field(json_schema_extra=bound("token_keys")),
        ]
        | None
    ) = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0), INTEGRAL] = 0
    include_stop_str_in_output: bool = False
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[str] | None = None

    def constraint(self) -> tuple[Constraint, str] | None:
        """The request's constraint and the field that gave it; ValueError (naming the
        fields) when it gives more than one, or one that asks for nothing to enforce."""
        found: list[tuple[Constraint, str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append((Constraint.json_object(), "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("response_format of type json_schema needs its json_schema")
            found.append((Constraint.json_schema(fmt.json_schema.json_schema), "response_format"))
        outputs = self.structured_outputs
        if outputs is not None:
            found += _vllm_constraints(
                outputs.json_, outputs.regex, outputs.choice, outputs.grammar,
                lambda kind: f"structured_outputs.{kind}",
            )  # fmt: skip
            if outputs.json_object:
                found.append((Constraint.json_object(), "structured_outputs.json_object"))
        found += _vllm_constraints(
            self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar,
            lambda kind: f"guided_{kind}",
        )  # fmt: skip
        if self.json_schema is not None:
            found.append((Constraint.json_schema(self.json_schema), "json_schema"))
        if self.grammar is not None:
            found.append((Constraint.grammar(self.grammar, gbnf=True), "grammar"))
        if len(found) > 1:
            raise ValueError(
                "a request takes one constraint, got "
                + ", ".join(name for _, name in found)
                + "; keep one of them"
            )
        return found[0] if found else None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def _vllm_constraints(
    schema: dict[str, Any] | str | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
    field: Callable[[str], str],
) -> list[tuple[Constraint, str]]:
    """The constraints of vLLM's four kinds that are given, each with the name of the
    field that gave it (`field(kind)`): `structured_outputs`' and the older `guided_*`."""
    found = []
    if schema is not None:
        found.append((Constraint.json_schema(schema), field("json")))
    if regex is not None:
        found.append((Constraint.regex(regex), field("regex")))
    if choice is not None:
        found.append((Constraint.choice(choice), field("choice")))
    if grammar is not None:
        found.append((Constraint.grammar(grammar), field("grammar")))
    return found


class CompletionRequest(_Request):
    model_config = ConfigDict(
        json_schema_extra=lambda schema, model: _completion_schema(schema, model)
    )

    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1)]
        | TokenPrompt
        | Annotated[list[TokenPrompt], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), INTEGRAL] | None = None
    echo: bool = False


def _completion_schema(schema: dict[str, Any], model: type[BaseModel]) -> None:
    document_unsupported(schema, model)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"] = "text"
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str  # JSON text of an object, as OpenAI's API sends it


class ToolCallMessage(BaseModel):
    """A call in an assistant message of the history (and in an answer)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_message(self) -> dict[str, Any]:
        """The message as a chat template takes it (OpenAI's shape, text content)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatMessage(_Message):
    role: Literal["system", "user", "assistant", "developer"]


class ToolMessage(_Message):
    """A tool's result: it names the call it answers."""

    role: Literal["tool"]
    tool_call_id: str


Message = Annotated[ChatMessage | ToolMessage, Field(discriminator="role")]


# What a function's name may be (OpenAI's rule).
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"] = "function"
    function: NamedFunction


# Variables the chat template reads beside the conversation (vLLM's
# `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`); the names the template call
# itself takes are refused (see the planner).
TemplateKwargs = dict[str, Any]


class ChatCompletionRequest(_Request):
    model_config = ConfigDict(json_schema_extra=lambda schema, model: _chat_schema(schema, model))

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: NewTokens | None = None
    max_completion_tokens: NewTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), INTEGRAL] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: TemplateKwargs | None = None


def _chat_schema(schema: dict[str, Any], model: type[BaseModel]) -> None:
    document_unsupported(schema, model)
