"""The engine's limits: what a caller may set (`EngineShape`) and what the engine runs
with once every unset one is derived from the model and the others (`EngineLimits`).

Owns: the defaults, and `resolve_limits`.
Promises: a limit that cannot work (fewer than one session, a step narrower than a decode
beside a prompt token, sessions longer than the model's context) is refused naming the
number and the bound; the KV pool is bounded by DEFAULT_KV_BUDGET_BYTES unless
`max_cells` says otherwise.
Never: allocates anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cellbatch.kv_format import kv_bytes_per_cell
from cellbatch.types import MAX_POSITION, InvalidArgumentError, ModelGeometry

# Bounds the KV pool by default: cells past this many bytes are never allocated.
DEFAULT_KV_BUDGET_BYTES = 4 * 2**30
DEFAULT_MAX_SESSIONS = 64
DEFAULT_MAX_BATCH_TOKENS = 544
DEFAULT_MAX_SESSION_TOKENS = 8192


@dataclass(frozen=True)
class EngineShape:
    """The engine's limits; None means "derive from the model and the others"."""

    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_session_tokens: int | None = None
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_decode_sequences: int | None = None
    max_prefill_chunk: int | None = None
    max_cells: int | None = None


@dataclass(frozen=True)
class EngineLimits:
    """An EngineShape with every limit derived: what the engine runs with."""

    max_sessions: int
    max_session_tokens: int
    max_batch_tokens: int
    max_decode_sequences: int
    max_prefill_chunk: int
    max_cells: int


def resolve_limits(
    shape: EngineShape, geometry: ModelGeometry, kv_dtype: torch.dtype
) -> EngineLimits:
    if shape.max_sessions < 1:
        raise InvalidArgumentError(f"max_sessions must be >= 1, got {shape.max_sessions}")
    if shape.max_batch_tokens < 2:
        raise InvalidArgumentError(
            f"max_batch_tokens must be >= 2 (a decode beside a prompt token), "
            f"got {shape.max_batch_tokens}"
        )
    context = min(geometry.max_positions, MAX_POSITION + 1)
    session_tokens = shape.max_session_tokens or min(context, DEFAULT_MAX_SESSION_TOKENS)
    if session_tokens > context:
        raise InvalidArgumentError(
            f"max_session_tokens={session_tokens} is above the model's context of {context}"
        )
    decodes = shape.max_decode_sequences or min(shape.max_sessions, shape.max_batch_tokens // 2)
    chunk = shape.max_prefill_chunk or shape.max_batch_tokens - decodes
    bytes_per_cell = kv_bytes_per_cell(
        geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, kv_dtype
    )
    cells = shape.max_cells or min(
        shape.max_sessions * session_tokens, DEFAULT_KV_BUDGET_BYTES // bytes_per_cell
    )
    return EngineLimits(
        max_sessions=shape.max_sessions,
        max_batch_tokens=shape.max_batch_tokens,
        max_session_tokens=session_tokens,
        max_decode_sequences=decodes,
        max_prefill_chunk=chunk,
        max_cells=cells,
    )
