"""ModuleExecutor: runs packed steps through one torch module (docs/design.md#executors).

Owns: the model module and the bank of its LoRA adapters (sessions, cells and sampling
are `CellExecutor`'s).
Promises: a packed step (`CellExecutor.execute`) is cut into slices of at most
`max_batch_tokens`, one forward each (`CellExecutor.run_forward`: placed on the cell
cache), and every wanted row is sampled with its own session's policy in one call; a
slice's rows are grouped by LoRA adapter where some carry one (`AdapterBank.step`: the
base products run once for all rows, each adapter's low-rank products on its rows
alone, drafted rows with their session's adapter like the rest);
outputs[i] is None exactly when inputs[i] asks for none. The forward returns logits only
for the output rows, plus the rows of a session whose prompt logprobs are asked (so at
most `max_batch_tokens` rows a slice). A refused or failed batch raises, its message
saying why. Every row's result (token, logprobs, a pooling session's hidden states) is
independent of what else shares the step (the model pads its products to fixed shapes).
Never: schedules, keeps generation state, or calls back into the runner.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch

from cellbatch.cache import AttentionPlan
from cellbatch.constraint import ConstraintCompiler
from cellbatch.executor.cell_executor import CellExecutor, ExecutorShape, Forward, PooledForward
from cellbatch.executor.drafting import Drafter
from cellbatch.executor.packed_step import PackedStep
from cellbatch.executor.step_plan import plan_slices
from cellbatch.kv_pool import KVPool

if TYPE_CHECKING:
    from cellbatch.model.adapters import AdapterBank, LoraStep
    from cellbatch.model.config import ModelConfig

__all__ = ["ExecutorShape", "ModuleExecutor"]


class ModuleExecutor(CellExecutor):
    """One torch module, one forward per slice of a packed step."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        shape: ExecutorShape,
        constraints: ConstraintCompiler | None = None,
        drafter: Drafter | None = None,
        *,
        adapters: AdapterBank | None = None,
    ) -> None:
        super().__init__(config.geometry, shape, constraints, drafter)
        self.model = model
        self.config = config
        self.adapters = adapters
        self.runs_adapters = adapters is not None

    def slices(self, step: PackedStep) -> Iterator[tuple[int, int, Forward]]:
        for piece in plan_slices(step.num_tokens, self.shape.max_batch_tokens, 1):
            rows = None
            if step.adapters is not None:
                rows = step.adapters[piece.offset : piece.offset + piece.length]
            yield piece.offset, piece.length, partial(self.forward, rows)

    def pooled_forward(self) -> PooledForward:
        return partial(self.pooled, None)

    def slice_pooled_forward(self, step: PackedStep, offset: int, length: int) -> PooledForward:
        rows = None if step.adapters is None else step.adapters[offset : offset + length]
        return partial(self.pooled, rows)

    def forward(
        self,
        adapters: np.ndarray | None,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cells: torch.Tensor,
        plan: AttentionPlan,
        logit_rows: np.ndarray,
    ) -> torch.Tensor:
        """One slice; `adapters`: its rows' adapter ids (None: no row has one)."""
        lora = None
        if adapters is not None and self.adapters is not None:
            lora = self.adapters.step(adapters)
        rows = torch.from_numpy(logit_rows)
        if lora is None:  # the base model's own call: a module without adapters runs too
            base: torch.Tensor = self.model(tokens, positions, plan, self.pool, cells, rows)
            return base
        logits: torch.Tensor = self.model(tokens, positions, plan, self.pool, cells, rows, lora)
        return logits

    def pooled(
        self,
        adapters: np.ndarray | None,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cells: torch.Tensor,
        plan: AttentionPlan,
        logit_rows: np.ndarray,
        hidden_rows: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, with the final-norm hidden states of `hidden_rows` too."""
        lora = None
        if adapters is not None and self.adapters is not None:
            lora = self.adapters.step(adapters)
        return cast(_PoolingModel, self.model).forward_pooled(
            tokens,
            positions,
            plan,
            self.pool,
            cells,
            torch.from_numpy(logit_rows),
            torch.from_numpy(hidden_rows),
            lora,
        )


class _PoolingModel(Protocol):
    """What `pooled` calls: PackedTransformer.forward_pooled (the executor imports no
    model code)."""

    def forward_pooled(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        kv: KVPool,
        cells: torch.Tensor,
        logit_rows: torch.Tensor,
        hidden_rows: torch.Tensor,
        lora: LoraStep | None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
