"""A chat answer split into content and tool calls: whole, or as it streams.

Owns: `ToolCallStream`, one per streamed choice (the text so far, what content and
which calls with how much of their arguments were sent), `split_answer` for a whole
answer, and the calls' ids.
Promises: a stream's deltas are differences: content only grows, a call is announced
once (index, id, name) and its arguments then grow to the JSON text the whole answer
gives; the deltas of a stream and the whole answer's split agree for any answer the
format reads as it grows; with `parallel` false only the first call is kept (OpenAI's
`parallel_tool_calls: false`).
Never: takes back what it sent (an answer that turns out malformed at its end keeps
the call deltas already sent; its remaining text goes out as content).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from cellbatch.tool_calls.calls import PartialCall, ToolCall
from cellbatch.tool_calls.formats import ToolFormat


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallDelta:
    """What one step adds to call `index`: its id and name when it first appears
    (None after), and the next piece of its arguments' JSON text."""

    index: int
    id: str | None
    name: str | None
    arguments: str


def split_answer(
    form: ToolFormat, text: str, parallel: bool, new_id: Callable[[], str] = new_call_id
) -> tuple[str | None, tuple[ToolCall, ...]]:
    """The content and the calls of a whole answer (a call cut short by the token limit
    among them, its arguments as far as they go). Without calls, the content is the
    text as it is; with calls, the text around them, trimmed (None when nothing is
    left)."""
    parsed = form.parse(text, final=True)
    calls = _kept([call for call in parsed.calls if call.name is not None], parallel)
    if not calls:
        return parsed.content, ()
    content = parsed.content.strip()
    return content or None, tuple(ToolCall(new_id(), str(c.name), c.arguments) for c in calls)


def _kept(calls: list[PartialCall], parallel: bool) -> list[PartialCall]:
    return calls if parallel else calls[:1]


@dataclass
class _SentCall:
    id: str
    arguments: str = ""


@dataclass
class ToolCallStream:
    form: ToolFormat
    parallel: bool = True
    new_id: Callable[[], str] = new_call_id
    _text: str = ""
    _content: str = ""
    _calls: list[_SentCall] = field(default_factory=list)

    @property
    def made_calls(self) -> bool:
        return bool(self._calls)

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """The content and call deltas that `text` (the next piece of the answer) adds;
        `final` on the last piece, when whatever was held back is decided."""
        self._text += text
        parsed = self.form.parse(self._text, final)
        content = ""
        if parsed.content.startswith(self._content):
            content = parsed.content[len(self._content) :]
            self._content = parsed.content
        deltas = []
        for index, call in enumerate(_kept(list(parsed.calls), self.parallel)):
            if call.name is None:
                break
            if index == len(self._calls):
                self._calls.append(_SentCall(self.new_id()))
                sent = self._calls[index]
                deltas.append(CallDelta(index, sent.id, call.name, ""))
            sent = self._calls[index]
            if call.arguments.startswith(sent.arguments) and call.arguments != sent.arguments:
                deltas.append(CallDelta(index, None, None, call.arguments[len(sent.arguments) :]))
                sent.arguments = call.arguments
        return content, _merged(deltas)


def _merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """A call's announcement and its first arguments in one delta."""
    merged: list[CallDelta] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        if last is not None and last.index == delta.index and delta.id is None:
            merged[-1] = CallDelta(last.index, last.id, last.name, last.arguments + delta.arguments)
        else:
            merged.append(delta)
    return merged
