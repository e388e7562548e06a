"""Reading the prompts of `cellbatch run`: arguments, a prompt file, a file of prompt
lines or of token-id lines.

Owns: `PromptLine` and `read_prompts`.
Promises: a missing or unreadable file is a `UsageError`; an empty line is skipped
with a note; a bad token line is kept with its problem (it fails alone, naming its
`file:line`), so that the other lines still run. A line (of a prompts file, a token
file or an argument) that starts with `@NAME` and a space or tab, NAME one of the
adapters the run loads (`--lora-modules`), runs with that LoRA adapter and without
that prefix; other lines run with `--adapter` (or the base model). A line whose `@word`
names no loaded adapter is a prompt like any other.
Never: tokenizes (the run does, with the model's tokenizer).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from cellbatch.cli.options import UsageError, note
from cellbatch.types import Token


@dataclass
class PromptLine:
    """One prompt as read from the input, with where it came from."""

    source: str  # e.g. "prompts.txt:3"
    raw: str  # the prompt as the user wrote it
    text: str | None  # None for token prompts
    tokens: list[Token] | None  # None for text prompts
    chat: bool
    problem: str = ""
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)
    prompt_file: bool = False  # the whole of a --prompt-file, used verbatim


def read_prompts(args: argparse.Namespace, adapters: Collection[str] = ()) -> list[PromptLine]:
    """Every prompt of the invocation, each with its adapter (a line's `@NAME` prefix for
    one of `adapters`, else --adapter); unreadable files raise UsageError."""
    prompts = _read_lines(args)
    default = getattr(args, "adapter", None)
    for prompt in prompts:
        prompt.adapter = default
        prefixed = None if prompt.prompt_file else _PREFIX.match(prompt.raw)
        if prefixed is not None and prefixed["name"] in adapters and prefixed["rest"].strip():
            _set_line(prompt, prefixed["rest"], prefixed["name"])
    return prompts


# A line's adapter prefix: @NAME, then a space or a tab, then the prompt.
_PREFIX = re.compile(r"@(?P<name>\S+)[ \t](?P<rest>.*)", re.DOTALL)


def _set_line(prompt: PromptLine, rest: str, adapter: str) -> None:
    """The line without its `@NAME ` prefix, run with adapter NAME."""
    prompt.adapter = adapter
    if prompt.tokens is not None:
        reread = _token_lines([rest], prompt.source)[0]
        prompt.tokens, prompt.problem = reread.tokens, reread.problem
    else:
        prompt.text = rest.replace("\\n", "\n")


def _read_lines(args: argparse.Namespace) -> list[PromptLine]:
    if args.prompt_file is not None:
        text = _read(args.prompt_file)
        return [PromptLine(str(args.prompt_file), text, text, None, chat=False, prompt_file=True)]
    if args.prompts_file is not None:
        lines = _read(args.prompts_file).splitlines()
        return _text_lines(lines, str(args.prompts_file), chat=not args.raw)
    if args.prompt_tokens_file is not None:
        lines = _read(args.prompt_tokens_file).splitlines()
        return _token_lines(lines, str(args.prompt_tokens_file))
    if args.prompts:
        return _text_lines(args.prompts, "argument", chat=not args.raw)
    raise UsageError(
        "no prompts: give PROMPT arguments or one of --prompt-file, --prompts-file, "
        "--prompt-tokens-file"
    )


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise UsageError(f"prompt file {path} does not exist") from error
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read prompt file {path}: {error}") from error


def _text_lines(lines: Sequence[str], origin: str, chat: bool) -> list[PromptLine]:
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            note(f"{origin}:{number}: empty line skipped")
            continue
        text = line.replace("\\n", "\n")
        prompts.append(PromptLine(f"{origin}:{number}", line, text, None, chat))
    return prompts


def _token_lines(lines: Sequence[str], origin: str) -> list[PromptLine]:
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            note(f"{origin}:{number}: empty line skipped")
            continue
        prompt = PromptLine(f"{origin}:{number}", line, None, [], chat=False)
        try:
            prompt.tokens = [int(word) for word in line.split()]
        except ValueError:
            bad = next(word for word in line.split() if not _is_int(word))
            prompt.problem = f"{bad!r} is not a token id (ids are whitespace-separated integers)"
        prompts.append(prompt)
    return prompts


def _is_int(word: str) -> bool:
    try:
        int(word)
    except ValueError:
        return False
    return True
