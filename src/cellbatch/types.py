"""The shared vocabulary of cellbatch (docs/design.md#vocabulary).

Owns: plain data passed between the scheduler, the runner and the executors,
and the two error kinds every part raises (what a caller asks of one generation is
`cellbatch.generation_config`'s).
Promises: no torch, no I/O, no behaviour beyond validation of its own fields.
Never: holds engine state; these objects are values.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

Token = int
SessionId = int
TaskId = int
Position = int

MAX_POSITION = 2**31 - 1
# The adapter id of a generation that runs the base model alone (a LoRA adapter's id is
# issued when it loads: cellbatch.model.adapters).
NO_ADAPTER = 0
# LoRA adapters an engine holds at once unless told otherwise (`max_loras`).
DEFAULT_MAX_LORAS = 8


class InvalidArgumentError(ValueError):
    """The caller asked for something malformed (a gap, an overlap, a bad id)."""


class OutOfResourcesError(RuntimeError):
    """The request is well formed but does not fit (sessions, cells, tokens)."""


# Weight formats a model can run in, and the `quantize` choices: "auto" keeps a GGUF
# file's precision class (cellbatch.model.quantized.target_format).
WEIGHT_FORMATS = ("none", "int8", "int4")
QUANTIZE_CHOICES = ("auto", *WEIGHT_FORMATS)
# What the int4 products do with their inputs (cellbatch.model.quantized.resolve_activations):
# "float" keeps the model's dtype, "int8" quantises them per group of 32, "auto" picks.
ACTIVATION_CHOICES = ("auto", "float", "int8")
# `GenConfig.priority`: lower runs first. Interactive work runs at the default; the
# server's batch jobs at BATCH_PRIORITY, so that they only fill what interactive work
# leaves.
DEFAULT_PRIORITY = 0
BATCH_PRIORITY = 10


@dataclass(frozen=True)
class ModelGeometry:
    """A model's sizes as every layer below the model code needs them: the vocabulary,
    the positions, the attention heads and what one KV cell holds. The one geometry
    type: a model's config (`cellbatch.model.config.ModelConfig.geometry`) and a
    program's manifest both give one; the KV pool, the executors and the attention op
    read it."""

    vocab_size: int
    max_positions: int  # positions the model takes: [0, max_positions)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window, None for full
    eos_token_ids: tuple[int, ...]

    @property
    def heads_per_kv_head(self) -> int:
        """Query heads that share one KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        return float(self.head_dim**-0.5)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the raw model distribution, and the most likely
    tokens' (`top`, most likely first) at the same place."""

    token: Token
    logprob: float
    top: tuple[tuple[Token, float], ...] = ()


@dataclass(frozen=True)
class Input:
    """One slice of work for one session: a decode token or one prompt chunk.

    The slice is payload[offset:offset+size]; it starts at absolute position
    position + offset (position is the base of the whole payload). `max_drafts` > 0
    (an output-producing input only) lets a speculative executor draft up to that many
    tokens after the slice and verify them in the same forward.
    """

    sid: SessionId
    produce_output: bool
    offset: int
    size: int
    payload: Sequence[Token]
    position: Position
    max_drafts: int = 0

    @property
    def start(self) -> Position:
        return self.position + self.offset

    @property
    def tokens(self) -> Sequence[Token]:
        return self.payload[self.offset : self.offset + self.size]


@dataclass(frozen=True)
class Output:
    """An executor's answer to one input: usually one token; several only for a
    speculative executor (the accepted run plus its next prediction)."""

    sid: SessionId
    tokens: tuple[Token, ...]
    # One per token of `tokens` when the session's params ask for logprobs.
    logprobs: tuple[TokenLogprob, ...] = ()
    # On the output of a generation's last prompt chunk when its params ask: one per
    # token its prompt chunks fed, in order; entry i scores token i given everything
    # before it (None where the generation never computed the logits before it: the
    # first token of a fresh session, or the first after a cloned prefix).
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    # Drafted tokens the executor verified for this input; the first len(tokens) - 1 of
    # them were accepted (they are `tokens` but the last).
    drafted: int = 0
    # Instead of tokens, for a session whose params ask for `pooling`: the pooled hidden
    # states of the prompt its generation fed (float32 values, not normalised).
    embedding: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Task:
    """An Input plus its scheduling identity. A value: the scheduler hands back a
    cancelled copy (`cancelled=True`), never changes a task it was given."""

    tid: TaskId
    input: Input
    is_decode: bool
    cancelled: bool = False
    priority: int = DEFAULT_PRIORITY  # its generation's (GenConfig.priority): lower runs first

    @property
    def sid(self) -> SessionId:
        return self.input.sid


@dataclass(frozen=True)
class BatchInput:
    inputs: tuple[Input, ...]


@dataclass(frozen=True)
class BatchOutput:
    """outputs[i] answers inputs[i]; None exactly where no output was asked."""

    outputs: tuple[Output | None, ...]


class FinishReason(str, enum.Enum):
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    TOKEN_LIMIT = "token_limit"
    CANCELLED = "cancelled"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class GenerationUpdate:
    """Tokens delivered by one step. Only the last update of a generation carries
    a finish reason, and the final tokens come with it.

    `text` is the text these tokens add (when the runner has a tokenizer): it never
    splits a multi-byte character and never holds any part of a stop string, so the
    texts of a generation's updates concatenate to its final text.

    `logprobs` align with `tokens` when the generation's sampling params ask for them
    (else empty); `prompt_logprobs` (see `Output`) come once, on the generation's
    first update that carries tokens. `embedding` (see `Output`) comes on the last
    update of a generation whose params ask for `pooling`, which carries no tokens.
    """

    tokens: tuple[Token, ...]
    finish_reason: FinishReason | None = None
    error: str = ""
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    embedding: tuple[float, ...] = ()


@dataclass(frozen=True)
class KVUsage:
    """An executor's KV cells at one moment (read on the engine thread)."""

    cells_in_use: int
    free_cells: int
    max_cells: int
    pool_rows: int = 0
    allocated_bytes: int = 0
    growth_count: int = 0
    bytes_per_cell: int = 0
