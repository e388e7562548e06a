"""The ways models write tool calls: how to read them, how to hold a model to them, and
how to describe them to a model whose chat template has no place for tools.

Owns: `ToolFormat` and its three formats, named as vLLM's `--tool-call-parser` names
them: `hermes` (Hermes, Qwen and the generic format: `<tool_call>{...}</tool_call>`
blocks), `llama3_json` (Llama 3.x: the answer is `{"name": ..., "parameters": ...}`
objects separated by `;`) and `mistral` (`[TOOL_CALLS]` then a JSON list of calls);
`format_for_template`, which picks one from a chat template.
Promises: `parse(text, final=False)` on a text that grows never takes back content or
calls it gave (a stream sends the difference); a region that could still become a call
is held back, not shown as content, until it is decided; `parse(text, final=True)`
gives as calls the whole calls and a call the text ends inside (cut short by the token
limit: its arguments as far as they go), and keeps everything else as content, markup
included, so nothing the model wrote is lost.
`grammar` is a Lark grammar (llguidance's dialect) that only the format's calls of the
given tools, with arguments fitting each tool's schema, satisfy (with `free_text`, text
without the format's markup too, or text and then such calls).
Never: tokenizes, generates, or names call ids (the stream does).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from cellbatch.tool_calls.calls import (
    WHITESPACE,
    PartialCall,
    Tool,
    complete_call,
    scan_calls,
)
from cellbatch.types import InvalidArgumentError

# JSON as the grammar writes it: ", " and ": " between items, no other whitespace (with
# free whitespace a model can pad forever and never close the object).
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Parsed:
    """A text split into what is shown as content and the calls in it."""

    content: str
    calls: tuple[PartialCall, ...] = ()


class ToolFormat(ABC):
    name: ClassVar[str]
    arguments_key: ClassVar[str] = "arguments"
    # Markup that a model's vocabulary may hold as one special token (the decoded
    # text then lacks it, and a grammar names the token by id).
    special_markers: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed: ...

    @abstractmethod
    def _grammar_rules(self, parallel: bool, markers: Mapping[str, str]) -> str:
        """Lark rules `calls` (the calls alone) and `answer` (free text without the
        format's markup, or calls as the format allows them after text), over
        `call_json`, the rule one call's JSON object is."""

    @abstractmethod
    def write_calls(self, calls: Sequence[tuple[str, object]]) -> str:
        """(name, arguments) calls as the model writes them."""

    def write_result(self, name: str, content: str) -> str:
        return f"The function {name} returned:\n{content}"

    def grammar(
        self,
        tools: Sequence[Tool],
        parallel: bool,
        special_ids: Mapping[str, int],
        free_text: bool = False,
    ) -> str:
        """The Lark grammar of one call (or, `parallel`, one or more) of any of `tools`;
        with `free_text`, of an answer that is text or calls (tool_choice auto: a call,
        when the model makes one, still fits its tool). `special_ids` gives the ids of
        this format's markers that are special tokens."""
        markers = {
            marker: f"<[{special_ids[marker]}]>" if marker in special_ids else json.dumps(marker)
            for marker in self.special_markers
        }
        schema = _calls_schema(tools, self.arguments_key)
        return (
            f"start: {'answer' if free_text else 'calls'}\n"
            + self._grammar_rules(parallel, markers)
            + f"\ncall_json: %json {json.dumps(schema)}\n"
        )

    def instructions(self, tools: Sequence[Tool]) -> str:
        """A system message offering `tools` to a model whose template has no place for
        them, in this format's words."""
        listed = "\n".join(json.dumps(tool.spec(), ensure_ascii=False) for tool in tools)
        example = self.write_calls([("the_function_name", {"an_argument": "its value"})])
        return (
            "You can call functions to answer. They are listed here, one JSON schema per "
            f"line:\n<tools>\n{listed}\n</tools>\n\nTo call functions, answer with the "
            f"calls alone, written exactly like this:\n{example}"
        )


def _calls_schema(tools: Sequence[Tool], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call object of any of `tools`; each tool's `$defs` move
    to the root, where its `$ref`s point."""
    if not tools:
        raise InvalidArgumentError("a tool call grammar needs at least one tool")
    definitions: dict[str, Any] = {}
    options = []
    for tool in tools:
        parameters = dict(tool.parameters)
        for key, value in parameters.pop("$defs", {}).items():
            if definitions.setdefault(key, value) != value:
                raise InvalidArgumentError(
                    f"two tools define the schema {key!r} differently in $defs; rename one"
                )
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, arguments_key: parameters},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if definitions:
        schema = {**schema, "$defs": definitions}
    return {**schema, "x-guidance": _JSON_LAYOUT}


def _held(text: str, marker: str) -> str:
    """`text` without its end where that end could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text


def _whole(run_calls: Sequence[PartialCall], end: int | None, text: str, malformed: bool) -> bool:
    """Whether a scanned run is nothing but whole calls up to the end of `text`."""
    return (
        not malformed
        and end is not None
        and not text[end:].strip(WHITESPACE)
        and bool(run_calls)
        and all(complete_call(call) for call in run_calls)
    )


def _loose_calls(body: str) -> tuple[PartialCall, ...] | None:
    """The calls of a block the scanner could not read in order (keys swapped, no
    arguments): a JSON object or list of objects with a name; None if it is not one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    objects = value if isinstance(value, list) else [value]
    calls = []
    for item in objects:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(
            PartialCall(item["name"], json.dumps(arguments, ensure_ascii=False), done=True)
        )
    return tuple(calls) or None


class HermesFormat(ToolFormat):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a
    call, text allowed around them (Hermes, Qwen 2.5 and 3; the generic format)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        content: list[str] = []
        calls: list[PartialCall] = []
        at = 0
        while True:
            start = text.find(self.OPEN, at)
            if start < 0:
                tail = text[at:] if final else _held(text[at:], self.OPEN)
                if not calls or tail.strip(WHITESPACE):
                    content.append(tail)
                return Parsed("".join(content), tuple(calls))
            between = text[at:start]
            if not calls or between.strip(WHITESPACE):
                content.append(between)
            body_start = start + len(self.OPEN)
            end = text.find(self.CLOSE, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            run = scan_calls(body)
            if end < 0 and not run.malformed:
                # A call being written (or, at the end, cut short): its calls so far.
                calls.extend(run.calls)
                return Parsed("".join(content), tuple(calls))
            if end < 0 and not final:
                return Parsed("".join(content), tuple(calls))  # broken: decided at the end
            found: tuple[PartialCall, ...] | None = None
            if _whole(run.calls, run.end, body, run.malformed):
                found = tuple(run.calls)
            else:
                found = _loose_calls(body)
            block_end = len(text) if end < 0 else end + len(self.CLOSE)
            if found:
                calls.extend(found)
            else:
                content.append(text[start:block_end])
            at = block_end

    def _grammar_rules(self, parallel: bool, markers: Mapping[str, str]) -> str:
        repeat = ' ("\\n" call)*' if parallel else ""
        # Text before calls ends at the first "<tool_call>" (`stop` takes it in), and
        # text alone never holds one.
        return (
            f"calls: call{repeat}\n"
            'call: "<tool_call>\\n" call_json "\\n</tool_call>"\n'
            f'answer: FREE | before_call "\\n" call_json "\\n</tool_call>"{repeat}\n'
            "FREE: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/\n"
            'before_call[stop="<tool_call>"]: /(?s:.*)/'
        )

    def write_calls(self, calls: Sequence[tuple[str, object]]) -> str:
        written = (
            json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
            for name, arguments in calls
        )
        return "\n".join(f"{self.OPEN}\n{call}\n{self.CLOSE}" for call in written)

    def write_result(self, name: str, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class _WholeAnswerFormat(ToolFormat):
    """Formats where calls are the whole answer after an optional marker: a text that
    starts otherwise is content."""

    opening: ClassVar[str]  # the first character of the calls (after the marker)
    separators: ClassVar[str]

    def parse(self, text: str, final: bool) -> Parsed:
        marker = self.special_markers[0]
        found = text.find(marker)
        if found >= 0:
            content, at = text[:found], found + len(marker)
        else:
            content, at = "", _skip_space(text, 0)
            if at == len(text) or (not final and marker.startswith(text[at:])):
                # Nothing yet, or what may become the marker: undecided.
                return Parsed(text if final else "")
            if text[at] != self.opening:
                return Parsed(text)
        run = scan_calls(text, at, self.separators)
        if final:
            cut_short = run.end is None and not run.malformed
            if cut_short or _whole(run.calls, run.end, text, run.malformed):
                return Parsed(content, tuple(run.calls))
            return Parsed(text)
        if run.malformed:
            return Parsed(content)  # decided at the end
        return Parsed(content, tuple(run.calls))


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in WHITESPACE:
        at += 1
    return at


class Llama3JsonFormat(_WholeAnswerFormat):
    """`{"name": ..., "parameters": {...}}`, several separated by `;` (Llama 3.1 to 3.3's
    JSON tool calling; `<|python_tag|>` may come first)."""

    name = "llama3_json"
    arguments_key = "parameters"
    special_markers = ("<|python_tag|>",)
    opening = "{"
    separators = ";"

    def _grammar_rules(self, parallel: bool, markers: Mapping[str, str]) -> str:
        repeat = ' ("; " call_json)*' if parallel else ""
        # Text alone never opens with "{", which would start a call.
        return (
            f"calls: call_json{repeat}\n"
            "answer: FREE | calls\n"
            "FREE: /(?s:.*)/ & ~/(?s:[ \\t\\r\\n]*\\{.*)/"
        )

    def write_calls(self, calls: Sequence[tuple[str, object]]) -> str:
        return "; ".join(
            json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
            for name, arguments in calls
        )


class MistralFormat(_WholeAnswerFormat):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral's instruct
    models; the marker is a special token the decoded text may lack)."""

    name = "mistral"
    special_markers = ("[TOOL_CALLS]",)
    opening = "["
    separators = ","

    def _grammar_rules(self, parallel: bool, markers: Mapping[str, str]) -> str:
        repeat = ' (", " call_json)*' if parallel else ""
        # Text alone never opens with "[" nor holds the marker, which would start calls.
        return (
            f'calls: {markers["[TOOL_CALLS]"]} "[" call_json{repeat} "]"\n'
            "answer: FREE | calls\n"
            "FREE: /(?s:.*)/ & ~/(?s:[ \\t\\r\\n]*\\[.*)/ & ~/(?s:.*\\[TOOL_CALLS\\].*)/"
        )

    def write_calls(self, calls: Sequence[tuple[str, object]]) -> str:
        listed = [{"name": name, "arguments": arguments} for name, arguments in calls]
        return "[TOOL_CALLS]" + json.dumps(listed, ensure_ascii=False)


FORMATS: dict[str, ToolFormat] = {
    form.name: form for form in (HermesFormat(), Llama3JsonFormat(), MistralFormat())
}


def format_named(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise InvalidArgumentError(
            f"unknown tool call parser {name!r}; choose one of {', '.join(FORMATS)}"
        )
    return FORMATS[name]


def format_for_template(template: str | None) -> ToolFormat:
    """The format a chat template's model writes calls in: Mistral's or Llama 3's when
    the template names their markup, else Hermes' (Qwen's, and the generic format for
    templates with no place for tools)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "tools" in template):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]
