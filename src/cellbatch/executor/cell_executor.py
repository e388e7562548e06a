"""CellExecutor: what every executor over a cell KV cache shares (docs/design.md#executors).

Owns: the CellCache, the KVPool and the SessionTable of one model; the session methods of
the `Executor` protocol; `execute`, one packed step: drafts for the inputs the step lets
speculate (from its `Drafter`, when it has one), the step packed with them, its
forwards, then every output row sampled in one call (a verified run keeps its drafts
while they equal the draws); and `run_forward`, one forward over a range of the step:
declare and place its tokens on the cell cache, grow the pool, plan its attention, run
the subclass's forward, gather prompt logprobs, return its output rows' logits.
Promises: a subclass differs only in how a packed step maps onto forwards (`slices`:
what runs each, the `Forward` it hands `run_forward`); everything else (drafting,
packing, `select_rows`, sampling and verification, scoring, cell placement, the refusal
of a step short of cells) is this one code. The drafter follows every session change
(rewinds, truncations, clones, closes). The cache, pool and table exist from
`initialize()` on (the engine thread calls it first); before, reading them raises
saying so.
A subclass whose forward can also give final-norm hidden states (`pooled_forward`)
serves pooling sessions (embeddings); the others refuse them when their policy is
installed.
Never: imports model code (a program executor runs without it), schedules, keeps
generation state, or calls back into the runner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from cellbatch.cache import AttentionPlan, CellCache
from cellbatch.constraint import ConstraintCompiler
from cellbatch.executor.drafting import Draft, Drafter, DraftRequest
from cellbatch.executor.packed_step import PackedStep, select_rows
from cellbatch.executor.pooling import pool_slice, slice_pooling
from cellbatch.executor.session_table import SessionTable
from cellbatch.generation_config import SamplingParams
from cellbatch.kv_pool import KVPool
from cellbatch.types import (
    NO_ADAPTER,
    BatchInput,
    BatchOutput,
    Input,
    InvalidArgumentError,
    KVUsage,
    ModelGeometry,
    OutOfResourcesError,
    Output,
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
    max_decode_sequences: int | None = None  # decodes per step (None: max_sessions)


# One placed forward: (tokens, positions, cells, attention plan, the rows whose logits
# are wanted) -> float32 logits [len(rows), V]; the pool holds the forward's cells.
Forward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, np.ndarray], torch.Tensor
]
# The same, also giving the float32 final-norm hidden states [len(hidden_rows), H] of the
# rows `hidden_rows` (after the logit rows): (logits, hidden).
PooledForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, np.ndarray, np.ndarray],
    tuple[torch.Tensor, torch.Tensor],
]


class SliceResult(NamedTuple):
    """What one forward over a slice of a step gives."""

    logits: torch.Tensor  # float32 [rows, V]: the output rows the slice holds
    inputs: np.ndarray  # int64 per row: the input (of the step) it samples for
    pooled: np.ndarray  # int64: the pooling inputs whose vector is complete after it


_NONE = np.zeros(0, dtype=np.int64)


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
        drafter: Drafter | None = None,
    ) -> None:
        self.geometry = geometry
        self.shape = shape
        self.constraints = constraints  # compiles the generations' constraints
        self.drafter = drafter  # None: no input is ever given drafts to verify
        self._cells: _Cells | None = None

    # -- lifecycle -----------------------------------------------------------

    def initialize(self) -> None:
        cache = CellCache(self.shape.max_cells)
        pool = self.new_pool()
        table = SessionTable(
            cache, self.shape.max_sessions, self.shape.max_session_tokens, self.constraints
        )
        self._cells = _Cells(cache, pool, table)
        if self.drafter is not None:
            self.drafter.initialize()

    def new_pool(self, device: torch.device | None = None, initial_cells: int = 256) -> KVPool:
        """The KV pool `initialize` builds (a subclass may place it on a device)."""
        return KVPool(
            self.geometry.num_layers,
            self.geometry.num_kv_heads,
            self.geometry.head_dim,
            self.shape.max_cells,
            dtype=self.shape.kv_dtype,
            device=device or torch.device("cpu"),
            initial_cells=initial_cells,
        )

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
        if self.drafter is not None:
            self.drafter.close(sid)

    def clone(self, source: SessionId, upto: int) -> SessionId | None:
        try:
            clone = self.table.clone(source, upto)
        except (InvalidArgumentError, OutOfResourcesError):
            return None
        if self.drafter is not None:
            self.drafter.clone(source, clone, upto)
        return clone

    def truncate(self, sid: SessionId, length: int) -> None:
        self.table.truncate(sid, length)
        if self.drafter is not None:
            self.drafter.forget(sid, length)

    def set_sampling(self, sid: SessionId, params: SamplingParams, seed: int | None) -> None:
        """Installs the policy; a token rule naming a token outside the vocabulary is
        refused here, so that it fails its generation alone, never a step."""
        vocab = self.geometry.vocab_size
        named = [token for token, _ in params.logit_bias]
        named += sorted(params.allowed_tokens or ())
        named += [token for sequence in params.banned_sequences for token in sequence]
        named += sorted(params.min_tokens_held)
        outside = [token for token in named if not 0 <= token < vocab]
        if params.pooling is not None and self.pooled_forward() is None:
            raise InvalidArgumentError(
                f"{type(self).__name__} cannot give hidden states, so it cannot pool them "
                "(embeddings): its forwards return logits only; load the model itself (its "
                "folder or GGUF file, not an exported program) on the CPU for embeddings"
            )
        if outside:
            raise InvalidArgumentError(
                f"token id {outside[0]} of the sampling rules is outside the vocabulary "
                f"[0, {vocab}); use ids of this model's tokenizer"
            )
        self.table.set_sampling(sid, params, seed)

    # Whether this executor's forwards run LoRA adapters (a subclass's choice), and why
    # not where they do not, with the fix.
    runs_adapters = False
    ADAPTERS_REFUSAL = "its forwards run the base model only"

    def set_adapter(self, sid: SessionId, adapter: int) -> None:
        """Installs the LoRA adapter id of the session's next generation (NO_ADAPTER: the
        base model); refused where this executor's forwards run no adapters."""
        if adapter != NO_ADAPTER and not self.runs_adapters:
            raise InvalidArgumentError(
                f"{type(self).__name__} runs no LoRA adapters: {self.ADAPTERS_REFUSAL}"
            )
        self.table.set_adapter(sid, adapter)

    def position(self, sid: SessionId) -> int:
        return self.table.position(sid)

    # -- steps ---------------------------------------------------------------

    @abstractmethod
    def slices(self, step: PackedStep) -> Iterable[tuple[int, int, Forward]]:
        """(offset, length, forward) of each forward covering the packed step's tokens,
        in order."""

    def pooled_forward(self) -> PooledForward | None:
        """The forward that also gives final-norm hidden states, run for the slices in
        which a pooling session (an embedding) needs them; None (the default) where this
        executor's forwards give logits only."""
        return None

    def slice_pooled_forward(
        self, step: PackedStep, offset: int, length: int
    ) -> PooledForward | None:
        """`pooled_forward()` for the step's tokens [offset, offset + length) (a subclass
        whose forwards carry per-row state, LoRA adapters, gives it that slice's)."""
        return self.pooled_forward()

    @torch.inference_mode()
    def execute(self, batch: BatchInput) -> BatchOutput:
        """One packed step: each input's tokens fed (an input the step lets speculate
        followed by its drafts), every output row sampled once all its forwards ran
        (see Executor)."""
        drafts = self._drafts(batch)
        verified = _with_drafts(batch, drafts) if any(drafts) else batch
        step = self.pack(verified, [len(draft) for draft in drafts] if any(drafts) else None)
        logits: list[torch.Tensor] = []
        owners: list[np.ndarray] = []
        outputs: list[Output | None] = [None] * len(batch.inputs)
        for offset, length, forward in self.slices(step):
            ran = self.run_forward(step, offset, length, forward)
            if ran.inputs.size:
                logits.append(ran.logits)
                owners.append(ran.inputs)
            if step.pooling is not None:
                for index in ran.pooled.tolist():
                    pooler = step.pooling.poolers[index]
                    assert pooler is not None
                    outputs[index] = Output(batch.inputs[index].sid, (), embedding=pooler.vector())
        if owners:
            order = np.concatenate(owners)
            # An input's rows are consecutive on the axis: its first row names it.
            firsts = np.flatnonzero(np.r_[True, order[1:] != order[:-1]])
            indices = order[firsts].tolist()
            sampled = self.table.sample(
                [batch.inputs[i].sid for i in indices],
                logits[0] if len(logits) == 1 else torch.cat(logits),
                [drafts[i] for i in indices] if step.drafts is not None else None,
            )
            for index, output in zip(indices, sampled, strict=True):
                outputs[index] = output
                if output.drafted and self.drafter is not None:
                    # Its cells hold the input's tokens before the drafts and the drafts
                    # it kept (all its tokens but the last, a new prediction).
                    item = batch.inputs[index]
                    kept = len(output.tokens) - 1
                    self.drafter.accepted(item.sid, item.start + item.size + kept)
        return BatchOutput(tuple(outputs))

    def pack(self, batch: BatchInput, drafts: Sequence[int] | None = None) -> PackedStep:
        """The batch on one token axis; refused (cache untouched) when the whole step
        cannot get its cells, so that a step short of cells is never half placed."""
        step = self.table.pack(batch, drafts)
        if step.num_tokens > self.cache.free_cells():
            raise OutOfResourcesError(
                f"a step of {step.num_tokens} tokens needs {step.num_tokens} free KV cells, "
                f"{self.cache.free_cells()} are free; raise max_cells or run fewer sessions"
            )
        return step

    def run_forward(
        self, step: PackedStep, offset: int, length: int, forward: Forward
    ) -> SliceResult:
        """One forward over step tokens [offset, offset + length): places them, runs
        `forward` (`pooled_forward()` where a pooling session needs hidden states of the
        slice, which go to its pooler), gathers the prompt logprobs its rows give, and
        returns the logits of its output rows with the input each row samples for."""
        end = offset + length
        seq_ids = step.seq_ids[offset:end]
        positions = step.positions[offset:end]
        if not self.cache.declare_step(seq_ids):
            raise OutOfResourcesError("declare_step refused a slice the step had room for")
        cells = self.cache.place_step(seq_ids, positions)
        self.pool.ensure(self.cache.high_water())
        plan = self.cache.attention_plan(seq_ids, positions, cells)
        picked = select_rows(step, offset, length)
        pooling = slice_pooling(step.pooling, offset, length) if step.pooling else None
        placed = (
            torch.from_numpy(step.tokens[offset:end]),
            torch.from_numpy(positions),
            torch.from_numpy(cells),
            plan,
            picked.rows,
        )
        pooled_forward = self.slice_pooled_forward(step, offset, length)
        if pooling is not None and pooling.rows.size:
            assert step.pooling is not None
            if pooled_forward is None:  # set_sampling refuses pooling sessions here
                raise InvalidArgumentError(f"{type(self).__name__} cannot pool hidden states")
            logits, hidden = pooled_forward(*placed, pooling.rows)
            pool_slice(step.pooling, pooling, positions, hidden)
        else:
            logits = forward(*placed)
        if picked.scored.any():  # before sampling, which ends a prompt's scoring
            scored = torch.from_numpy(picked.scored)
            self.table.score(step, picked.rows[picked.scored] + offset, logits[scored])
        wanted = picked.inputs >= 0
        # Every row is wanted in a decode step: no copy of the logits (32 x 49,152 floats).
        rows = logits if wanted.all() else logits[torch.from_numpy(wanted)]
        done = pooling.done if pooling is not None else _NONE
        return SliceResult(rows, picked.inputs[wanted], done)

    def _drafts(self, batch: BatchInput) -> list[Draft]:
        """Per input, the drafted tokens it verifies this step (none for most): up to
        its `max_drafts`, within the session's token limit and the free cells, and only
        as many as its constraint allows."""
        drafts: list[Draft] = [()] * len(batch.inputs)
        drafter = self.drafter
        if drafter is None:
            return drafts
        for item in batch.inputs:
            drafter.forget(item.sid, item.start)  # what the step rewinds, it rewinds there too
        spare = self.cache.free_cells() - sum(item.size for item in batch.inputs)
        requests: list[tuple[int, DraftRequest]] = []
        for index, item in enumerate(batch.inputs):
            end = item.start + item.size
            limit = min(item.max_drafts, self.shape.max_session_tokens - end, spare)
            if limit <= 0 or not item.produce_output or item.sid not in self.table:
                continue
            spare -= limit
            context = np.concatenate(
                [self.table.history(item.sid, item.start), np.asarray(item.tokens, np.int64)]
            )
            requests.append((index, DraftRequest(item.sid, context, limit)))
        if not requests:
            return drafts
        for (index, request), draft in zip(
            requests, drafter.propose([request for _, request in requests]), strict=True
        ):
            drafts[index] = self.table.allowed(request.sid, draft[: request.limit])
        return drafts


def _with_drafts(batch: BatchInput, drafts: Sequence[Draft]) -> BatchInput:
    """The batch with each input's drafts fed after its tokens."""
    return BatchInput(
        tuple(
            item
            if not draft
            else Input(
                item.sid,
                True,
                item.offset,
                item.size + len(draft),
                (*item.payload[: item.offset + item.size], *draft),
                item.position,
            )
            for item, draft in zip(batch.inputs, drafts, strict=True)
        )
    )
