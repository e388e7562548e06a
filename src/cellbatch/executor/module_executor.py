"""ModuleExecutor: runs packed steps through one torch module (DESIGN §6).

Owns: the CellCache, the KVPool and the SessionTable of one model, and the model
module itself.
Promises: `execute` packs the batch, cuts it into slices of at most
`max_batch_tokens`, declares and places each slice on the cell cache, runs one
forward per slice, and samples every wanted row with its own session's policy in
one call; outputs[i] is None exactly when inputs[i] asks for none. The forward
returns logits only for the output rows, plus the rows of a session whose prompt
logprobs are asked (so at most `max_batch_tokens` rows a slice). A refused or
failed batch raises, its message saying why. Every row's result (token, logprobs)
is independent of what else shares the step (the model pads its products to
fixed shapes).
Never: schedules, keeps generation state, or calls back into the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cellbatch.cache import CellCache, KVPool
from cellbatch.executor.session_table import SessionTable, select_rows
from cellbatch.executor.step_plan import plan_slices
from cellbatch.model.config import ModelConfig
from cellbatch.types import (
    BatchInput,
    BatchOutput,
    InvalidArgumentError,
    KVUsage,
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


class ModuleExecutor:
    """One torch module, one forward per slice of a packed step."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, shape: ExecutorShape) -> None:
        self.model = model
        self.config = config
        self.shape = shape
        self.cache: CellCache | None = None
        self.pool: KVPool | None = None
        self.table: SessionTable | None = None

    # -- lifecycle -----------------------------------------------------------

    def initialize(self) -> None:
        self.cache = CellCache(self.shape.max_cells)
        self.pool = KVPool(
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
            self.shape.max_cells,
            dtype=self.shape.kv_dtype,
        )
        self.table = SessionTable(
            self.cache, self.shape.max_sessions, self.shape.max_session_tokens
        )

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
        self.table.set_sampling(sid, params, seed)

    def position(self, sid: SessionId) -> int:
        return self.table.position(sid)

    # -- steps ---------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: BatchInput) -> BatchOutput:
        step = self.table.pack(batch)
        tokens = torch.from_numpy(step.tokens)
        positions = torch.from_numpy(step.positions)
        outputs: list[Output | None] = [None] * len(batch.inputs)
        # Checked for the whole step before any slice is placed, so that a step short of
        # cells is refused with the cache as it was, not half placed.
        if step.num_tokens > self.cache.free_cells():
            raise OutOfResourcesError(
                f"a step of {step.num_tokens} tokens needs {step.num_tokens} free KV cells, "
                f"{self.cache.free_cells()} are free; raise max_cells or run fewer sessions"
            )
        for piece in plan_slices(step.num_tokens, self.shape.max_batch_tokens, 1):
            start, end = piece.offset, piece.offset + piece.length
            seq_ids = step.seq_ids[start:end]
            if not self.cache.declare_step(seq_ids):
                raise OutOfResourcesError("declare_step refused a slice the step had room for")
            cells = self.cache.place_step(seq_ids, step.positions[start:end])
            self.pool.ensure(self.cache.high_water())
            plan = self.cache.attention_plan(seq_ids, step.positions[start:end], cells)
            picked = select_rows(step, start, piece.length)
            logits = self.model(
                tokens[start:end],
                positions[start:end],
                plan,
                self.pool,
                torch.from_numpy(cells),
                torch.from_numpy(picked.rows),
            )
            if picked.scored.any():  # before sampling, which ends a prompt's scoring
                scored = torch.from_numpy(picked.scored)
                self.table.score(step, picked.rows[picked.scored] + start, logits[scored])
            wanted = picked.inputs >= 0
            if not wanted.any():
                continue
            indices = picked.inputs[wanted].tolist()
            sampled = self.table.sample(
                [batch.inputs[i].sid for i in indices], logits[torch.from_numpy(wanted)]
            )
            for index, output in zip(indices, sampled, strict=True):
                outputs[index] = output
        return BatchOutput(tuple(outputs))
