"""CellExecutor: what every executor over a cell KV cache shares (docs/design.md#executors).

Owns: the CellCache, the KVPool and the SessionTable of one model; the session methods of
the `Executor` protocol; and `run_forward`, one forward over a range of a packed step:
declare and place its tokens on the cell cache, grow the pool, plan its attention, run
the subclass's forward, gather prompt logprobs and sample every wanted row with its own
session's policy in one call.
Promises: a subclass differs only in how a packed step maps onto forwards (`execute`) and
in what runs one forward (the `Forward` it hands `run_forward`); everything else
(packing, `select_rows`, sampling, scoring, cell placement, the refusal of a step short
of cells) is this one code. The cache, pool and table exist from `initialize()` on (the
engine thread calls it first); before, reading them raises saying so.
Never: imports model code (a program executor runs without it), schedules, keeps
generation state, or calls back into the runner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cellbatch.cache import AttentionPlan, CellCache, KVPool
from cellbatch.constraint import ConstraintCompiler
from cellbatch.executor.session_table import PackedStep, SessionTable, select_rows
from cellbatch.types import (
    NO_ADAPTER,
    BatchInput,
    BatchOutput,
    InvalidArgumentError,
    KVUsage,
    ModelGeometry,
    OutOfResourcesError,
    Output,
    SamplingParams,
    SessionId,
)


@dataclass(frozen=True)
class ExecutorShape:
    """How big the executor is allowed to get."""

    max_sessions: int = 64
    max_session_tokens: int = 4096
    max_cells: int = 65536
    max_batch_tokens: int = 544
    kv_dtype: torch.dtype = torch.float32


# One placed forward: (tokens, positions, cells, attention plan, the rows whose logits
# are wanted) -> float32 logits [len(rows), V]; the pool holds the forward's cells.
Forward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, np.ndarray], torch.Tensor
]


@dataclass(frozen=True)
class _Cells:
    """What `initialize()` builds: the cell bookkeeping, the KV pool, the sessions."""

    cache: CellCache
    pool: KVPool
    table: SessionTable


class CellExecutor(ABC):
    """Sessions over a cell KV cache; subclasses map packed steps onto forwards."""

    def __init__(
        self,
        geometry: ModelGeometry,
        shape: ExecutorShape,
        constraints: ConstraintCompiler | None = None,
    ) -> None:
        self.geometry = geometry
        self.shape = shape
        self.constraints = constraints  # compiles the generations' constraints
        self._cells: _Cells | None = None

    # -- lifecycle -----------------------------------------------------------

    def initialize(self) -> None:
        cache = CellCache(self.shape.max_cells)
        pool = KVPool(
            self.geometry.num_layers,
            self.geometry.num_kv_heads,
            self.geometry.head_dim,
            self.shape.max_cells,
            dtype=self.shape.kv_dtype,
        )
        table = SessionTable(
            cache, self.shape.max_sessions, self.shape.max_session_tokens, self.constraints
        )
        self._cells = _Cells(cache, pool, table)

    def _initialized(self) -> _Cells:
        if self._cells is None:
            raise RuntimeError(
                f"{type(self).__name__} is not initialized: call initialize() first "
                "(a Runner does, on its engine thread)"
            )
        return self._cells

    @property
    def cache(self) -> CellCache:
        return self._initialized().cache

    @property
    def pool(self) -> KVPool:
        return self._initialized().pool

    @property
    def table(self) -> SessionTable:
        return self._initialized().table

    def kv_usage(self) -> KVUsage:
        pool = self.pool
        return KVUsage(
            cells_in_use=self.cache.used_cells(),
            free_cells=self.cache.free_cells(),
            max_cells=self.shape.max_cells,
            pool_rows=pool.rows,
            allocated_bytes=pool.allocated_bytes,
            growth_count=pool.growth_count,
            bytes_per_cell=pool.bytes_per_cell,
        )

    # -- sessions ------------------------------------------------------------

    def open_session(self) -> SessionId | None:
        try:
            return self.table.open()
        except OutOfResourcesError:
            return None

    def close_session(self, sid: SessionId) -> None:
        self.table.close(sid)

    def clone(self, source: SessionId, upto: int) -> SessionId | None:
        try:
            return self.table.clone(source, upto)
        except (InvalidArgumentError, OutOfResourcesError):
            return None

    def truncate(self, sid: SessionId, length: int) -> None:
        self.table.truncate(sid, length)

    def set_sampling(self, sid: SessionId, params: SamplingParams, seed: int | None) -> None:
        """Installs the policy; a token rule naming a token outside the vocabulary is
        refused here, so that it fails its generation alone, never a step."""
        vocab = self.geometry.vocab_size
        named = [token for token, _ in params.logit_bias]
        named += sorted(params.allowed_tokens or ())
        named += [token for sequence in params.banned_sequences for token in sequence]
        named += sorted(params.min_tokens_held)
        outside = [token for token in named if not 0 <= token < vocab]
        if outside:
            raise InvalidArgumentError(
                f"token id {outside[0]} of the sampling rules is outside the vocabulary "
                f"[0, {vocab}); use ids of this model's tokenizer"
            )
        self.table.set_sampling(sid, params, seed)

    # Whether this executor's forwards run LoRA adapters (a subclass's choice).
    runs_adapters = False

    def set_adapter(self, sid: SessionId, adapter: int) -> None:
        """Installs the LoRA adapter id of the session's next generation (NO_ADAPTER: the
        base model); refused where this executor's forwards run no adapters."""
        if adapter != NO_ADAPTER and not self.runs_adapters:
            raise InvalidArgumentError(
                f"{type(self).__name__} runs no LoRA adapters (an exported program runs its "
                "base model only); load the model from its folder or GGUF file to serve them"
            )
        self.table.set_adapter(sid, adapter)

    def position(self, sid: SessionId) -> int:
        return self.table.position(sid)

    # -- steps ---------------------------------------------------------------

    @abstractmethod
    def execute(self, batch: BatchInput) -> BatchOutput:
        """One packed step: each input's tokens fed, each output sampled (see Executor)."""

    def pack(self, batch: BatchInput) -> PackedStep:
        """The batch on one token axis; refused (cache untouched) when the whole step
        cannot get its cells, so that a step short of cells is never half placed."""
        step = self.table.pack(batch)
        if step.num_tokens > self.cache.free_cells():
            raise OutOfResourcesError(
                f"a step of {step.num_tokens} tokens needs {step.num_tokens} free KV cells, "
                f"{self.cache.free_cells()} are free; raise max_cells or run fewer sessions"
            )
        return step

    def run_forward(
        self,
        batch: BatchInput,
        step: PackedStep,
        offset: int,
        length: int,
        outputs: list[Output | None],
        forward: Forward,
    ) -> None:
        """One forward over step tokens [offset, offset + length): places them, runs
        `forward`, and fills `outputs` for the inputs whose output row it holds."""
        end = offset + length
        seq_ids = step.seq_ids[offset:end]
        positions = step.positions[offset:end]
        if not self.cache.declare_step(seq_ids):
            raise OutOfResourcesError("declare_step refused a slice the step had room for")
        cells = self.cache.place_step(seq_ids, positions)
        self.pool.ensure(self.cache.high_water())
        plan = self.cache.attention_plan(seq_ids, positions, cells)
        picked = select_rows(step, offset, length)
        logits = forward(
            torch.from_numpy(step.tokens[offset:end]),
            torch.from_numpy(positions),
            torch.from_numpy(cells),
            plan,
            picked.rows,
        )
        if picked.scored.any():  # before sampling, which ends a prompt's scoring
            scored = torch.from_numpy(picked.scored)
            self.table.score(step, picked.rows[picked.scored] + offset, logits[scored])
        wanted = picked.inputs >= 0
        if not wanted.any():
            return
        indices = picked.inputs[wanted].tolist()
        # Every row is wanted in a decode step: no copy of the logits (32 x 49,152 floats).
        rows = logits if wanted.all() else logits[torch.from_numpy(wanted)]
        sampled = self.table.sample([batch.inputs[i].sid for i in indices], rows)
        for index, output in zip(indices, sampled, strict=True):
            outputs[index] = output
