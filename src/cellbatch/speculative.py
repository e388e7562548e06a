"""How an engine speculates: drafts tokens and verifies them in one forward
(docs/design.md#speculative-decoding).

Owns: `SpeculativeConfig`, the typed, frozen form of vLLM's `--speculative-config`
(`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}` or `{"method": "draft_model", "model": PATH,
"num_speculative_tokens": 4}`), and `parse_speculative_config`, which reads it from a
JSON object or its text.
Promises: a config exists only checked: a method it knows, a positive draft length, a
lookup window within 1 <= min <= max, a model path for a draft model and none for
n-gram; anything else is refused when it is built, with an InvalidArgumentError that
names the key and the fix. Unknown keys are refused, never ignored.
Never: loads a model or touches an engine; the Engine builds the drafter a config
names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from cellbatch.generation_config import coerce_int
from cellbatch.types import InvalidArgumentError

METHODS = ("ngram", "draft_model")
# An n-gram draft's lookup window when the config names neither end of it.
DEFAULT_LOOKUP_MAX = 4
DEFAULT_LOOKUP_MIN = 2
# More drafts a step than any acceptance makes worth verifying; also keeps a verified
# run well inside a step's token budget.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: `method` "ngram" (prompt lookup: a draft is what followed
    the latest earlier occurrence of the context's last n tokens, n from
    `prompt_lookup_max` down to `prompt_lookup_min`) or "draft_model" (a smaller model
    with the same tokenizer at `model`, run greedily); up to `num_speculative_tokens`
    drafted tokens verified a step. `disable_by_batch_size`: no drafts in a step with at
    least that many decoding sessions (None: the engine's own cost model decides).
    Speculation never changes a token: see docs/design.md#speculative-decoding."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidArgumentError(
                f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        tokens = coerce_int("num_speculative_tokens", self.num_speculative_tokens)
        if not 1 <= tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidArgumentError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {tokens}"
            )
        object.__setattr__(self, "num_speculative_tokens", tokens)
        if self.disable_by_batch_size is not None:
            limit = coerce_int("disable_by_batch_size", self.disable_by_batch_size)
            if limit < 1:
                raise InvalidArgumentError(
                    f"disable_by_batch_size must be >= 1 (or left out), got {limit}"
                )
            object.__setattr__(self, "disable_by_batch_size", limit)
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft_model()

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise InvalidArgumentError(
                "an ngram config takes no model (it drafts from the context); drop model, "
                'or use "method": "draft_model"'
            )
        high, low = self.prompt_lookup_max, self.prompt_lookup_min
        high = None if high is None else coerce_int("prompt_lookup_max", high)
        low = None if low is None else coerce_int("prompt_lookup_min", low)
        if high is None:
            high = max(DEFAULT_LOOKUP_MAX, low or 0)
        if low is None:
            low = min(DEFAULT_LOOKUP_MIN, high)
        if not 1 <= low <= high:
            raise InvalidArgumentError(
                f"prompt_lookup_min ({low}) and prompt_lookup_max ({high}) must satisfy "
                "1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        object.__setattr__(self, "prompt_lookup_max", high)
        object.__setattr__(self, "prompt_lookup_min", low)

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise InvalidArgumentError(
                'a draft_model config needs "model": the path of a smaller model with the '
                "same tokenizer (a Hugging Face folder or a GGUF file)"
            )
        object.__setattr__(self, "model", str(self.model))
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                raise InvalidArgumentError(f"{name} is for the ngram method; drop it")

    @property
    def lookup(self) -> tuple[int, int]:
        """(prompt_lookup_min, prompt_lookup_max) of an ngram config."""
        assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
        return self.prompt_lookup_min, self.prompt_lookup_max


_KEYS = tuple(field.name for field in fields(SpeculativeConfig))


def parse_speculative_config(
    value: str | Mapping[str, object] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """A config from its JSON text or object (vLLM's `--speculative-config` spelling;
    "method" may be left out when "model" names a draft model); None stays None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise InvalidArgumentError(
                f"the speculative config is not JSON ({error.msg} at character {error.pos}); "
                """give an object such as '{"method": "ngram", "num_speculative_tokens": 4}'"""
            ) from None
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(
            f"the speculative config must be a JSON object, got {type(value).__name__}"
        )
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise InvalidArgumentError(
            f"the speculative config has unknown keys {unknown}; cellbatch takes {', '.join(_KEYS)}"
        )
    options = dict(value)
    if "method" not in options:
        if options.get("model") is None:
            raise InvalidArgumentError(
                'the speculative config needs "method": "ngram" or "draft_model" (with "model")'
            )
        options["method"] = "draft_model"
    return SpeculativeConfig(**options)  # type: ignore[arg-type]
