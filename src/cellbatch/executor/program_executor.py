"""ProgramExecutor: runs packed steps through an exported program's methods
(docs/design.md#executors).

Owns: the map from a packed step onto a program's methods, and the inputs of one method
call (the step's tokens, positions and cells, its attention plan in flat form, the rows
whose logits it returns, padded to the method's width).
Promises: the same `SessionTable`, `pack`, `select_rows`, placement and sampling as
`ModuleExecutor` (both are `CellExecutor`s): only the forward differs. The step plan
(`plan_slices` with the program's `max_step_tokens` and `min_prefill_tokens`) cuts a step;
a slice of at least `min_prefill_tokens` runs `prefill`; the shorter rest runs as rows
of the narrowest static decode width that holds them (`pick_width`; wider runs are cut
at the widest). Padding rows take token 0 at position 0, write the scratch cell and
attend to it alone: no real token ever reads them. Construction refuses, with the
numbers, limits the program cannot hold: a KV dtype other than the program's, sessions
longer than its positions, a step wider than its widest method, a pool larger than its
methods take.
Never: imports model code (`cellbatch.model`), compiles or traces, or calls a method
outside the sizes its manifest declares.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np
import torch

from cellbatch.cache import AttentionPlan, flatten_plan
from cellbatch.constraint import ConstraintCompiler
from cellbatch.executor.cell_executor import CellExecutor, ExecutorShape, Forward
from cellbatch.executor.drafting import Drafter
from cellbatch.executor.packed_step import PackedStep
from cellbatch.executor.step_plan import plan_calls
from cellbatch.export.manifest import MethodSpec
from cellbatch.export.program import Program
from cellbatch.kv_pool import SCRATCH_CELL
from cellbatch.types import InvalidArgumentError

# Dynamic sizes of a method start at 2 (torch.export specialises 0 and 1).
MIN_DYNAMIC = 2


class ProgramExecutor(CellExecutor):
    """An exported program's methods, one call per slice of a packed step."""

    ADAPTERS_REFUSAL = (
        "an exported program runs its base model only; load the model from its folder or "
        "GGUF file to serve LoRA adapters"
    )

    def __init__(
        self,
        program: Program,
        shape: ExecutorShape,
        constraints: ConstraintCompiler | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        super().__init__(program.manifest.model, shape, constraints, drafter)
        self.program = program
        manifest = program.manifest
        self._prefill = manifest.prefill
        self._decodes = manifest.decode_methods
        self._check_limits()

    def _check_limits(self) -> None:
        manifest, shape = self.program.manifest, self.shape
        problems = []
        if shape.kv_dtype != self.program.kv_dtype:
            problems.append(
                f"its KV cache is {manifest.kv_dtype}, not "
                f"{str(shape.kv_dtype).removeprefix('torch.')} (export with --kv-dtype for "
                "another)"
            )
        if shape.max_session_tokens > manifest.model.max_positions:
            problems.append(
                f"max_session_tokens={shape.max_session_tokens} is above the "
                f"{manifest.model.max_positions} positions it takes"
            )
        if shape.max_batch_tokens > manifest.max_step_tokens:
            problems.append(
                f"max_batch_tokens={shape.max_batch_tokens} is above its widest method, "
                f"{manifest.max_step_tokens} tokens (export with --max-step-tokens)"
            )
        if shape.max_cells + 1 > manifest.max_pool_rows:
            problems.append(
                f"max_cells={shape.max_cells} (+ the scratch row) is above the "
                f"{manifest.max_pool_rows} pool rows its methods take"
            )
        if problems:
            raise InvalidArgumentError(
                f"program {self.program.path} cannot run this engine: " + "; ".join(problems)
            )

    # -- steps ---------------------------------------------------------------

    def slices(self, step: PackedStep) -> Iterator[tuple[int, int, Forward]]:
        for offset, length, method in self.calls(step.num_tokens):
            yield offset, length, partial(self.forward, method)

    def calls(self, total: int) -> Iterator[tuple[int, int, MethodSpec]]:
        """(offset, length, method) of each call covering a step of `total` tokens, in
        order (`plan_calls`): wide slices run prefill; each run of one-token slices runs
        as decode rows."""
        manifest = self.program.manifest
        by_width = {method.max_tokens: method for method in self._decodes}
        for call in plan_calls(
            total, manifest.max_step_tokens, manifest.min_prefill_tokens, by_width
        ):
            method = self._prefill if call.width is None else by_width[call.width]
            yield call.offset, call.length, method

    def forward(
        self,
        method: MethodSpec,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cells: torch.Tensor,
        plan: AttentionPlan,
        logit_rows: np.ndarray,
    ) -> torch.Tensor:
        flat = flatten_plan(plan, self.program.manifest.query_block)
        count = tokens.shape[0]
        pad = method.max_tokens - count if method.static else 0
        attention_cells, block_starts = flat.cells, flat.block_starts
        rows, attention_positions, offsets = flat.rows, flat.positions, flat.cell_offsets
        if pad:
            # Each padding row is a query of its own, at position 0 of a sequence whose
            # only cell is the scratch cell it writes.
            zeros = torch.zeros(pad, dtype=torch.long)
            tokens, positions = torch.cat([tokens, zeros]), torch.cat([positions, zeros])
            cells = torch.cat([cells, zeros + SCRATCH_CELL])
            rows = torch.cat([rows, torch.arange(count, count + pad)])
            attention_positions = torch.cat([attention_positions, zeros])
            offsets = torch.cat([offsets, zeros + attention_cells.shape[0]])
            attention_cells = torch.cat([attention_cells, zeros[:1] + SCRATCH_CELL])
            block_starts = torch.cat([block_starts, block_starts[-1] + torch.arange(1, pad + 1)])
        if attention_cells.shape[0] < MIN_DYNAMIC:  # unread entries, to the least it takes
            attention_cells = torch.cat([attention_cells, torch.full((1,), SCRATCH_CELL)])
        # A static method returns all its rows' logits (at least 2), prefill at least 2:
        # the extra rows repeat the last wanted one.
        wanted = len(logit_rows)
        returned = max(method.max_tokens if method.static else wanted, MIN_DYNAMIC)
        picked = torch.from_numpy(logit_rows)
        if returned > wanted:
            picked = torch.cat([picked, picked[-1:].expand(returned - wanted)])
        inputs = [
            tokens,
            positions,
            cells,
            attention_cells,
            rows,
            attention_positions,
            offsets,
            block_starts,
            picked,
            *self.pool.k,
            *self.pool.v,
        ]
        return self.program.methods[method.name](inputs)[:wanted]
