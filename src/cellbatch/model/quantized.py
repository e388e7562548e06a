"""Quantised weights: int8 and int4 weight-only layouts, their conversion, and the modules
that multiply with them.

Owns: the `quantize` choice ("auto", "none", "int8", "int4") and which format each weight
takes (`target_format`); `Int8Weight` (one scale per output row: w = q * s, q in
[-127, 127]) and `Int4Weight` (groups of 32 inputs: w = (q - 8) * s + z, q in [0, 15]); their
conversion from GGUF blocks and from float tensors (`from_gguf`, `from_float`); the kernel
choice per CPU (`weight_kernel`); `QuantizedLinear`, `QuantizedEmbedding` and `install`,
which puts them into a PackedTransformer; `describe`, what a model's weights are.
Promises:
- Q4_0, Q4_1 and Q4_K blocks map onto Int4Weight exactly: scale d (Q4_K: d * sc), zero
  m + 8d (Q4_0: 0; Q4_K: 8 d sc - dmin m), so its float32 dequantisation equals gguf's own
  to the rounding of the zero (≤ 1 ulp). Q8_0 and every other kind are requantised per row.
- Conversion runs one tensor at a time in row chunks: the model never exists in float32.
- A row's product never depends on the other rows of the call: PyTorch's weight-only
  kernels compute each output row on its own, and the dequantising fallback pads its calls
  to `FALLBACK_MIN_ROWS` rows like the float path.
Never: quantises activations (they stay float; the PyTorch kernels take them as bf16),
norms, biases or RoPE tables; reads files (the loader hands it arrays).

Kernels, measured on an AVX2 CPU (AMD EPYC, 2 threads, torch 2.13.0;
benchmarks/quantized.py): `aten._weight_int4pack_mm_for_cpu` and `aten._weight_int8pack_mm`
are vectorised for bf16 activations, scales and outputs only; with float32 they run scalar
code 50-200x slower. So on x86 with AVX2 or AVX-512 the products run in bf16 (inputs
rounded to bf16, scales and zeros stored as bf16, outputs bf16 widened back); elsewhere the
fallback dequantises the weight for each call (slow, but exact and available everywhere).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cellbatch.types import InvalidArgumentError

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("none", "int8", "int4")
QUANTIZE_CHOICES = ("auto", *WEIGHT_FORMATS)
GROUP_SIZE = 32
# GGUF kinds each format keeps (what `quantize="auto"` maps them to); other kinds load as float.
GGUF_INT4_KINDS = frozenset({"Q4_0", "Q4_1", "Q4_K"})
GGUF_INT8_KINDS = frozenset({"Q8_0"})
GGUF_FLOAT_KINDS = frozenset({"F32", "F16", "BF16", "F64"})
# The dequantising fallback multiplies with F.linear, whose fp32 GEMMs round calls of fewer
# rows differently (see transformer.MIN_GEMM_ROWS).
FALLBACK_MIN_ROWS = 16
_CHUNK_ROWS = 4096  # rows converted at a time: bounds the float32 scratch of a conversion
_KERNEL_CPUS = ("AVX2", "AVX512")


def resolve_quantize(quantize: str) -> str:
    """The checked `quantize` choice; anything else is refused before a model loads."""
    if quantize not in QUANTIZE_CHOICES:
        raise InvalidArgumentError(
            f"unknown quantize {quantize!r}; use one of {', '.join(QUANTIZE_CHOICES)} "
            "(auto keeps a GGUF file's precision class and loads other models as float)"
        )
    return quantize


def target_format(quantize: str, role: str, gguf_kinds: list[str] | None) -> str:
    """The format ("none", "int8" or "int4") of one of the model's weights.

    `role`: "projection", "lm_head" or "embedding"; `gguf_kinds`: the GGUF kinds of the
    tensors concatenated into it (None for a checkpoint that is not GGUF). "auto" keeps a
    GGUF file's class (Q4_0/Q4_1/Q4_K -> int4, Q8_0 -> int8, float kinds and kinds it
    cannot keep -> float); a float checkpoint stays float. The embedding is never int4 (its
    rows are gathered, not multiplied), and with "int4" asked for, the LM head takes int8,
    as llama.cpp's 4-bit files keep their output tensor at 6-8 bits.
    """
    if quantize == "auto":
        if gguf_kinds is None:
            return "none"
        if all(kind in GGUF_INT4_KINDS for kind in gguf_kinds):
            chosen = "int4"
        elif all(kind in GGUF_INT4_KINDS | GGUF_INT8_KINDS for kind in gguf_kinds):
            chosen = "int8"
        else:
            return "none"
    else:
        chosen = quantize
        if role == "lm_head" and chosen == "int4":
            chosen = "int8"
    if role == "embedding" and chosen == "int4":
        chosen = "int8"
    return chosen


# -- layouts -----------------------------------------------------------------------


@dataclass
class Int8Weight:
    """w[n, k] = codes[n, k] * scale[n]; codes int8 [N, K], scale float32 [N]."""

    codes: torch.Tensor
    scale: torch.Tensor
    format = "int8"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.float() * self.scale.float()[:, None]).to(dtype)

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        return Int8Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]))


@dataclass
class Int4Weight:
    """w[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]; codes uint8
    [N, K] in [0, 15], scale and zero float32 [N, K / 32]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    format = "int4"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.codes.shape
        grouped = self.codes.view(rows, cols // GROUP_SIZE, GROUP_SIZE).float() - 8
        out = grouped * self.scale.float()[..., None] + self.zero.float()[..., None]
        return out.view(rows, cols).to(dtype)

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        return Int4Weight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
        )


