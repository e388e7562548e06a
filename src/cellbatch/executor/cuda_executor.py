"""CudaExecutor: packed steps on a GPU, one captured graph per static decode width
(docs/design.md#the-cuda-executor).

Owns: a model on a torch device and its KV pool there; the static input buffers of each
decode call shape (a width W and a key bucket: `DecodeBuffers`); the `StepGraphs` over
them; the map of a packed step onto calls (`plan_calls` with the decode widths and the
prefill lower bound); and, with weight sharing off, one copy of the weights per method.
Promises: the same SessionTable, packing, drafting and verification, cell placement,
scoring and sampling as every `CellExecutor`: only the forwards differ (`slices`). A
step's runs of one-token slices run as rows of the narrowest decode width that holds
them (`decode_<W>`: the widths of `CudaOptions`, by default powers of two up to the
engine's decodes per step); padding rows take token 0 at position 0, write the scratch
cell and attend to it alone, so one graph serves any mix of sessions. Slices of at least
`min_prefill_tokens` run the model eagerly over their own shapes (the dynamic prefill
path), and so does any slice in which a pooling session (an embedding) needs hidden
states. With `cuda_graph`, each (width, key bucket) is captured on first use and replayed
after; pool growth moves the K/V tensors a graph read, so every graph is dropped then
and captured again on next use (counted in `stats`). Eager decode calls run the same
padded shapes as the graphs, so a graph's logits are the eager ones, bit for bit. The
weights are loaded once and every method and graph reads them, unless `weight_sharing`
is off (a copy per method, as a runtime without sharing holds). Sampling runs where the
logits are (on the GPU) through the same `sample_rows` and coins as the host's;
`sample_on_host` copies the rows to the CPU first.
Never: captures a wide (prefill) step, syncs with the host inside a decode forward, or
lets a padding row's write reach a real cell.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from cellbatch.cache import AttentionPlan
from cellbatch.constraint import ConstraintCompiler
from cellbatch.executor.cell_executor import CellExecutor, ExecutorShape, Forward, PooledForward
from cellbatch.executor.drafting import Drafter
from cellbatch.executor.graphs import CudaGraphCapture, GraphCapture, StepGraphs
from cellbatch.executor.packed_step import PackedStep
from cellbatch.executor.step_plan import plan_calls
from cellbatch.kv_pool import SCRATCH_CELL, KVPool
from cellbatch.model.config import ModelConfig
from cellbatch.model.device_attention import (
    ATTENTION_KINDS,
    CellGroup,
    CellRows,
    DeviceAttention,
    key_bucket,
    row_table,
)
from cellbatch.model.transformer import PackedTransformer
from cellbatch.types import InvalidArgumentError

# The pool a GPU starts with: each growth drops every graph, so it starts larger there.
CUDA_INITIAL_CELLS = 4096


@dataclass(frozen=True)
class CudaOptions:
    """How a CudaExecutor runs (`cellbatch run --cuda-graph --weight-sharing`)."""

    # Capture each decode shape once and replay it (off: eager, vLLM's --enforce-eager).
    cuda_graph: bool = True
    weight_sharing: bool = True  # one copy of the weights for every method and graph
    attention: str = "sdpa"  # one of ATTENTION_KINDS (model.device_attention)
    # None: powers of two up to the decodes a step holds (`default_widths`).
    decode_widths: tuple[int, ...] | None = None
    min_prefill_tokens: int | None = None  # None: the widest decode width + 1
    sample_on_host: bool = False  # sample from a CPU copy of the logits (a check's reference)


def default_widths(decodes: int) -> tuple[int, ...]:
    """Powers of two below `decodes`, and `decodes` itself."""
    widths = {1 << power for power in range(decodes.bit_length()) if 1 << power < decodes}
    return tuple(sorted(widths | {decodes}))


class DecodeBuffers:
    """The static inputs of one decode shape: W rows, each with a key table of `keys`
    cells, on the device; a forward (or a graph) reads them, `fill` rewrites them."""

    def __init__(self, width: int, keys: int, device: torch.device) -> None:
        self.width = width
        self.keys = keys
        self.tokens = torch.zeros(width, dtype=torch.long, device=device)
        self.positions = torch.zeros(width, dtype=torch.long, device=device)
        self.cells = torch.full((width,), SCRATCH_CELL, dtype=torch.long, device=device)
        self.table = torch.full((width, keys), SCRATCH_CELL, dtype=torch.long, device=device)
        self.all_rows = torch.arange(width, dtype=torch.long, device=device)
        self.attention = CellRows(
            [CellGroup(self.all_rows[:, None], self.table, self.positions[:, None], None)],
            width,
        )

    def fill(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cells: torch.Tensor,
        plan: AttentionPlan,
    ) -> None:
        """The call's tokens in the first rows; padding rows: token 0 at position 0,
        writing the scratch cell, whose key table holds the scratch cell alone."""
        count = tokens.shape[0]
        host = np.zeros((3, self.width), dtype=np.int64)
        host[0, :count] = tokens.numpy()
        host[1, :count] = positions.numpy()
        host[2, :] = SCRATCH_CELL
        host[2, :count] = cells.numpy()
        staged = torch.from_numpy(host)
        for buffer, values in zip((self.tokens, self.positions, self.cells), staged, strict=True):
            buffer.copy_(values, non_blocking=True)
        table = row_table(plan, self.width, self.keys)
        self.table.copy_(torch.from_numpy(table), non_blocking=True)


class CudaExecutor(CellExecutor):
    """A model on a device: decode widths through captured graphs, wide steps eagerly."""

    ADAPTERS_REFUSAL = (
        "LoRA adapters run on the CPU only (the CUDA executor's forwards and graphs carry "
        "no adapter rows); load the model with device 'cpu' to serve them"
    )

    def __init__(
        self,
        model: PackedTransformer,
        config: ModelConfig,
        shape: ExecutorShape,
        options: CudaOptions = CudaOptions(),
        constraints: ConstraintCompiler | None = None,
        capture: GraphCapture | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        super().__init__(model.geometry, shape, constraints, drafter)
        self.model = model
        self.config = config
        self.options = options
        self.device = model.norm.weight.device
        decodes = min(shape.max_decode_sequences or shape.max_sessions, shape.max_batch_tokens - 1)
        self.widths = self._check_widths(options.decode_widths or default_widths(decodes))
        self.min_prefill_tokens = options.min_prefill_tokens or self.widths[-1] + 1
        if self.min_prefill_tokens < 2:
            raise InvalidArgumentError(
                f"min_prefill_tokens must be >= 2 (shorter slices run as decode rows), got "
                f"{self.min_prefill_tokens}"
            )
        if options.attention not in ATTENTION_KINDS:
            raise InvalidArgumentError(
                f"unknown attention {options.attention!r}; use one of {', '.join(ATTENTION_KINDS)}"
            )
        if capture is None and options.cuda_graph and self.device.type == "cuda":
            capture = CudaGraphCapture(self.device)
        self.graphs = StepGraphs(capture if options.cuda_graph else None)
        self.attention = DeviceAttention(model.geometry, self.device, options.attention)
        # Products on a device run on the rows they are given (no padding to a GEMM's
        # row-invariant size: that is a CPU promise, see PackedTransformer).
        model.min_rows = 1
        model.fuse_layers(False)  # a one-op layer takes the CPU op's flat plan, not CellRows
        model.set_attention(self.attention)
        self._methods: dict[str, PackedTransformer] = {}
        self._buffers: dict[tuple[int, int], DecodeBuffers] = {}
        self._pool_growths = 0

    def _check_widths(self, widths: tuple[int, ...]) -> tuple[int, ...]:
        ordered = tuple(sorted(set(widths)))
        if not ordered or ordered[0] < 1:
            raise InvalidArgumentError(f"decode widths must be >= 1, got {widths}")
        if ordered[-1] >= self.shape.max_batch_tokens:
            raise InvalidArgumentError(
                f"decode width {ordered[-1]} must be below max_batch_tokens="
                f"{self.shape.max_batch_tokens} (wider steps run the prefill path)"
            )
        return ordered

    # -- lifecycle -------------------------------------------------------------

    def new_pool(self, device: torch.device | None = None, initial_cells: int = 256) -> KVPool:
        """On the model's device; larger to start on a GPU."""
        if self.device.type == "cuda":
            initial_cells = CUDA_INITIAL_CELLS
        return super().new_pool(self.device, initial_cells)

    def initialize(self) -> None:
        super().initialize()
        self._pool_growths = self.pool.growth_count
        self.attention.fit_pool(self.pool.rows)

    def stats(self) -> dict[str, Any]:
        """What the executor did: its graphs' counters, the shapes it runs, pool growths
        that dropped graphs, and the copies of the weights it holds."""
        return {
            "device": str(self.device),
            "cuda_graph": self.graphs.enabled,
            "weight_sharing": self.options.weight_sharing,
            "attention": self.options.attention,
            "decode_widths": list(self.widths),
            "min_prefill_tokens": self.min_prefill_tokens,
            "pool_growths": self._pool_growths,
            "weight_copies": 1 + len(self._methods),
            "graphs": self.graphs.stats.as_dict(),
        }

    # -- steps -----------------------------------------------------------------

    def slices(self, step: PackedStep) -> Iterator[tuple[int, int, Forward]]:
        for call in plan_calls(
            step.num_tokens, self.shape.max_batch_tokens, self.min_prefill_tokens, self.widths
        ):
            forward: Forward = self.wide_forward
            if call.width is not None:
                forward = partial(self.decode_forward, call.width)
            yield call.offset, call.length, forward

    def decode_forward(
        self,
        width: int,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cells: torch.Tensor,
        plan: AttentionPlan,
        logit_rows: np.ndarray,
    ) -> torch.Tensor:
        """The call's tokens as rows of width `width`, through its graph (or eagerly)."""
        self._follow_pool()
        keys = key_bucket(plan)
        buffers = self._buffers.get((width, keys))
        if buffers is None:
            buffers = self._buffers[(width, keys)] = DecodeBuffers(width, keys, self.device)
        buffers.fill(tokens, positions, cells, plan)
        model = self._model_for(f"decode_{width}")

        def forward() -> torch.Tensor:
            logits: torch.Tensor = model.forward_flat(
                buffers.tokens,
                buffers.positions,
                buffers.cells,
                buffers.attention,
                self.pool.k,
                self.pool.v,
                buffers.all_rows,
            )
            return logits

        logits = self.graphs.run((width, keys), forward)
        return self._wanted(logits, logit_rows)

    def wide_forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cells: torch.Tensor,
        plan: AttentionPlan,
        logit_rows: np.ndarray,
    ) -> torch.Tensor:
        """A slice of at least min_prefill_tokens, eagerly over its own shapes."""
        self._follow_pool()
        device = self.device
        logits: torch.Tensor = self._model_for("prefill")(
            tokens.to(device),
            positions.to(device),
            plan,
            self.pool,
            cells.to(device),
            torch.from_numpy(logit_rows).to(device),
        )
        return logits.cpu() if self.options.sample_on_host else logits

    def pooled_forward(self) -> PooledForward:
        return self.pooled_wide_forward

    def pooled_wide_forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cells: torch.Tensor,
        plan: AttentionPlan,
        logit_rows: np.ndarray,
        hidden_rows: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A slice holding a pooling session's rows, eagerly (as `wide_forward`, of any
        length), with the final-norm hidden states of `hidden_rows` on the host."""
        self._follow_pool()
        device = self.device
        logits, hidden = self._model_for("prefill").forward_pooled(
            tokens.to(device),
            positions.to(device),
            plan,
            self.pool,
            cells.to(device),
            torch.from_numpy(logit_rows).to(device),
            torch.from_numpy(hidden_rows).to(device),
        )
        return (logits.cpu() if self.options.sample_on_host else logits), hidden.cpu()

    def _wanted(self, logits: torch.Tensor, logit_rows: np.ndarray) -> torch.Tensor:
        rows = logits.index_select(0, torch.from_numpy(logit_rows).to(self.device))
        return rows.cpu() if self.options.sample_on_host else rows

    def _follow_pool(self) -> None:
        """After the pool grew (run_forward's `ensure`), the graphs read tensors that are
        gone: drop them, and widen what the attention keeps per pool row."""
        if self.pool.growth_count != self._pool_growths:
            self._pool_growths = self.pool.growth_count
            self.graphs.invalidate()
            self.attention.fit_pool(self.pool.rows)

    def _model_for(self, method: str) -> PackedTransformer:
        """The module a method runs: the one model when weights are shared, else the
        method's own copy (made on first use; the attention stays shared)."""
        if self.options.weight_sharing:
            return self.model
        own = self._methods.get(method)
        if own is None:
            own = copy.deepcopy(self.model, {id(self.attention): self.attention})
            own.set_attention(self.attention)
            self._methods[method] = own
        return own
