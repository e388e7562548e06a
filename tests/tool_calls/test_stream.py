"""A streamed answer's content and call deltas add up to the whole answer's split."""

from __future__ import annotations

import itertools
import json

from cellbatch.tool_calls.formats import FORMATS, HermesFormat
from cellbatch.tool_calls.stream import ToolCallStream, split_answer

ANSWER = (
    "Checking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def ids() -> itertools.count[int]:
    return itertools.count()


def streamed(text: str, piece: int, parallel: bool = True) -> tuple[str, list[dict[str, str]]]:
    counter = ids()
    stream = ToolCallStream(HermesFormat(), parallel, new_id=lambda: f"id{next(counter)}")
    content, calls = "", []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for number, part in enumerate(pieces):
        delta, call_deltas = stream.feed(part, final=number == len(pieces) - 1)
        content += delta
        for call in call_deltas:
            if call.id is not None:
                assert call.index == len(calls)
                calls.append({"id": call.id, "name": call.name, "arguments": ""})
            else:
                assert call.name is None
            calls[call.index]["arguments"] += call.arguments
    return content, calls


def test_streamed_deltas_add_up_to_the_whole_split() -> None:
    counter = ids()
    content, whole = split_answer(HermesFormat(), ANSWER, True, lambda: f"id{next(counter)}")
    assert content == "Checking."
    expected = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in whole]
    for piece in (1, 2, 3, 7, 50, len(ANSWER)):
        text, calls = streamed(ANSWER, piece)
        assert text.strip() == content
        assert calls == expected, piece
        assert "<tool_call>" not in text
    assert json.loads(expected[0]["arguments"]) == {"city": "Paris", "days": [1, 2]}


def test_arguments_grow_over_several_deltas() -> None:
    stream = ToolCallStream(HermesFormat())
    pieces = 0
    for char in ANSWER:
        _, deltas = stream.feed(char, final=False)
        pieces += sum(1 for delta in deltas if delta.index == 0 and delta.arguments)
    assert pieces > 5 and stream.made_calls


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    _, calls = split_answer(HermesFormat(), ANSWER, parallel=False)
    assert [call.name for call in calls] == ["get_weather"]
    _, streamed_calls = streamed(ANSWER, 4, parallel=False)
    assert [call["name"] for call in streamed_calls] == ["get_weather"]


def test_an_answer_without_calls_is_content_as_written() -> None:
    for form in FORMATS.values():
        assert split_answer(form, "  Sunny, 21 degrees.\n", True) == ("  Sunny, 21 degrees.\n", ())
    text, calls = streamed("A <b>bold</b> claim <tool", 3)
    assert text == "A <b>bold</b> claim <tool" and calls == []


def test_a_call_cut_short_is_the_same_streamed_or_whole() -> None:
    cut = ANSWER[: ANSWER.index('"days"')]
    content, calls = split_answer(HermesFormat(), cut, True, lambda: "id0")
    assert content == "Checking." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris", ')
    ]
    text, streamed_calls = streamed(cut, 5)
    assert text.strip() == content
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == [
        ("get_weather", '{"city": "Paris", ')
    ]
