"""A chat-shaped answer split into its reasoning, its content and its tool calls.

Owns: `AnswerReading` (how a plan's answers are read: the reasoning format and whether
the prompt opened it, the tool call format), `whole_answer` for a finished answer and
`AnswerStream` for one that streams; every API that answers conversations (chat, the
Responses API, the Messages API) reads its answers here.
Promises: the reasoning is split off first and the tool calls are read from the rest,
so the markup of neither reaches the content; a stream's pieces concatenate to the
whole answer's parts (reasoning, content) and its call deltas to its calls.
Never: shapes any API's answer (the API modules do), or runs anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cellbatch.reasoning import ReasoningFormat, ReasoningStream
from cellbatch.tool_calls.calls import ToolCall
from cellbatch.tool_calls.formats import ToolFormat
from cellbatch.tool_calls.stream import CallDelta, ToolCallStream, split_answer


@dataclass(frozen=True)
class AnswerReading:
    reasoning: ReasoningFormat | None = None  # None: the answer has no reasoning part
    reasoning_opened: bool = False  # the prompt opened the reasoning
    tool_format: ToolFormat | None = None  # None: no tools offered, no calls read
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class Answer:
    reasoning: str | None  # None: the answer did not reason
    content: str | None  # None: calls and nothing else
    calls: tuple[ToolCall, ...] = ()


def whole_answer(reading: AnswerReading, text: str) -> Answer:
    reasoning = None
    if reading.reasoning is not None:
        split = reading.reasoning.split(text, reading.reasoning_opened, final=True)
        reasoning, text = split.reasoning or None, split.content
    if reading.tool_format is None:
        return Answer(reasoning, text)
    content, calls = split_answer(reading.tool_format, text, reading.parallel_tool_calls)
    return Answer(reasoning, content, calls)


@dataclass(frozen=True)
class AnswerDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class AnswerStream:
    """One streamed answer, read as it grows."""

    def __init__(self, reading: AnswerReading) -> None:
        self.reasoning = (
            ReasoningStream(reading.reasoning, reading.reasoning_opened)
            if reading.reasoning is not None
            else None
        )
        self.tools = (
            ToolCallStream(reading.tool_format, reading.parallel_tool_calls)
            if reading.tool_format is not None
            else None
        )

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.made_calls

    def feed(self, text: str, final: bool) -> AnswerDelta:
        """What `text` (the next piece of the answer) adds; `final` on the last piece."""
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, final)
        if self.tools is None:
            return AnswerDelta(reasoning, text)
        content, calls = self.tools.feed(text, final)
        return AnswerDelta(reasoning, content, calls)
