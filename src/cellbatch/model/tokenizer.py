"""The tokenizer and chat template of a model, read from the model's own files.

Owns: `Tokenizer`, a thin wrapper over a transformers tokenizer loaded from a Hugging Face
folder or from a GGUF file (`load_tokenizer`), or from the files a program stores
(`tokenizer_from_files`), and the model's stop tokens.
Promises: `apply_chat_template` returns exactly the token ids transformers produces for
the same messages (generation prompt added; tools passed to the template as given);
`takes_tools` says whether the template renders tools at all; `stop_tokens` holds the EOS ids of the
config and generation config plus the end-of-turn tokens present in the vocabulary.
A tokenizer is built once per file per process (the GGUF one takes seconds: the whole
vocabulary is parsed from the GGUF metadata) and shared afterwards.
Never: writes a cache on disk or reaches the network.
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cellbatch.model.loading import ModelFiles, locate_model
from cellbatch.types import Token

# Tokens that end a turn or a document in the chat formats of the supported families.
END_OF_TURN_TOKENS: tuple[str, ...] = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eot|>",
    "<|end_of_text|>",
    "<|endoftext|>",
)
_TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    """Text <-> token ids, chat template and stop tokens for one model."""

    def __init__(self, backend: Any, extra_eos_ids: Iterable[int] = ()) -> None:
        self.backend = backend
        vocab = backend.get_vocab()
        stop = {int(t) for t in extra_eos_ids}
        if backend.eos_token_id is not None:
            stop.add(int(backend.eos_token_id))
        stop.update(vocab[name] for name in END_OF_TURN_TOKENS if name in vocab)
        self.stop_tokens: frozenset[Token] = frozenset(stop)
        self.vocab_size: int = len(backend)
        self.bos_token_id: int | None = backend.bos_token_id
        self.eos_token_id: int | None = backend.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.backend, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[Token]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, tokens: Sequence[Token], skip_special_tokens: bool = True) -> str:
        text: str = self.backend.decode(list(tokens), skip_special_tokens=skip_special_tokens)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[Token]:
        """The prompt ids for a conversation, ending with the assistant's turn opening
        (unless `add_generation_prompt` is False); `tools` (OpenAI's function specs) go
        to a template that has a place for them (`takes_tools`); `template_kwargs` are
        more variables for the template (e.g. `enable_thinking`)."""
        if not self.has_chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template; pass plain prompts "
                "(encode) instead of conversations"
            )
        ids = self.backend.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(tool) for tool in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **dict(template_kwargs or {}),
        )
        return [int(t) for t in ids]

    @functools.cached_property
    def takes_tools(self) -> bool:
        """Whether the chat template renders tools it is given (ChatML's ignores them):
        a conversation is rendered with a tool and without, and compared."""
        if not self.has_chat_template:
            return False
        probe = [{"role": "user", "content": "Hello"}]
        tool = {
            "type": "function",
            "function": {"name": "probe_tool", "parameters": {"type": "object"}},
        }
        try:
            return self.apply_chat_template(probe, tools=[tool]) != self.apply_chat_template(probe)
        except Exception:  # a template that fails on tools has no place for them
            return False

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token spelled `text`, if the vocabulary has one."""
        token = self.backend.get_added_vocab().get(text)
        if token is None or token not in set(self.backend.all_special_ids):
            return None
        return int(token)

    @property
    def chat_template_text(self) -> str:
        template = getattr(self.backend, "chat_template", None)
        return template if isinstance(template, str) else ""


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the model at `path` (a Hugging Face folder or a GGUF file)."""
    files = locate_model(path)
    return _load_cached(files, files.path.stat().st_mtime_ns)


def tokenizer_from_files(files: Mapping[str, str], stop_tokens: Iterable[int]) -> Tokenizer:
    """The tokenizer saved as `files` (file name -> text: tokenizer.json, its config and
    chat template, as a program file stores them), stopping at `stop_tokens` too."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        for name, text in files.items():
            (Path(folder) / name).write_text(text, encoding="utf-8")
        backend = AutoTokenizer.from_pretrained(folder)
    return Tokenizer(backend, extra_eos_ids=stop_tokens)


@functools.lru_cache(maxsize=8)
def _load_cached(files: ModelFiles, mtime_ns: int) -> Tokenizer:
    # mtime_ns is part of the key so that a rewritten file is read again.
    from transformers import AutoTokenizer

    if files.kind == "gguf":
        try:
            backend = AutoTokenizer.from_pretrained(str(files.folder), gguf_file=files.path.name)
        except (KeyError, OSError, ValueError) as error:
            # transformers reads a file without tokenizer.ggml.* metadata as a KeyError.
            raise FileNotFoundError(
                f"no usable tokenizer in {files.path}: its metadata holds no "
                f"tokenizer.ggml.tokens ({error!r})"
            ) from error
        return Tokenizer(backend)
    # transformers 5 builds an empty tokenizer from a folder without one: check first.
    missing = f"no usable tokenizer in {files.path}: it needs one of {', '.join(_TOKENIZER_FILES)}"
    if not any((files.path / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(missing)
    try:
        backend = AutoTokenizer.from_pretrained(str(files.path))
    except (OSError, ValueError) as error:
        raise FileNotFoundError(f"{missing} ({error})") from error
    return Tokenizer(backend, extra_eos_ids=_generation_eos_ids(files.path))


def _generation_eos_ids(folder: Path) -> list[int]:
    """EOS ids from config.json and generation_config.json (an int or a list in either)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        file = folder / name
        if file.is_file():
            with open(file, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
            ids += [eos] if isinstance(eos, int) else list(eos or [])
    return ids
