"""What a caller asks of one generation: how it picks its tokens (`SamplingParams`, with
its `Constraint`) and when it stops, under which adapter and priority (`GenConfig`).

Owns: those settings and the coercion of their fields.
Promises: a built config holds each field as its declared type (a list becomes a tuple,
an int a float) or was refused when it was built, naming the field and what it takes;
no torch, no I/O.
Never: holds engine state; these objects are values.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cellbatch.types import DEFAULT_PRIORITY, InvalidArgumentError, Token

# -- config fields: a value of another fitting type (a list for a tuple, a tuple or set
# for a frozenset, an int for a float) becomes the declared type when a config is built;
# anything else is refused there, naming the field.


def _set(config: object, name: str, value: object) -> None:
    object.__setattr__(config, name, value)  # a frozen dataclass's own __post_init__


def coerce_int(name: str, value: object) -> int:
    """An integer; bools, floats and strings are refused (`True` tokens is a mistake)."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None


def coerce_float(name: str, value: object) -> float:
    """A real number; ints are accepted, bools and strings refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def _items(name: str, value: object, what: str) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(
            f"{name} must be a collection of {what} (a tuple, list or set), "
            f"got {type(value).__name__} {value!r}"
        )
    return list(value)


def coerce_tokens(name: str, value: object) -> tuple[Token, ...]:
    """Token ids in order, from any collection of integers >= 0."""
    items = _items(name, value, "token ids")
    tokens = tuple(coerce_int(f"{name}[{i}]", item) for i, item in enumerate(items))
    if any(token < 0 for token in tokens):
        raise InvalidArgumentError(f"{name} must hold token ids >= 0, got {list(tokens)}")
    return tokens


def coerce_token_set(name: str, value: object) -> frozenset[Token]:
    """A frozenset of token ids, from any collection of integers >= 0."""
    return frozenset(coerce_tokens(name, value))


def coerce_strings(name: str, value: object) -> tuple[str, ...]:
    """A tuple of strings; one string alone is a tuple of one (as OpenAI's `stop`)."""
    if isinstance(value, str):
        return (value,)
    items = _items(name, value, "strings")
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidArgumentError(
                f"{name}[{index}] must be a string, got {type(item).__name__} {item!r}"
            )
    return tuple(items)


MAX_LOGPROBS = 20
# How a prompt's last hidden states become one vector (`SamplingParams.pooling`): the last
# token's, or the mean over the prompt's tokens.
POOLING_CHOICES = ("last", "mean")

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What a generation's text must be: `kind` "json_schema" (`spec`: the schema as JSON
    text), "json_object" (any JSON object; `spec` unused), "regex" (`spec`: a regular
    expression the whole text matches), "choice" (`choices`: the text is one of them) or
    "grammar" (`spec`: a Lark grammar, or GBNF when `gbnf`). Build one with the class
    methods; `cellbatch.constraint` compiles it for a tokenizer."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    gbnf: bool = False

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidArgumentError(
                f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}"
            )
        if self.kind == "choice" and not self.choices:
            raise InvalidArgumentError("a choice constraint needs at least one choice")
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            raise InvalidArgumentError(f"a {self.kind} constraint needs its {self.kind} text")

    @classmethod
    def json_schema(cls, schema: str | Mapping[str, object]) -> Constraint:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> Constraint:
        return cls("choice", choices=tuple(choices))

    @classmethod
    def grammar(cls, grammar: str, *, gbnf: bool = False) -> Constraint:
        return cls("grammar", grammar, gbnf=gbnf)


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass(frozen=True)
class SamplingParams:
    """How one generation picks its tokens, and what it reports about them.

    temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 are "off"; top_k wins over
    top_p. min_p drops the tokens whose probability after temperature is below min_p
    times the most likely token's. Penalties change the logits before anything else
    (greedy rows take the argmax of the penalised logits): repetition_penalty (1 is
    off; Hugging Face's and vLLM's) divides a positive logit by it and multiplies a
    negative one, for every token of the session's context, prompt included;
    frequency_penalty and presence_penalty (0 is off; OpenAI's) subtract penalty x
    count and penalty x (count > 0), counting the tokens this generation generated.
    `logprobs` k reports each generated token's log-probability and the k most likely
    ones; `prompt_logprobs` k the same for every prompt token the generation feeds
    (None: not asked). Log-probabilities are those of the raw model distribution
    (float32 log-softmax of the logits, before temperature, penalties and filters).
    `constraint` limits each draw to the tokens that keep the text within it, and ends
    the generation (its end-of-sequence token) where the constraint is complete.
    Token rules, applied after the penalties, before the constraint: `logit_bias`
    ((token, bias) pairs, bias in [-100, 100], OpenAI's) adds to those logits;
    `allowed_tokens` (when not None) keeps only those; `banned_sequences` never lets a
    generation complete one of those token sequences (vLLM's `bad_words`); `min_tokens`
    holds back `min_tokens_held` until that many tokens were generated (a runner fills
    it with the generation's stop tokens).
    `pooling` ("last" or "mean", POOLING_CHOICES) asks for no token at all: the prompt's
    last hidden states (after the model's final norm) pooled into one float32 vector,
    the last token's or the mean over the tokens the generation feeds (an embedding).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None
    logit_bias: tuple[tuple[Token, float], ...] = ()
    allowed_tokens: frozenset[Token] | None = None
    banned_sequences: tuple[tuple[Token, ...], ...] = ()
    min_tokens: int = 0
    min_tokens_held: frozenset[Token] = frozenset()
    pooling: str | None = None

    def __post_init__(self) -> None:
        self._coerce()
        if self.pooling is not None and self.pooling not in POOLING_CHOICES:
            raise InvalidArgumentError(
                f"pooling must be one of {', '.join(POOLING_CHOICES)} (or None for a token), "
                f"got {self.pooling!r}"
            )
        if not self.temperature >= 0.0:
            raise InvalidArgumentError(
                f"temperature must be >= 0 (0 is greedy), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1] (1 is off), got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0 (0 is off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgumentError(f"min_p must be in [0, 1] (0 is off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidArgumentError(f"{name} must be in [-2, 2] (0 is off), got {value}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise InvalidArgumentError(
                "repetition_penalty must be a finite number > 0 (1 is off; above 1 "
                f"discourages repeats), got {self.repetition_penalty}"
            )
        for token, bias in self.logit_bias:
            if not (isinstance(token, int) and token >= 0 and -100.0 <= bias <= 100.0):
                raise InvalidArgumentError(
                    f"logit_bias takes (token id >= 0, bias in [-100, 100]) pairs, got "
                    f"({token!r}, {bias!r})"
                )
        if self.allowed_tokens is not None and not self.allowed_tokens:
            raise InvalidArgumentError(
                "allowed_tokens is empty: give at least one token id, or None for all"
            )
        if any(not sequence for sequence in self.banned_sequences):
            raise InvalidArgumentError("banned_sequences holds an empty sequence")
        if self.min_tokens < 0:
            raise InvalidArgumentError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_LOGPROBS
            ):
                raise InvalidArgumentError(
                    f"{name} must be None (not asked) or an integer in [0, {MAX_LOGPROBS}] "
                    f"(how many most likely tokens to report besides the chosen one), "
                    f"got {value!r}"
                )

    def _coerce(self) -> None:
        """Each field as its declared type (see `coerce_int` and the others)."""
        for name in _FLOAT_FIELDS:
            _set(self, name, coerce_float(name, getattr(self, name)))
        for name in ("top_k", "min_tokens"):
            _set(self, name, coerce_int(name, getattr(self, name)))
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidArgumentError(
                f"constraint must be a Constraint (Constraint.json_schema(...), .regex(...), "
                f"...) or None, got {type(self.constraint).__name__}"
            )
        bias: object = self.logit_bias
        pairs = _items("logit_bias", bias.items() if isinstance(bias, Mapping) else bias, "pairs")
        coerced = []
        for index, pair in enumerate(pairs):
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise InvalidArgumentError(
                    f"logit_bias[{index}] must be a (token id, bias) pair, got {pair!r}"
                )
            coerced.append((coerce_int("logit_bias token", pair[0]), coerce_float("bias", pair[1])))
        _set(self, "logit_bias", tuple(coerced))
        if self.allowed_tokens is not None:
            _set(self, "allowed_tokens", coerce_token_set("allowed_tokens", self.allowed_tokens))
        sequences = _items("banned_sequences", self.banned_sequences, "token id sequences")
        _set(
            self,
            "banned_sequences",
            tuple(coerce_tokens(f"banned_sequences[{i}]", s) for i, s in enumerate(sequences)),
        )
        _set(self, "min_tokens_held", coerce_token_set("min_tokens_held", self.min_tokens_held))

    @property
    def restricted(self) -> bool:
        """Whether a token rule changes the logits (see the class docstring)."""
        return bool(
            self.logit_bias
            or self.allowed_tokens is not None
            or self.banned_sequences
            or (self.min_tokens and self.min_tokens_held)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether any penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(frozen=True)
class GenConfig:
    """One generation's settings.

    `stop_tokens` None means the runner's own (the model's end-of-turn tokens, for a
    runner made by an Engine); an explicit set replaces them (`frozenset()`: none).
    `stop_strings` end the generation once its text contains one of them (the text
    stops before it; the tokens stop at the token that completed it); they need a
    runner with a tokenizer. `extra_stop_tokens` stop it too, besides `stop_tokens`
    (or the runner's). `include_stop_string` keeps the stop string at the end of the
    text. `sampling.min_tokens` must not exceed `max_new_tokens`. `priority` (an
    integer, lower first; vLLM's convention) orders the generations that wait to start,
    keeps a less urgent generation's work out of a step while a more urgent prompt is
    being fed, and picks the less urgent generation when one must give its cells up.
    `adapter` names the LoRA adapter the generation runs with (one the engine has
    loaded; None: the base model alone).
    """

    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_tokens: frozenset[Token] | None = None
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    extra_stop_tokens: frozenset[Token] = frozenset()
    include_stop_string: bool = False
    adapter: str | None = None
    priority: int = DEFAULT_PRIORITY

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidArgumentError(
                f"sampling must be a SamplingParams, got {type(self.sampling).__name__}"
            )
        if self.stop_tokens is not None:
            _set(self, "stop_tokens", coerce_token_set("stop_tokens", self.stop_tokens))
        _set(
            self, "extra_stop_tokens", coerce_token_set("extra_stop_tokens", self.extra_stop_tokens)
        )
        _set(self, "stop_strings", coerce_strings("stop_strings", self.stop_strings))
        if self.seed is not None:
            seed = coerce_int("seed", self.seed)
            if seed < 0:
                raise InvalidArgumentError(
                    f"seed must be >= 0 or None (nondeterministic), got {seed}"
                )
            _set(self, "seed", seed)
        if not isinstance(self.include_stop_string, bool):
            raise InvalidArgumentError(
                f"include_stop_string must be True or False, got {self.include_stop_string!r}"
            )
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise InvalidArgumentError(
                f"adapter must be the name of a loaded LoRA adapter or None (the base "
                f"model), got {self.adapter!r}"
            )
        _set(self, "priority", coerce_int("priority", self.priority))
        # A malformed max_new_tokens is the runner's to refuse, with its own message.
        min_tokens = self.sampling.min_tokens
        if isinstance(self.max_new_tokens, int) and 0 < self.max_new_tokens < min_tokens:
            raise InvalidArgumentError(
                f"min_tokens ({min_tokens}) is above max_new_tokens "
                f"({self.max_new_tokens}); lower min_tokens or raise max_new_tokens"
            )
