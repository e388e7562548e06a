"""The torch implementations of the quantised products, `int4_matmul`, `int4_matmul_a8`,
`int8_matmul`, `int8_matmul_a8` and `kquant_matmul_a8` (cellbatch.model.ops registers them;
the compiled kernels compute the same products, kernels/quantized_*.cpp), and the
activation quantisation of the `_a8` products.

Owns: rebuilding a float weight from the kernels' panel layouts (cellbatch.model.quantized
`pack`) for each call, and `quantize_activations`.
Promises: int4_matmul and int8_matmul multiply with F.linear over the rebuilt weight, their
calls padded to FALLBACK_MIN_ROWS rows so that a row's result does not depend on the other
rows; the `_a8` products quantise each row's inputs per group of 32 (with K-quant weights,
one scale per block of 256) exactly as the compiled kernel does (the same float32
operations) and sum the groups' exact integer dot products, scaled, in float32: the
kernel's results to float rounding.
Never: runs fast (these are the fallback on devices without the compiled kernels, and the
reference the kernels are tested against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cellbatch.model import kquants
from cellbatch.model.gemm import in_fixed_calls, rows_per_call
from cellbatch.model.quantized import GROUP_SIZE, PANEL

# The dequantising fallback multiplies with F.linear, whose fp32 GEMMs round calls of fewer
# rows differently (see transformer.MIN_GEMM_ROWS).
FALLBACK_MIN_ROWS = 16


def _int4_groups(
    codes: torch.Tensor, scales: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 panels unpacked by output: (codes [rows, K / 32, 32] as float32, scale and
    offset [rows, K / 32, 1] float32)."""
    panels = codes.shape[0]
    shifts = 4 * torch.arange(8, dtype=torch.int32)[:, None]
    nibbles = (codes[:, :, None, :] >> shifts) & 0xF  # [P, K / 8, 8, PANEL]
    grouped = nibbles.view(panels, -1, GROUP_SIZE, PANEL).permute(0, 3, 1, 2)
    by_output = grouped.reshape(panels * PANEL, -1, GROUP_SIZE)[:rows].float()
    halves = scales.float().permute(0, 3, 1, 2).reshape(panels * PANEL, -1, 2)[:rows]
    return by_output, halves[..., :1], halves[..., 1:]


