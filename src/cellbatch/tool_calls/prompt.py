"""A conversation with tools, as a chat template takes it.

Owns: `conversation`, which turns OpenAI-shaped messages (assistant `tool_calls`,
`tool` results) and the offered tools into what a template renders: for a template
with a place for tools, the messages with each call's arguments as an object (as
Hugging Face templates expect) and the tools as a list; for one without (ChatML, the
default model's), the tools described in the system message in the format's words,
the calls written as the format writes them, and the results as a user turn.
Promises: no message is dropped and nothing in one is lost; the template sees only
the roles it knows (system, user, assistant) when it has no place for tools.
Never: renders the template (the tokenizer does) or checks the arguments.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from cellbatch.tool_calls.calls import Tool
from cellbatch.tool_calls.formats import ToolFormat

Message = dict[str, Any]


def conversation(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Tool],
    form: ToolFormat,
    template_takes_tools: bool,
) -> tuple[list[Message], list[Message] | None]:
    """(the messages, the tools) to render; `tools` empty when none is offered."""
    if template_takes_tools:
        rendered = [_with_object_arguments(message) for message in messages]
        return rendered, [tool.spec() for tool in tools] or None
    rendered = _written_out(messages, form)
    if tools:
        offer = form.instructions(tools)
        if rendered and rendered[0]["role"] == "system":
            first = rendered[0]
            rendered[0] = {**first, "content": f"{first['content']}\n\n{offer}".lstrip()}
        else:
            rendered.insert(0, {"role": "system", "content": offer})
    return rendered, None


def _arguments(call: Mapping[str, Any]) -> object:
    """A call's arguments as an object when its JSON text is one (else the text)."""
    arguments = call["function"]["arguments"]
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _with_object_arguments(message: Mapping[str, Any]) -> Message:
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    return {
        **message,
        "tool_calls": [
            {**call, "function": {**call["function"], "arguments": _arguments(call)}}
            for call in calls
        ],
    }


def _written_out(messages: Sequence[Mapping[str, Any]], form: ToolFormat) -> list[Message]:
    """The messages with calls and results as plain text in the format's words."""
    rendered: list[Message] = []
    names: dict[str, str] = {}  # call id -> function name, for the results
    results: list[str] = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            name = message.get("name") or names.get(message.get("tool_call_id") or "", "a tool")
            results.append(form.write_result(name, message.get("content") or ""))
            continue
        if results:
            rendered.append({"role": "user", "content": "\n".join(results)})
            results = []
        calls = message.get("tool_calls") or []
        content = message.get("content") or ""
        if calls:
            for call in calls:
                names[call.get("id") or ""] = call["function"]["name"]
            written = form.write_calls([(c["function"]["name"], _arguments(c)) for c in calls])
            content = f"{content}\n{written}" if content else written
        rendered.append({"role": role, "content": content})
    if results:
        rendered.append({"role": "user", "content": "\n".join(results)})
    return rendered
