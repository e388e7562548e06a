"""The engine's limits: what a caller may set (`EngineShape`) and what the engine runs
with once every unset one is derived from the model and the others (`EngineLimits`).

Owns: the defaults, `resolve_limits`, and the KV pool's share of memory (`KVMemory`).
Promises: a limit that cannot work (fewer than one session, a step narrower than a decode
beside a prompt token, sessions longer than the model's context) is refused naming the
number and the bound. The KV pool's cap (`max_cells`) is never more than the memory left
for it: what the machine had available once the weights were in memory, less a reserve
for the rest of the process, less the third that growth needs (a pool that doubles holds
its old rows beside the new ones). By default it is the smaller of that and what every
session at its longest would fill; a `max_cells` above it is refused with the numbers and
the fix.
Never: allocates anything, or reads the machine (the caller hands it a `KVMemory`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cellbatch.kv_format import kv_bytes_per_cell
from cellbatch.types import MAX_POSITION, InvalidArgumentError, ModelGeometry

GIB = 2**30
# Kept out of the KV pool's share for everything else the process holds (steps' activations,
# the tokenizer, the interpreter, the allocator's slack): this, or a tenth of the machine.
MIN_RESERVE_BYTES = GIB
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
class KVMemory:
    """Memory the KV pool may take: `available_bytes` once the weights are in memory (a
    file-backed mapping of them already taken off), of `total_bytes`."""

    available_bytes: int
    total_bytes: int

    @property
    def reserve_bytes(self) -> int:
        return max(MIN_RESERVE_BYTES, self.total_bytes // 10)

    @property
    def pool_bytes(self) -> int:
        """The most a pool may hold: two thirds of what is left after the reserve (its last
        doubling holds the old half beside the new whole)."""
        return max(0, self.available_bytes - self.reserve_bytes) * 2 // 3

    def explain(self) -> str:
        return (
            f"{_gib(self.pool_bytes)} is free for it ({_gib(self.available_bytes)} of "
            f"{_gib(self.total_bytes)} available with the weights in memory, less "
            f"{_gib(self.reserve_bytes)} kept for the rest of the process, less a third for "
            "the pool's growth)"
        )


def _gib(count: int) -> str:
    return f"{count / GIB:.2f} GiB"


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
    shape: EngineShape,
    geometry: ModelGeometry,
    kv_dtype: torch.dtype,
    memory: KVMemory | None = None,
    draft_bytes_per_cell: int = 0,
) -> EngineLimits:
    """`shape` with every unset limit derived; `memory` bounds the KV pool (None: no
    bound but what the sessions can fill). A draft model's cache holds a cell of
    `draft_bytes_per_cell` beside each of the pool's (the same count), so memory bounds
    the two together."""
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
    cells = shape.max_cells or shape.max_sessions * session_tokens
    if memory is not None:
        asked = shape.max_cells is not None
        cells = _fit_cells(
            cells,
            asked,
            bytes_per_cell + draft_bytes_per_cell,
            kv_dtype,
            memory,
            shape.max_batch_tokens,
            ", the draft model's cache included" if draft_bytes_per_cell else "",
        )
    return EngineLimits(
        max_sessions=shape.max_sessions,
        max_batch_tokens=shape.max_batch_tokens,
        max_session_tokens=session_tokens,
        max_decode_sequences=decodes,
        max_prefill_chunk=chunk,
        max_cells=cells,
    )


def _fit_cells(
    cells: int,
    asked: bool,
    bytes_per_cell: int,
    kv_dtype: torch.dtype,
    memory: KVMemory,
    step_tokens: int,
    draft: str,
) -> int:
    """`cells` within `memory`: an asked count that does not fit is refused, a default one
    lowered to what fits, and refused too when not even one step's tokens fit."""
    fit = memory.pool_bytes // bytes_per_cell
    if cells <= fit:
        return cells
    dtype = str(kv_dtype).removeprefix("torch.")
    smaller = "" if kv_dtype == torch.int8 else ", use kv_dtype int8 (about half bf16's bytes)"
    if asked:
        raise InvalidArgumentError(
            f"max_cells={cells} needs a KV pool of {_gib(cells * bytes_per_cell)} "
            f"({bytes_per_cell} bytes per cell of {dtype}{draft}), but {memory.explain()}; lower "
            f"max_cells to at most {fit}{smaller}, or free memory"
        )
    if fit < step_tokens:
        raise InvalidArgumentError(
            f"no memory is left for the KV pool: {memory.explain()}, under one step's "
            f"{step_tokens} cells of {bytes_per_cell} bytes{draft}; free memory{smaller}, or "
            "load a smaller or more quantised model"
        )
    return fit