QuantizedWeight = Int8Weight | Int4Weight


def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one format concatenated along their output rows (q/k/v into qkv)."""
    return type(parts[0]).cat(parts) if len(parts) > 1 else parts[0]


# -- conversion --------------------------------------------------------------------


def from_float(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Round-to-nearest quantisation of a float [N, K] weight: int8 symmetric per row, or
    int4 asymmetric per group of 32 (the group's min and max near codes 0 and 15). Scales
    and zeros are bf16 values, so PyTorch's kernels hold them exactly. An int4 request for
    K not a multiple of 32 gives int8."""
    if fmt == "int4" and weight.shape[1] % GROUP_SIZE == 0:
        return _int4_from_float(weight)
    return _int8_from_float(weight)


def _bf16_values(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _int8_from_float(weight: torch.Tensor) -> Int8Weight:
    w = weight.float()
    scale = _bf16_values(w.abs().amax(dim=1) / 127)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(codes, scale)


def _int4_from_float(weight: torch.Tensor) -> Int4Weight:
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = _bf16_values((high - low) / 15)
    zero = _bf16_values(low + 8 * scale)
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round((groups - zero[..., None]) * inverse[..., None] + 8).clamp_(0, 15)
    return Int4Weight(codes.to(torch.uint8).reshape(rows, cols), scale, zero)


def from_gguf(data: np.ndarray, kind: str, fmt: str) -> QuantizedWeight:
    """One GGUF tensor's data (rows in torch's order: [rows, bytes] for block kinds,
    [rows, cols] for float kinds) in format `fmt`, converted `_CHUNK_ROWS` rows at a time.
    Q4_0/Q4_1/Q4_K to int4 take the blocks as they are; anything else is dequantised
    (gguf's own dequantiser) chunk by chunk and quantised by `from_float`."""
    direct = fmt == "int4" and kind in GGUF_INT4_KINDS
    parts = [
        _int4_from_blocks(chunk, kind) if direct else from_float(_dequantize(chunk, kind), fmt)
        for chunk in _row_chunks(data)
    ]
    return cat(parts)


def _row_chunks(data: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, data.shape[0], _CHUNK_ROWS):
        yield data[start : start + _CHUNK_ROWS]


def _dequantize(chunk: np.ndarray, kind: str) -> torch.Tensor:
    import gguf

    array = gguf.quants.dequantize(np.asarray(chunk), gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def _halves(array: np.ndarray, offset: int) -> np.ndarray:
    """float16 values stored as 2 bytes at `offset` of each block -> float32 [..]."""
    raw = np.ascontiguousarray(array[..., offset : offset + 2])
    return raw.view(np.float16)[..., 0].astype(np.float32)


def _int4_from_blocks(blocks: np.ndarray, kind: str) -> Int4Weight:
    """Q4_0 (d, 16 bytes), Q4_1 (d, m, 16 bytes) or Q4_K (d, dmin, 12 bytes of 6-bit
    sub-block scales and mins, 128 bytes) blocks of [rows] rows -> Int4Weight.

    Q4_0/Q4_1: byte j of a block holds element j (low nibble) and j + 16 (high); w = d q + m
    (Q4_0: d (q - 8)). Q4_K: 256 elements in 8 sub-blocks of 32; each 32 bytes hold two
    sub-blocks (low nibbles, then high ones); w = d sc q - dmin mn.
    """
    rows = blocks.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        quants = 4 if kind == "Q4_1" else 2
        b = blocks.reshape(rows, -1, quants + 16)
        d = _halves(b, 0)
        zero = _halves(b, 2) + 8 * d if kind == "Q4_1" else np.zeros_like(d)
        qs = b[..., quants:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        scale = d
    elif kind == "Q4_K":
        b = blocks.reshape(rows, -1, 144)
        d, dmin = _halves(b, 0), _halves(b, 2)
        sc, mn = _q4k_scales_and_mins(b[..., 4:16])
        scale = (d[..., None] * sc).reshape(rows, -1)
        zero = 8 * scale - (dmin[..., None] * mn).reshape(rows, -1)
        qs = b[..., 16:].reshape(rows, -1, 4, 32)
        codes = np.stack([qs & 0x0F, qs >> 4], axis=-2)
    else:
        raise ValueError(f"{kind} blocks cannot be kept as int4")
    return Int4Weight(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32)),
    )


def _q4k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of a Q4_K block -> (scales, mins) float32 [.., 8], 6 bits each: bytes
    0-3 and 4-7 hold sub-blocks 0-3's scale and min in their low 6 bits and the top 2 bits
    of sub-blocks 4-7's; bytes 8-11 hold the low 4 bits of sub-blocks 4-7's (scale in the
    low nibble, min in the high one)."""
    first, second, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([first & 63, (low & 0x0F) | ((first >> 6) << 4)], axis=-1)
    mins = np.concatenate([second & 63, (low >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


# -- kernels and modules -------------------------------------------------------------


def weight_kernel(device: str | torch.device = "cpu") -> str:
    """The kernel for quantised products here: "torch" (PyTorch's int8/int4 weight-only
    kernels, bf16 activations) on x86 CPUs with AVX2 or AVX-512, where they are vectorised;
    "dequantize" anywhere else."""
    if torch.device(device).type != "cpu":
        return "dequantize"
    return "torch" if torch.backends.cpu.get_cpu_capability() in _KERNEL_CPUS else "dequantize"


def _kernel_takes(weight: QuantizedWeight) -> bool:
    """Shapes PyTorch's kernels handle: int4 output blocks of 16 rows; the int8 kernel
    steps and loads its inputs 16 at a time (aligned loads)."""
    rows, cols = weight.shape
    return rows % 16 == 0 if weight.format == "int4" else cols % 16 == 0


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class QuantizedLinear(nn.Module):
    """y = x w^T (+ bias) for an Int8Weight or Int4Weight, in the input's dtype.

    kernel "torch": int4 weights packed once by `_convert_weight_to_int4pack_for_cpu` (a
    CPU-specific layout) with scales and zeros as bf16 [K/32, N, 2]; int8 codes as they are
    with bf16 scales; inputs go in as bf16. kernel "dequantize": codes kept (int4 two to a
    byte), the weight rebuilt for each call in the input's dtype and multiplied by F.linear
    on at least FALLBACK_MIN_ROWS rows. Shapes the kernels do not take use the fallback.
    """

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, kernel: str) -> None:
        super().__init__()
        self.format = weight.format
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel if kernel == "torch" and _kernel_takes(weight) else "dequantize"
        self.bias = None if bias is None else _param(bias.detach())
        if self.kernel == "torch" and isinstance(weight, Int4Weight):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weight.codes.to(torch.int32), 1
            )
            self.codes = _param(packed)
            self.scale = _param(
                torch.stack([weight.scale.t(), weight.zero.t()], dim=-1)
                .to(torch.bfloat16)
                .contiguous()
            )
        elif self.kernel == "torch":
            self.codes = _param(weight.codes.contiguous())
            self.scale = _param(weight.scale.to(torch.bfloat16))
        elif isinstance(weight, Int4Weight):
            pairs = weight.codes.view(self.out_features, -1, 2)
            self.codes = _param((pairs[..., 0] | (pairs[..., 1] << 4)).contiguous())
            self.scale = _param(weight.scale)
            self.zero = _param(weight.zero)
        else:
            self.codes = _param(weight.codes.contiguous())
            self.scale = _param(weight.scale)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The fallback's float weight [N, K] (kernel "dequantize" only)."""
        if self.format == "int8":
            return Int8Weight(self.codes, self.scale).dequantize(dtype)
        codes = torch.stack([self.codes & 0x0F, self.codes >> 4], dim=-1)
        return Int4Weight(codes.view(self.out_features, -1), self.scale, self.zero).dequantize(
            dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "torch":
            rows = x.to(torch.bfloat16).contiguous()
            if rows.data_ptr() % 64:  # the int8 kernel's loads need aligned rows
                rows = rows.clone()
            if self.format == "int4":
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    rows, self.codes, GROUP_SIZE, self.scale
                )
            else:
                out = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scale)
            out = out.to(x.dtype)
        else:
            count = x.shape[0]
            pad = FALLBACK_MIN_ROWS - count
            padded = F.pad(x, (0, 0, 0, pad)) if pad > 0 else x
            out = F.linear(padded, self.dense(x.dtype))[:count]
        return out if self.bias is None else out + self.bias


