"""Float products whose rows do not depend on the other rows of the call.

Owns: `rows_per_call` (the fixed row count a bf16 product is called with on this CPU, or
0 where any count is safe) and `in_fixed_calls`, which runs a product in calls of exactly
that many rows.
Promises: `in_fixed_calls(linear, x, n)` returns `linear(x)`'s rows, each computed in a
call of exactly `n` rows (the last call padded with zero rows, which are dropped), so a
row's bits depend only on its own inputs, never on how many rows share the step or where
it sits among them.
Never: changes a result where `rows_per_call` is 0, or calls the product on a row count
other than `n` when it is not; except while torch.export or torch.compile traces it, where
it traces one call (a program's products are compiled by Inductor, not oneDNN's calls).

Why: on CPUs with AMX, oneDNN chooses its bf16 kernel and its blocking by the row count of
each call (tile kernels for some counts, vector kernels for others), and those round the
same row differently; calls of one fixed row count always take one path. fp32 products
(oneDNN on packed weights, MKL with `MKL_CBWR` strict, see `cellbatch/__init__`) and bf16
products on CPUs without AMX round a row the same way from two rows up
(`transformer.PACKED_MIN_GEMM_ROWS`, `attention.MIN_GEMM_ROWS`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from cellbatch.model.cpu import cpu_has_amx

# bf16 rows per oneDNN call on AMX CPUs: 32 keeps a 32-row decode step at the tile kernels'
# speed, and costs the fewest-row calls least of the counts tried (docs/design.md#measured-facts).
AMX_BF16_ROWS_PER_CALL = 32


def rows_per_call(dtype: torch.dtype) -> int:
    """The fixed row count bf16 products need on this CPU for row-invariant results, or 0."""
    return AMX_BF16_ROWS_PER_CALL if dtype == torch.bfloat16 and cpu_has_amx() else 0


def in_fixed_calls(
    linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int
) -> torch.Tensor:
    """`linear(x)` for x [..., K], computed in calls of exactly `rows` rows (0: one call)."""
    # Only the CPU's oneDNN products change their blocking with the row count.
    if rows == 0 or torch.compiler.is_compiling() or x.device.type != "cpu":
        return linear(x)
    flat = x.reshape(-1, x.shape[-1])
    count = flat.shape[0]
    outputs = []
    for start in range(0, count, rows):
        part = flat[start : start + rows]
        if part.shape[0] < rows:
            part = F.pad(part, (0, 0, 0, rows - part.shape[0]))
        outputs.append(linear(part))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out[:count].reshape(*x.shape[:-1], out.shape[-1])
