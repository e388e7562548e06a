"""The KV pool: per-layer K and V tensors over the cells of the cell KV cache
(docs/design.md#cell-kv-cache-and-kv-pool).

Owns: `KVPool`, the tensors [rows, kv_heads, head_width] (the row layout is
`cellbatch.kv_format`'s), and `SCRATCH_CELL`, the row every pool keeps for padding.
Promises: row 0 is the scratch cell at every size, so `pool.k[layer][cells]` works for
real and scratch cells alike whether or not the pool has grown; growth doubles the rows
up to capacity + 1, copies the live rows bit for bit and is all-or-nothing; an unwritten
row reads as zeros.
Never: decides which cell holds what (`cellbatch.cache.CellCache` does), or writes K/V
itself (the attention ops store what the model computes).
"""

from __future__ import annotations

import numpy as np
import torch

from cellbatch.kv_format import check_kv_dtype, head_width, kv_bytes_per_cell
from cellbatch.types import InvalidArgumentError, OutOfResourcesError

SCRATCH_CELL = 0


class KVPool:
    """Per-layer K and V tensors [rows, kv_heads, head_width] over cells: head_width is
    head_dim, or for int8 head_dim codes and a float32 scale (`cellbatch.kv_format`).

    Row 0 is the scratch cell; rows grow ×2 on demand up to capacity + 1. Growth copies
    the live rows bit for bit and replaces the tensors in the `k` / `v` lists in place,
    so callers must re-read `pool.k[layer]` after `ensure`.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        initial_cells: int = 256,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("capacity", capacity),
            ("initial_cells", initial_cells),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise InvalidArgumentError(f"KVPool {name} must be a positive int, got {value}")
        check_kv_dtype(dtype)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.capacity = capacity
        self.dtype = dtype
        self.device = torch.device(device)
        self.scratch_cell = SCRATCH_CELL
        self.max_rows = capacity + 1
        self.growth_count = 0
        self.rows = min(initial_cells, self.max_rows)
        self.k, self.v = self._allocate(self.rows)

    @property
    def bytes_per_cell(self) -> int:
        return kv_bytes_per_cell(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def allocated_bytes(self) -> int:
        return self.rows * self.bytes_per_cell

    def ensure(self, cells: int) -> None:
        """Makes rows [0, cells) exist, doubling the row count as often as needed (capped
        at capacity + 1). All or nothing: on failure the pool is unchanged and usable."""
        if cells <= self.rows:
            return
        if cells > self.max_rows:
            raise OutOfResourcesError(
                f"KV pool asked to hold {cells} rows but holds at most {self.max_rows} "
                f"({self.capacity} cells + the scratch row); raise its capacity"
            )
        rows = self.rows
        while rows < cells:
            rows *= 2
        rows = min(rows, self.max_rows)
        k, v = self._allocate(rows)
        for new, old in zip(k + v, self.k + self.v, strict=True):
            new[: self.rows].copy_(old)
        self.k[:] = k
        self.v[:] = v
        self.rows = rows
        self.growth_count += 1

    def _allocate(self, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (rows, self.num_kv_heads, head_width(self.head_dim, self.dtype))
        try:
            # Zeroed so that a masked read of the scratch row (or an unwritten row)
            # multiplies a finite value by 0, never NaN (an int8 row: codes and scale 0).
            k = [
                torch.zeros(shape, dtype=self.dtype, device=self.device)
                for _ in range(self.num_layers)
            ]
            v = [
                torch.zeros(shape, dtype=self.dtype, device=self.device)
                for _ in range(self.num_layers)
            ]
        except (RuntimeError, MemoryError) as error:
            raise OutOfResourcesError(
                f"KV pool could not allocate {rows} rows ({rows * self.bytes_per_cell} bytes of "
                f"{self.dtype} on {self.device}): {error}; lower the capacity or use a smaller "
                "KV dtype"
            ) from error
        return k, v
