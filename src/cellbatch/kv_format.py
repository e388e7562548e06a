"""How K/V are held in the KV pool: the KV dtypes and int8's row layout.

Owns: `KV_DTYPES` (float32, bfloat16, float16 and int8) and the int8 choice's name
(`is_int8_name`); the width of a head's row in the pool (`head_width`), bytes per cell
(`kv_bytes_per_cell`); int8's layout and its quantisation and dequantisation in torch
(`quantize_heads`, `dequantize_heads`), which the ops' torch implementations use and the
compiled kernels (kernels/fused_ops.cpp, kernels/cell_attention.cpp) repeat bit for bit.
Promises: a float KV dtype holds a head's K (or V) as head_dim values of that dtype. int8
holds it as head_dim int8 codes followed by the head's scale, a float32 in 4 bytes (so an
int8 pool is [rows, kv_heads, head_dim + 4] int8): scale = max|x| / 127 over the head's
values, code = round-half-even(x / scale) (0 where the scale is 0), value = code * scale
in float32, then rounded to the compute dtype, as llama.cpp's q8_0 cache keeps a scale
beside each block of codes. Quantisation reads only one (cell, head): a value never
depends on what else shares its step.
Never: allocates a pool, or knows which cells hold what.
"""

from __future__ import annotations

import torch

from cellbatch.types import InvalidArgumentError

KV_INT8 = torch.int8
# The KV dtypes a pool holds; int8 is quantised per (cell, head) (see the module's text).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, KV_INT8)
SCALE_BYTES = 4  # an int8 head's float32 scale, after its codes
_LEVELS = 127.0


def is_int8_name(name: str | torch.dtype | None) -> bool:
    """Whether a `kv_dtype` choice asks for the int8 cache ("int8" or torch.int8)."""
    return name == KV_INT8 if isinstance(name, torch.dtype) else name == "int8"


def check_kv_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in KV_DTYPES:
        raise InvalidArgumentError(
            f"KV dtype must be one of float32, bfloat16, float16, int8, got {dtype}"
        )
    return dtype


def head_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of `dtype` per head of a cell in the pool: head_dim, and int8's scale."""
    return head_dim + SCALE_BYTES if dtype == KV_INT8 else head_dim


def kv_bytes_per_cell(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V that one cell holds across every layer."""
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_width(head_dim, dtype) * element


def quantize_heads(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float values (as the compute dtype holds them) -> int8 [..., head_dim
    + 4]: each last-dimension row's codes, then its float32 scale's bytes."""
    values = x.float()
    scale = values.abs().amax(dim=-1, keepdim=True) / _LEVELS
    quotient = torch.where(scale > 0, values / scale, torch.zeros_like(values))
    codes = torch.round(quotient).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    scale_bytes = scale.contiguous().view(torch.int8)  # [..., 4], the float's bytes
    return torch.cat([codes, scale_bytes], dim=-1)


def dequantize_heads(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., head_dim + 4] (quantize_heads' layout) -> [..., head_dim] in `dtype`:
    code * scale in float32, rounded to `dtype`."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(dtype)


def read_heads(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows [..., head_width] of any KV dtype as values [..., head_dim] in `dtype`."""
    return dequantize_heads(rows, dtype) if rows.dtype == KV_INT8 else rows.to(dtype)


def store_heads(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values [..., head_dim] as pool rows of `dtype` (int8: quantised)."""
    return quantize_heads(values) if dtype == KV_INT8 else values.to(dtype)
