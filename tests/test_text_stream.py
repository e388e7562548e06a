"""TextStream: incremental text that never splits a character or shows a stop string.

A byte-level fake tokenizer (each token is a few bytes, decoded as UTF-8 with
replacement) makes multi-byte characters split across tokens, as real byte-level
BPE tokenizers do.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from cellbatch.text_stream import TextStream
from cellbatch.types import InvalidArgumentError


class ByteTokenizer:
    """Token i is the bytes `pieces[i]`; counts the tokens it decodes."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = list(pieces)
        self.decoded = 0

    def decode(self, tokens: Sequence[int]) -> str:
        self.decoded += len(tokens)
        return b"".join(self.pieces[t] for t in tokens).decode("utf-8", errors="replace")


def tokens_for(text: str, split: int = 1) -> tuple[ByteTokenizer, list[int]]:
    """`text` as tokens of `split` bytes each (so characters split across tokens)."""
    data = text.encode()
    pieces = [data[i : i + split] for i in range(0, len(data), split)]
    return ByteTokenizer(pieces), list(range(len(pieces)))


def stream(text: str, stops: Sequence[str], split: int = 1) -> tuple[list[str], bool, int]:
    """(deltas, stopped, index of the token that stopped it or -1)."""
    tokenizer, tokens = tokens_for(text, split)
    texts = TextStream(tokenizer, stops)
    deltas: list[str] = []
    for index, token in enumerate(tokens):
        step = texts.push(token)
        deltas.append(step.text)
        if step.stopped:
            return deltas, True, index
    deltas.append(texts.finish())
    return deltas, False, -1


@pytest.mark.parametrize("split", [1, 2, 3, 5])
def test_deltas_concatenate_to_the_text_and_never_split_a_character(split: int) -> None:
    text = "héllo wörld — ☃ 日本語 🎉!"
    deltas, stopped, _ = stream(text, (), split)
    assert not stopped
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("Hello world. Bye", ["world"], "Hello "),  # split across tokens (1 byte each)
        ("STOP here", ["STOP"], ""),  # at the very first tokens
        ("abc ☃☃ def", ["☃☃"], "abc "),  # inside multi-byte characters
        ("one two three", ["three", "two"], "one "),  # several: the earliest wins
        ("xxabcd", ["bcd", "abc"], "xx"),  # overlapping: the earliest start wins
        ("aaab", ["aab"], "a"),  # a false start then a real one
        ("no stop at all", ["zzz"], "no stop at all"),
        ("ends with a partial sto", ["stop"], "ends with a partial sto"),
    ],
)
@pytest.mark.parametrize("split", [1, 2, 4])
def test_stop_strings_end_the_text_just_before_them(
    text: str, stops: list[str], expected: str, split: int
) -> None:
    deltas, stopped, index = stream(text, stops, split)
    assert "".join(deltas) == expected
    assert stopped == (expected != text)
    if stopped:
        # The stop comes with the token that completed the stop string, not later.
        end_of_stop = min(
            text.index(s) + len(s) for s in stops if s in text and text.index(s) == len(expected)
        )
        assert index == (len(text[:end_of_stop].encode()) + split - 1) // split - 1
    # No delta ever shows text that the final text does not hold.
    shown = ""
    for delta in deltas:
        shown += delta
        assert expected.startswith(shown)


def test_each_token_is_decoded_a_bounded_number_of_times() -> None:
    text = "word " * 3000
    tokenizer, tokens = tokens_for(text, split=5)
    texts = TextStream(tokenizer, ["never appears"])
    out = "".join(texts.push(token).text for token in tokens) + texts.finish()
    assert out == text
    # Two decodes per token of a window of at most a few tokens: linear, not quadratic.
    assert tokenizer.decoded <= 4 * len(tokens)


def test_special_tokens_that_decode_to_nothing_do_not_grow_the_window() -> None:
    tokenizer = ByteTokenizer([b"", b"a"])
    texts = TextStream(tokenizer)
    for _ in range(2000):
        texts.push(0)
    assert texts.push(1).text == "a"
    assert tokenizer.decoded < 10_000


@pytest.mark.parametrize("bad", ["stop", [""], [3]])
def test_bad_stop_strings_are_refused(bad: object) -> None:
    with pytest.raises(InvalidArgumentError):
        TextStream(ByteTokenizer([]), bad)  # type: ignore[arg-type]
