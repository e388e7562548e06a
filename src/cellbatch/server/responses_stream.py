"""The Responses API's typed event stream, written from an answer as it grows.

Owns: `ResponseEvents`, one per streamed response: the output items as they open
(a reasoning item, a message, function calls, in the order the answer gives them),
their events (`response.output_item.added`, `response.content_part.added`, the text,
reasoning and arguments deltas, then each part's and item's `.done`), the numbering
of the events, and the response object that the last event carries.
Promises: every item that opens is closed, with its whole text, before the response
ends; the deltas of an item concatenate to its text (or arguments); the items of the
last event are the items the deltas built, with the same ids; sequence numbers count
from 0 without gaps.
Never: reads tool calls or reasoning from text (`answers` does) or frames the events.
"""

from __future__ import annotations

from collections.abc import Iterator

from cellbatch.server.answers import AnswerDelta
from cellbatch.server.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    ItemEvent,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseEvent,
    ResponseObject,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)


class ResponseEvents:
    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._text = ""  # the open reasoning's or message's text so far
        self._sequence = 0

    def start(self) -> Iterator[StreamEvent]:
        yield self._numbered(ResponseEvent(type="response.created", response=self.response))
        yield self._numbered(ResponseEvent(type="response.in_progress", response=self.response))

    def feed(self, delta: AnswerDelta) -> Iterator[StreamEvent]:
        if delta.reasoning:
            if not isinstance(self._open, OutputReasoning):
                yield from self._close()
                yield from self._add(OutputReasoning(status="in_progress"))
            yield from self._text_delta("response.reasoning_text.delta", delta.reasoning)
        if delta.content:
            if not isinstance(self._open, OutputMessage):
                yield from self._close()
                yield from self._add(OutputMessage(status="in_progress"))
            yield from self._text_delta("response.output_text.delta", delta.content)
        for piece in delta.calls:
            if piece.id is not None:
                yield from self._close()
                call = OutputFunctionCall(
                    call_id=piece.id, name=piece.name or "", arguments="", status="in_progress"
                )
                yield from self._add(call)
            if piece.arguments and isinstance(self._open, OutputFunctionCall):
                self._open.arguments += piece.arguments
                yield self._numbered(
                    ArgumentsDeltaEvent(
                        item_id=self._open.id, output_index=self._index, delta=piece.arguments
                    )
                )

    def finish(self, response: ResponseObject) -> Iterator[StreamEvent]:
        """Closes what is open; the last event carries `response` with the items built."""
        status = "incomplete" if response.status == "incomplete" else "completed"
        yield from self._close(status)
        response.output = list(self.items)
        kind = {
            "completed": "response.completed",
            "incomplete": "response.incomplete",
            "failed": "response.failed",
        }[response.status]
        yield self._numbered(ResponseEvent(type=kind, response=response))  # type: ignore[arg-type]

    def error(self, message: str) -> StreamEvent:
        return self._numbered(ErrorEvent(code="server_error", message=message))

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _add(self, item: OutputItem) -> Iterator[StreamEvent]:
        self.items.append(item)
        self._open, self._text = item, ""
        yield self._numbered(
            ItemEvent(
                type="response.output_item.added",
                output_index=self._index,
                item=item.model_copy(deep=True),
            )
        )
        part = _part(item, "")
        if part is not None:
            yield self._numbered(
                ContentPartEvent(
                    type="response.content_part.added",
                    item_id=item.id,
                    output_index=self._index,
                    content_index=0,
                    part=part,
                )
            )

    def _text_delta(self, kind: str, text: str) -> Iterator[StreamEvent]:
        assert self._open is not None
        self._text += text
        yield self._numbered(
            TextDeltaEvent(
                type=kind,  # type: ignore[arg-type]
                item_id=self._open.id,
                output_index=self._index,
                content_index=0,
                delta=text,
            )
        )

    def _close(self, status: str = "completed") -> Iterator[StreamEvent]:
        item = self._open
        if item is None:
            return
        self._open = None
        item.status = status  # type: ignore[assignment]
        if isinstance(item, OutputFunctionCall):
            yield self._numbered(
                ArgumentsDoneEvent(
                    item_id=item.id,
                    output_index=self._index,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        else:
            kind = "reasoning_text" if isinstance(item, OutputReasoning) else "output_text"
            yield self._numbered(
                TextDoneEvent(
                    type=f"response.{kind}.done",  # type: ignore[arg-type]
                    item_id=item.id,
                    output_index=self._index,
                    content_index=0,
                    text=self._text,
                )
            )
            part: OutputText | ReasoningText
            if isinstance(item, OutputReasoning):
                part = ReasoningText(text=self._text)
                item.content = [part]
            else:
                part = OutputText(text=self._text)
                item.content = [part]
            yield self._numbered(
                ContentPartEvent(
                    type="response.content_part.done",
                    item_id=item.id,
                    output_index=self._index,
                    content_index=0,
                    part=part,
                )
            )
        yield self._numbered(
            ItemEvent(type="response.output_item.done", output_index=self._index, item=item)
        )

    def _numbered(self, event: StreamEvent) -> StreamEvent:
        event.sequence_number = self._sequence
        self._sequence += 1
        return event


def _part(item: OutputItem, text: str) -> OutputText | ReasoningText | None:
    if isinstance(item, OutputReasoning):
        return ReasoningText(text=text)
    if isinstance(item, OutputMessage):
        return OutputText(text=text)
    return None
