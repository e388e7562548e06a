"""The reasoning parsers: what is reasoning and what is content, whole and as it grows."""

from __future__ import annotations

import pytest

from cellbatch.reasoning import (
    REASONING_PARSERS,
    ReasoningStream,
    Split,
    reasoning_for_template,
    reasoning_named,
)
from cellbatch.types import InvalidArgumentError

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek_r1"]


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<think>plan</think>\n\nAnswer", False, Split("plan", "Answer")),
        ("Answer with no thinking", False, Split(None, "Answer with no thinking")),
        ("plan</think>Answer", True, Split("plan", "Answer")),
        ("plan cut short", True, Split("plan cut short", "")),  # never closed: all reasoning
        ("<think>plan cut short", False, Split("plan cut short", "")),
        ("Say <think> later", False, Split(None, "Say <think> later")),
    ],
)
def test_a_whole_answer_splits(text: str, opened: bool, expected: Split) -> None:
    assert QWEN3.split(text, opened, final=True) == expected


def test_the_prompt_says_whether_the_answer_starts_inside() -> None:
    assert QWEN3.opened_by("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not QWEN3.opened_by("<|im_start|>assistant\n")
    assert R1.opened_by("<|im_start|>assistant\n")  # DeepSeek-R1 always starts inside


@pytest.mark.parametrize(
    ("text", "opened"),
    [
        ("<think>I weigh </thin and </think>\n\nthe answer <think>stays", False),
        ("plan</think>  Answer", True),
        ("No thinking at all, <think", False),
        ("<thi", False),
        ("  \n<think>x</think>y", False),
    ],
)
def test_any_piece_size_streams_the_whole_answer(text: str, opened: bool) -> None:
    whole = QWEN3.split(text, opened, final=True)
    for size in range(1, len(text) + 1):
        stream = ReasoningStream(QWEN3, opened)
        reasoning = content = ""
        pieces = [text[at : at + size] for at in range(0, len(text), size)]
        for index, piece in enumerate(pieces):
            more_reasoning, more_content = stream.feed(piece, index == len(pieces) - 1)
            reasoning += more_reasoning
            content += more_content
        assert (reasoning or None, content) == (whole.reasoning or None, whole.content), size


def test_a_growing_answer_never_takes_back_what_it_gave() -> None:
    text = "<think>a </think b</think>\n\nc </think> d"
    before = Split(None, "")
    for end in range(len(text) + 1):
        now = QWEN3.split(text[:end], False, final=False)
        assert (now.reasoning or "").startswith(before.reasoning or "")
        assert now.content.startswith(before.content)
        before = now


def test_templates_that_think_turn_the_parser_on() -> None:
    assert reasoning_for_template("{{ '<think>' }}...{{ '</think>' }}") is QWEN3
    assert reasoning_for_template("<|im_start|>{{ message.content }}<|im_end|>") is None
    assert reasoning_for_template(None) is None
    assert reasoning_named("deepseek_r1") is R1
    with pytest.raises(InvalidArgumentError, match="qwen3"):
        reasoning_named("o1")
