"""Tools, tool calls, and reading call objects out of text that may still be growing.

Owns: the plain values of function calling (`Tool`, `ToolChoice`, `ToolCall`,
`PartialCall`) and `scan_calls`, which reads a run of call objects
(`{"name": ..., "arguments": {...}}`, alone, in a JSON list, or separated by `;`) from
a text that may end in the middle of one.
Promises: scanning a longer text that starts with a shorter one never takes back what
the shorter one gave: a name once complete stays, an arguments text only grows, a call
once complete stays complete; so a stream can send the difference each time.
Never: decides what is content and what is a call (the formats do), or touches a
tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from cellbatch.types import InvalidArgumentError

WHITESPACE = " \t\r\n"
# The keys a call object names its arguments by: OpenAI's and Hermes' "arguments",
# Llama 3's "parameters".
ARGUMENT_KEYS = ('"arguments"', '"parameters"')


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and a JSON schema of its
    arguments (an object schema)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgumentError("a tool needs a name")
        if not isinstance(self.parameters, Mapping):
            raise InvalidArgumentError(
                f"the parameters of tool {self.name!r} must be a JSON schema object, got "
                f"{type(self.parameters).__name__}"
            )

    def spec(self) -> dict[str, Any]:
        """The tool as OpenAI's API and chat templates write it."""
        function: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolMode(Enum):
    """How a request lets the model call its tools; every call it makes fits its tool's
    schema (a grammar holds it)."""

    NONE = "none"  # no calls: the tools are not offered
    AUTO = "auto"  # text, or calls, as the model decides
    REQUIRED = "required"  # one or more calls of any tool, nothing else
    FUNCTION = "function"  # exactly one call of the named tool, nothing else


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolMode
    name: str = ""  # the function, for ToolMode.FUNCTION


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: `arguments` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class PartialCall:
    """A call object as far as the text goes: `name` None until its string closes;
    `arguments` the JSON text so far; `done` once the whole object has closed."""

    name: str | None
    arguments: str = ""
    done: bool = False


class _Incomplete(Exception):
    """The text ended before the structure did."""


class _Malformed(Exception):
    """The text cannot be what was expected."""


@dataclass
class CallRun:
    """What `scan_calls` found: the calls (the last may be partial), where the run ends
    in the text (None while it is open), and whether the text broke the shape."""

    calls: list[PartialCall]
    end: int | None
    malformed: bool


def scan_calls(text: str, start: int = 0, separators: str = ",;") -> CallRun:
    """The call objects from `start`: one object, a JSON list of them, or objects
    separated by one of `separators`; whitespace allowed between."""
    calls: list[PartialCall] = []
    at = _skip(text, start)
    listed = at < len(text) and text[at] == "["
    if listed:
        at = _skip(text, at + 1)
    try:
        while True:
            call, at = _scan_call(text, at, calls)
            calls.append(call)
            at = _skip(text, at)
            if at == len(text):
                return CallRun(calls, None if listed else at, False)
            if listed and text[at] == "]":
                return CallRun(calls, at + 1, False)
            if text[at] not in separators:
                return CallRun(calls, at, listed)  # a list must close with "]"
            at = _skip(text, at + 1)
    except _Incomplete:
        return CallRun(calls, None, False)
    except _Malformed:
        return CallRun(calls, None, True)


def _scan_call(text: str, at: int, calls: list[PartialCall]) -> tuple[PartialCall, int]:
    """One `{"name": "...", "arguments": {...}}` from `at`, and the index after it. On
    a text that ends inside it, the call as far as it goes is added to `calls` (once
    its name is whole) before _Incomplete rises."""
    at = _expect(text, at, "{")
    at = _expect(text, _skip(text, at), '"name"')
    at = _expect(text, _skip(text, at), ":")
    at = _skip(text, at)
    name_end = _string_end(text, at)
    if name_end is None:
        raise _Incomplete
    name = json.loads(text[at:name_end])
    if not isinstance(name, str):
        raise _Malformed
    partial = PartialCall(name)
    try:
        at = _expect(text, _skip(text, name_end), ",")
        at = _skip(text, at)
        at = _expect_one(text, at, ARGUMENT_KEYS)
        at = _expect(text, _skip(text, at), ":")
        at = _skip(text, at)
        if at < len(text) and text[at] != "{":
            raise _Malformed
        arguments_end = _value_end(text, at)
        if arguments_end is None:
            partial = PartialCall(name, text[at:])
            raise _Incomplete
        arguments = text[at:arguments_end]
        partial = PartialCall(name, arguments)
        object_end = _value_end(text, arguments_end, depth=1)
        if object_end is None:
            raise _Incomplete
    except _Incomplete:
        calls.append(partial)
        raise
    return PartialCall(name, arguments, done=True), object_end


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in WHITESPACE:
        at += 1
    return at


def _expect(text: str, at: int, literal: str) -> int:
    if text.startswith(literal, at):
        return at + len(literal)
    if literal.startswith(text[at:]):
        raise _Incomplete
    raise _Malformed


def _expect_one(text: str, at: int, literals: tuple[str, ...]) -> int:
    incomplete = False
    for literal in literals:
        try:
            return _expect(text, at, literal)
        except _Incomplete:
            incomplete = True
        except _Malformed:
            pass
    raise _Incomplete if incomplete else _Malformed


def _string_end(text: str, at: int) -> int | None:
    """The index after the JSON string starting at `at` (None if it has not closed)."""
    if at == len(text):
        return None
    if text[at] != '"':
        raise _Malformed
    escaped = False
    for index in range(at + 1, len(text)):
        char = text[index]
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            return index + 1
    return None


def _value_end(text: str, at: int, depth: int = 0) -> int | None:
    """The index after the object or list that opens at `at` (or, with `depth` 1, after
    the bracket that closes the one `at` is inside); None while open."""
    in_string = escaped = False
    for index in range(at, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def complete_call(call: PartialCall) -> bool:
    """Whether a scanned call is whole: a name, and arguments that are a JSON object."""
    if not call.done or call.name is None:
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except json.JSONDecodeError:
        return False
