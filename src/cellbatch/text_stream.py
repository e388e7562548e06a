"""Text of a generation as it grows: incremental detokenizing and stop strings.

Owns: `TextStream`, one per generation, turning the generation's tokens into text
deltas one token at a time and watching them for stop strings.
Promises: a delta never splits a multi-byte character and never holds any part of
a stop string (text that could be the start of one is held back until it can't
be); the deltas concatenate to the final text, which ends just before the first
stop string; each token is decoded a bounded number of times (a window of the
last few tokens, not the whole generation), so the cost is per token, not per
generation (`decoded_tokens` counts the work).
Never: calls back, holds engine state, or touches tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cellbatch.types import InvalidArgumentError, Token

# A decode that ends in this character stopped inside a multi-byte character (or a
# byte-fallback token sequence): wait for the next token before releasing it.
_INCOMPLETE = "\ufffd"


class Detokenizer(Protocol):
    """What a TextStream needs of a tokenizer."""

    def decode(self, tokens: Sequence[Token]) -> str: ...


@dataclass(frozen=True)
class TextStep:
    """What one token added: the text that may be shown, and whether the text now
    holds a stop string (then `text` ends just before it, and the stream is done)."""

    text: str
    stopped: bool = False


def check_stop_strings(stop_strings: Sequence[str]) -> tuple[str, ...]:
    """The stop strings as a tuple, refusing what cannot work."""
    if isinstance(stop_strings, str):
        raise InvalidArgumentError(
            f"stop_strings must be a sequence of strings, got the string {stop_strings!r}; "
            "wrap it in a tuple"
        )
    strings = tuple(stop_strings)
    for string in strings:
        if not isinstance(string, str) or not string:
            raise InvalidArgumentError(
                f"every stop string must be a non-empty string, got {string!r}"
            )
    return strings


class TextStream:
    """One generation's text, fed token by token.

    Detokenizing keeps two offsets into the token list, as Hugging Face's streamers
    do: text is decoded from `_prefix_start` (a few tokens back, so that tokenizers
    that drop a leading space see the context they need) and the part already
    released is cut off by length.
    """

    def __init__(
        self,
        tokenizer: Detokenizer,
        stop_strings: Sequence[str] = (),
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._include_stop = include_stop  # the text ends with the stop string, not before
        self._stop_strings = check_stop_strings(stop_strings)
        self._longest_stop = max((len(s) for s in self._stop_strings), default=0)
        self._tokens: list[Token] = []
        self._prefix_start = 0  # decode from here...
        self._read_start = 0  # ...and release what tokens from here add
        self._held = ""  # decoded text not released yet: it may start a stop string
        self._stopped = False
        self.decoded_tokens = 0  # tokens passed to the tokenizer so far: the work done

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, token: Token) -> TextStep:
        """Add one generated token; returns the text it releases."""
        if self._stopped:
            return TextStep("", stopped=True)
        self._tokens.append(token)
        return self._release(self._decode_new(final=False))

    def finish(self) -> str:
        """The text still held back once the generation ends without a stop string
        (an incomplete character is decoded as it stands)."""
        if self._stopped:
            return ""
        tail = self._held + self._decode_new(final=True)
        self._held = ""
        return tail

    def _decode_new(self, final: bool) -> str:
        window = self._tokens[self._prefix_start :]
        if not window:
            return ""
        released_part = self._tokenizer.decode(self._tokens[self._prefix_start : self._read_start])
        whole = self._tokenizer.decode(window)
        self.decoded_tokens += len(window) + (self._read_start - self._prefix_start)
        if whole.endswith(_INCOMPLETE) and not final:
            return ""
        if len(whole) <= len(released_part):
            # Nothing new (a special token, say): move on, or the window would grow.
            self._prefix_start, self._read_start = self._read_start, len(self._tokens)
            return ""
        self._prefix_start, self._read_start = self._read_start, len(self._tokens)
        return whole[len(released_part) :]

    def _release(self, new_text: str) -> TextStep:
        if not self._stop_strings:
            return TextStep(new_text)
        # A stop string cannot start in released text (its start would have been held),
        # so searching the held text and the new text is enough.
        candidate = self._held + new_text
        found = min(
            ((index, len(s)) for s in self._stop_strings if (index := candidate.find(s)) >= 0),
            default=None,
        )
        if found is not None:
            cut, length = found
            self._held = ""
            self._stopped = True
            end = cut + length if self._include_stop else cut
            return TextStep(candidate[:end], stopped=True)
        keep = self._start_of_stop(candidate)
        self._held = candidate[len(candidate) - keep :] if keep else ""
        return TextStep(candidate[: len(candidate) - keep])

    def _start_of_stop(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        for length in range(min(len(text), self._longest_stop - 1), 0, -1):
            end = text[-length:]
            if any(s.startswith(end) for s in self._stop_strings):
                return length
        return 0
