"""Reasoning output: the `<think>…</think>` part of an answer, told apart from the rest.

Owns: `ReasoningFormat` and its two parsers, named as vLLM's `--reasoning-parser` names
them: `qwen3` (the answer thinks when it opens `<think>`, or when the prompt left one
open: Qwen3's template closes an empty one when thinking is off) and `deepseek_r1`
(the answer starts inside its reasoning, which `</think>` ends: DeepSeek-R1's templates
open it); `reasoning_for_template`, which turns the parser on for a chat template that
knows the markup and leaves it off for the others; `ReasoningStream`, which sends the
reasoning and the content an answer adds as it grows.
Promises: `split(text, opened, final)` on a text that grows never takes back reasoning
or content it gave (a stream sends the difference): an end of the text that could still
become a tag is held back until it is decided; the tags reach neither part; the content
after `</think>` starts at its first non-blank character; an answer that never closes
its reasoning is all reasoning; one that never opens any is all content, as written.
Never: tokenizes or generates; tool calls (read from the content afterwards) are not
its business.
"""

from __future__ import annotations

from dataclasses import dataclass

from cellbatch.types import InvalidArgumentError

BLANK = " \t\r\n"


@dataclass(frozen=True)
class Split:
    """An answer as far as it goes: its reasoning (None when it has none) and content."""

    reasoning: str | None
    content: str


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # The answer starts inside its reasoning whatever the prompt says (DeepSeek-R1).
    always_open: bool = False

    def opened_by(self, prompt_text: str) -> bool:
        """Whether an answer to this prompt starts inside its reasoning: always for
        `deepseek_r1`; for `qwen3`, when the prompt ends with a `<think>` still open."""
        return self.always_open or prompt_text.rfind(self.start) > prompt_text.rfind(self.end)

    def split(self, text: str, opened: bool, final: bool) -> Split:
        """`text` (an answer, `opened` when its prompt opened the reasoning) split into
        reasoning and content; with `final` false the end that may still become a tag
        is held back."""
        at = 0
        if not opened:
            at = _skip_blank(text, 0)
            if text.startswith(self.start, at):
                at += len(self.start)
            elif not final and self.start.startswith(text[at:]):
                return Split(None, "")  # blank, or what may become `<think>`: undecided
            else:
                return Split(None, text)
        close = text.find(self.end, at)
        if close < 0:
            reasoning = text[at:] if final else _held(text[at:], self.end)
            return Split(reasoning, "")
        after = text[close + len(self.end) :]
        return Split(text[at:close], after[_skip_blank(after, 0) :])


def _skip_blank(text: str, at: int) -> int:
    while at < len(text) and text[at] in BLANK:
        at += 1
    return at


def _held(text: str, marker: str) -> str:
    """`text` without its end where that end could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_open=True),
}


def reasoning_named(name: str) -> ReasoningFormat:
    if name not in REASONING_PARSERS:
        raise InvalidArgumentError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}"
        )
    return REASONING_PARSERS[name]


def reasoning_for_template(template: str | None) -> ReasoningFormat | None:
    """The parser for a chat template that writes `</think>` (Qwen3's, DeepSeek-R1's and
    their kind: whether an answer starts inside its reasoning is read from each prompt);
    None for a template that never mentions it: its model does not think."""
    return REASONING_PARSERS["qwen3"] if "</think>" in (template or "") else None


@dataclass
class ReasoningStream:
    """One streamed answer: what reasoning and content were sent so far."""

    form: ReasoningFormat
    opened: bool
    _text: str = ""
    _reasoning: str = ""
    _content: str = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning and the content that `text` (the next piece of the answer)
        adds; `final` on the last piece, when what was held back is decided."""
        self._text += text
        split = self.form.split(self._text, self.opened, final)
        reasoning = (split.reasoning or "")[len(self._reasoning) :]
        content = split.content[len(self._content) :]
        self._reasoning += reasoning
        self._content += content
        return reasoning, content