class QuantizedEmbedding(nn.Module):
    """Token rows gathered from an int8 weight (shared with a tied LM head) and widened to
    the model's dtype."""

    def __init__(self, linear: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        if linear.format != "int8":
            raise ValueError("a quantised embedding is int8")
        self.codes, self.scale = linear.codes, linear.scale
        self.format = linear.format
        self.dtype = dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.codes[tokens].to(torch.float32) * self.scale[tokens, None].to(torch.float32)
        return rows.to(self.dtype)


def install(model: nn.Module, weights: dict[str, QuantizedWeight], kernel: str) -> None:
    """Puts quantised weights into a PackedTransformer whose other weights are loaded:
    "layers.{i}.{name}.weight" replaces that projection (its bias kept), "lm_head.weight"
    the head, "embed.weight" the embedding (and the head too, when tied)."""
    for target, weight in weights.items():
        path = target.removesuffix(".weight")
        if path == "embed":
            linear = QuantizedLinear(weight, None, kernel)
            model.embed = QuantizedEmbedding(linear, model.dtype)
            if model.lm_head is None:
                model.lm_head = linear
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, name)
        setattr(parent, name, QuantizedLinear(weight, getattr(old, "bias", None), kernel))


@dataclass(frozen=True)
class WeightsSummary:
    """What a model's weights are: `format` in words ("int4, embedding int8, lm_head
    int8"; a float model says its dtype), `formats` per role, `kernel` of the quantised
    products ("none" without any), and `bytes_by_format`."""

    format: str
    formats: dict[str, str]
    kernel: str
    bytes_by_format: dict[str, int]


def describe(model: nn.Module) -> WeightsSummary:
    """The WeightsSummary of a PackedTransformer (shared tensors counted once)."""
    float_format = str(model.dtype).removeprefix("torch.")

    def format_of(module: nn.Module | None) -> str:
        return getattr(module, "format", float_format)

    first = model.layers[0] if len(model.layers) else None
    formats = {
        "projections": format_of(getattr(first, "qkv", None)),
        "embedding": format_of(model.embed),
        "lm_head": format_of(model.embed if model.lm_head is None else model.lm_head),
    }
    main = formats["projections"]
    words = main + "".join(f", {role} {fmt}" for role, fmt in formats.items() if fmt != main)
    kernels = {m.kernel for m in model.modules() if isinstance(m, QuantizedLinear)}
    counted: set[int] = set()
    by_format: dict[str, int] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in counted:
                continue
            counted.add(id(param))
            quantized = name != "bias" and hasattr(module, "format")
            fmt = module.format if quantized else str(param.dtype).removeprefix("torch.")
            by_format[fmt] = by_format.get(fmt, 0) + param.numel() * param.element_size()
    return WeightsSummary(words, formats, "+".join(sorted(kernels)) or "none", by_format)