def _int4_dense(codes: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
    """The float32 [rows, K] weight of int4 panels (Int4Weight.dequantize's values)."""
    grouped, scale, offset = _int4_groups(codes, scales, rows)
    return (grouped * scale + offset).flatten(1)


def _int8_dense(codes: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
    """The float32 [rows, K] weight of int8 panels (Int8Weight.dequantize's values)."""
    panels, cols, _ = codes.shape
    groups = scales.shape[1]
    grouped = codes.view(panels, groups, cols // groups, PANEL).float()
    weight = grouped * scales.float()[:, :, None, :]
    return weight.permute(0, 3, 1, 2).reshape(panels * PANEL, cols)[:rows]


def _padded_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight^T with at least FALLBACK_MIN_ROWS rows in the product (in calls
    of a fixed row count where the CPU needs that: `gemm.rows_per_call`)."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    pad = FALLBACK_MIN_ROWS - count
    padded = F.pad(rows, (0, 0, 0, pad)) if pad > 0 else rows
    dense = weight.to(x.dtype)
    out = in_fixed_calls(lambda part: F.linear(part, dense), padded, rows_per_call(x.dtype))
    return out[:count].reshape(*x.shape[:-1], weight.shape[0])


def int4_matmul_torch(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int
) -> torch.Tensor:
    """The op `int4_matmul` in torch: x [..., K] times the int4 panels' weight, transposed,
    rebuilt for the call."""
    return _padded_linear(x, _int4_dense(codes, scales, out_features))


Quantised = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def quantize_activations(rows: torch.Tensor, span: int = GROUP_SIZE) -> Quantised:
    """rows [M, K] -> (codes [M, K / 32, 32] as float32 integers in [-127, 127], scales d
    [M, K / 32], sums d sum(codes) [M, K / 32]): per group of 32, d = amax / 127 and codes
    = round_half_even(x * (127 / amax)), amax the largest |x| of the group's span of inputs
    (32: the group; 256 for weights with K-quant blocks), as the compiled `_a8` products
    compute them. The sums are the quantised inputs' (llama.cpp's Q8_1 s), which the
    weights' offsets multiply."""
    spans = rows.float().unflatten(-1, (-1, span))  # type: ignore[no-untyped-call]
    amax = spans.abs().amax(dim=-1).repeat_interleave(span // GROUP_SIZE, dim=-1)
    groups = rows.float().unflatten(-1, (-1, GROUP_SIZE))  # type: ignore[no-untyped-call]
    # A division of two tensors: `127.0 / amax` would be amax.reciprocal() * 127 (rounded
    # twice), not the kernel's one division.
    limit = torch.full_like(amax, 127.0)
    inverse = torch.where(amax > 0, limit / amax.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    codes = torch.round(groups * inverse[..., None]).clamp(-127, 127)
    scales = amax / 127.0
    return codes, scales, scales * codes.sum(dim=-1)


def _a8_product(
    x: torch.Tensor,
    weight_codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    quantised: Quantised | None = None,
) -> torch.Tensor:
    """x [..., K] quantised per group of 32 (`quantize_activations`, or `quantised` as it
    gave them) times weight codes [N, K / 32, 32]: y = sum over groups of dot * s * d (+ o
    * d sum(codes) with an offset), scale and offset [N, K / 32], the dots exact (integers below
    2^24 in float32)."""
    rows = x.reshape(-1, x.shape[-1])
    x_codes, x_scales, x_sums = quantised or quantize_activations(rows)
    dots = torch.einsum("mgk,ngk->mng", x_codes, weight_codes)
    terms = dots * (scale[None] * x_scales[:, None, :])
    if offset is not None:
        terms = terms + offset[None] * x_sums[:, None, :]
    return terms.sum(-1).to(x.dtype).reshape(*x.shape[:-1], weight_codes.shape[0])


def int4_matmul_a8_torch(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int
) -> torch.Tensor:
    """The op `int4_matmul_a8` in torch: x [..., K] times the int4 panels, with int8
    activations (`_a8_product`, with the offsets)."""
    weight_codes, scale, offset = _int4_groups(codes, scales, out_features)
    return _a8_product(x, weight_codes, scale[..., 0], offset[..., 0])


def int8_matmul_a8_torch(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int
) -> torch.Tensor:
    """The op `int8_matmul_a8` in torch: x [..., K] times the int8 panels of
    `quantized.pack_a8` (codes [P, K / 4, PANEL, 4], scales [P, K / 32, PANEL]), with int8
    activations (`_a8_product`)."""
    panels, quads = codes.shape[:2]
    weight = codes.permute(0, 2, 1, 3).reshape(panels * PANEL, quads * 4)[:out_features]
    scale = scales.float().permute(0, 2, 1).reshape(panels * PANEL, -1)[:out_features]
    return _a8_product(x, weight.float().view(out_features, -1, GROUP_SIZE), scale, None)


def int8_matmul_torch(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int
) -> torch.Tensor:
    """The op `int8_matmul` in torch: x [..., K] times the int8 panels' weight, transposed,
    rebuilt for the call."""
    return _padded_linear(x, _int8_dense(codes, scales, out_features))


def kquant_rows_torch(
    codes: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    in_features: int,
    out_features: int,
) -> torch.Tensor:
    """The op `kquant_rows` in torch: outputs `rows` (int64 [n]) of a weight kept in its
    GGUF kinds, dequantised as gguf does (`kquants.dense_segment`): float32 [n, K]."""
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError(
            f"kquant_rows: rows must be an int64 vector, got {rows.dtype} {tuple(rows.shape)}"
        )
    if rows.numel() and not (int(rows.min()) >= 0 and int(rows.max()) < out_features):
        raise ValueError(f"kquant_rows: a row is outside the weight's {out_features} outputs")
    weight = kquants.unpack(codes, scales)
    if weight.shape != (out_features, in_features):
        raise ValueError(
            f"kquant_rows: a {weight.shape} weight is not {(out_features, in_features)}"
        )
    result = torch.empty(rows.shape[0], in_features, dtype=torch.float32, device=codes.device)
    column = 0
    for segment in weight.segments:
        inside = ((rows >= column) & (rows < column + segment.rows)).nonzero().flatten()
        if inside.numel():
            at = rows[inside] - column
            result[inside] = kquants.dense_segment(segment, at // PANEL, at % PANEL)
        column += segment.rows
    return result


def kquant_matmul_a8_torch(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int
) -> torch.Tensor:
    """The op `kquant_matmul_a8` in torch: x [..., K] times a weight kept in its GGUF kinds
    (`kquants.pack`), with int8 activations, one scale per block of 256 inputs where any
    segment is a K-quant kind: each segment's groups as `_a8_product` sums them (the
    offsets times the quantised inputs' sums, as the kernels' integer mins of Q4_K and Q5_K
    and their dots of Q4_0 and Q5_0 counted from the codes' zero; Q6_K: per sub-group of
    16, its codes counted from 32, no offset)."""
    weight = kquants.unpack(codes, scales)
    if weight.shape != (out_features, x.shape[-1]):
        raise ValueError(
            f"a {weight.shape} weight cannot give {out_features} outputs of x {x.shape}"
        )
    rows = x.reshape(-1, x.shape[-1])
    blocks = any(kquants.in_blocks(segment.kind) for segment in weight.segments)
    quantised = quantize_activations(rows, 256 if blocks else GROUP_SIZE)
    x_codes, x_scales, _ = quantised
    parts = []
    for segment in weight.segments:
        q, s, o = kquants.segment_terms(segment)
        q, s = q[: segment.rows], s[: segment.rows]
        grouped = q.view(segment.rows, -1, GROUP_SIZE)
        if o is not None:
            parts.append(_a8_product(x, grouped, s, o[: segment.rows], quantised))
            continue
        halves = x_codes.unflatten(-1, (2, 16))  # type: ignore[no-untyped-call]
        dots = torch.einsum("mghk,nghk->mngh", halves, grouped.unflatten(-1, (2, 16)))  # type: ignore[no-untyped-call]
        terms = dots * (s.view(segment.rows, -1, 2)[None] * x_scales[:, None, :, None])
        out = terms.sum((-2, -1)).to(x.dtype)
        parts.append(out.reshape(*x.shape[:-1], segment.rows))
    return torch.cat(parts, dim=-1)
