"""Quantised weights: int8 and int4 weight-only layouts, their conversion, and the modules
that multiply with them.

Owns: the `quantize` choice ("auto", "none", "int8", "int4") and which format each weight
takes (`target_format`); `Int8Weight` (groups of 32 inputs, or whole rows where K is not a
multiple of 32: w = q * s, q int8) and `Int4Weight` (groups of 32 inputs: w = q * s + o, q in
[0, 15]); their conversion from float tensors (`from_float`; from GGUF blocks:
`cellbatch.model.gguf_blocks`); the kernels' panel layouts (`pack`; the ops' torch
implementations, which read them, are in `cellbatch.model.quantized_torch`); the
`activations` choice (`resolve_activations`); `QuantizedLinear`, `QuantizedEmbedding` and
`install`, which puts them into a PackedTransformer (what a model's weights then are, in
words and bytes: `cellbatch.model.weights_summary`).
Promises:
- (gguf_blocks) Q4_0, Q4_1 and Q4_K blocks map onto Int4Weight exactly: scale d (Q4_K:
  d * sc), offset m (Q4_0: -8d; Q4_K: -dmin * mn), all exact in float32, so the dequantised
  weights equal gguf's own; Q8_0 blocks map onto Int8Weight exactly (scale d). Every other
  kind is requantised by `from_float`. Scales and offsets are float32 values; the kernels'
  layout holds them as float16 when they all are float16 values (GGUF's Q4_0/Q4_1/Q8_0 are).
- Conversion runs one tensor at a time in row chunks: the model never exists in float32.
- A row's product never depends on the other rows of the call or on the thread count: the
  compiled kernel sums each output in input order whatever the rows and threads, and the
  dequantising fallback pads its calls like the float path (quantized_torch).
- Activations stay in the model's dtype (the compiled kernel computes float32 activations
  in float32, and bf16 ones, on CPUs with AVX512-BF16, with the bf16 dot-product
  instructions), except where `resolve_activations` gives "int8": then the products of
  a8_products(dtype) quantise their inputs per group of 32 (`int4_matmul_a8`, and for the int8
  head `int8_matmul_a8` over its own layout, `pack_a8`), as llama.cpp's Q8_1 blocks do,
  and multiply with integer dot products (VPDPBUSD on AVX512-VNNI, VPMADDUBSW on AVX2).
Never: quantises norms, biases or RoPE tables; reads files (the loader hands it arrays).

Kernels: with the compiled ops (kernels/quantized_matmul.cpp) a panel of 16 outputs is
dequantised input by input, in registers for calls of up to 3 rows, else once per 256
inputs into an L1 buffer that every row of the call runs over: a one-row decode reads a
quarter (int4) or half (int8) of float weights' bytes, which is what bounds it.
With bf16 activations on a CPU with AVX512-BF16 (kernels/quantized_bf16.cpp) the codes,
which bf16 holds exactly, go through VDPBF16PS and the scales come in once per group of
32 inputs. The torch ops (other devices, no compiled library) rebuild the float weight
for each call: exact, available everywhere, slow.
With int8 activations (kernels/quantized_a8.cpp on AVX512-VNNI, quantized_a8_avx2.cpp on
AVX2) VPDPBUSD takes 64 products per instruction where VDPBF16PS takes 32, so from a few
rows up they beat the bf16 path. They round the inputs, and the weights' offsets multiply
the quantised inputs' sums (llama.cpp's Q8_1 s), so an output's error is the inputs'
rounding times the weights. `A8_PRODUCTS` names the products that take them: in bf16 qkv,
o_proj and gate_up, whose inputs follow a norm or attention, and the LM head; in float32
(the AVX2 CPUs' speed mode) gate_up and the head, which hold most of the time the int8
inputs save. Each set stays within 1% of the file's own dequantised model by
`benchmarks/perplexity.py`, for int4 and int8 weights alike. The figures:
docs/benchmarks.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from cellbatch.model.cpu import (
    amx_switch,
    cpu_dtype,
    cpu_has_int8_products,
)
from cellbatch.types import ACTIVATION_CHOICES, QUANTIZE_CHOICES, InvalidArgumentError


class DecoderModel(Protocol):
    """What `install` and `describe` read of a PackedTransformer (a protocol, because
    transformer.py imports this module through ops.py: importing it back is a cycle)."""

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def ops(self) -> Any: ...
    @property
    def embed(self) -> nn.Module: ...
    @property
    def lm_head(self) -> nn.Module | None: ...
    @property
    def layers(self) -> nn.ModuleList: ...
    def get_submodule(self, target: str) -> nn.Module: ...
    def modules(self) -> Iterator[nn.Module]: ...


class ProductOps(Protocol):
    """The part of an ops table (`cellbatch.model.ops.Ops`, which sits above this module
    and imports its torch products) that a quantised product calls."""

    # Read-only, as the table's (frozen) fields are.
    @property
    def kind(self) -> str: ...

    @property
    def int4_matmul(self) -> Callable[..., torch.Tensor]: ...

    @property
    def int4_matmul_a8(self) -> Callable[..., torch.Tensor]: ...

    @property
    def int8_matmul(self) -> Callable[..., torch.Tensor]: ...

    @property
    def int8_matmul_a8(self) -> Callable[..., torch.Tensor]: ...


log = logging.getLogger(__name__)

GROUP_SIZE = 32
# GGUF kinds each format keeps (what `quantize="auto"` maps them to); other kinds load as float.
GGUF_INT4_KINDS = frozenset({"Q4_0", "Q4_1", "Q4_K"})
GGUF_INT8_KINDS = frozenset({"Q8_0"})
GGUF_FLOAT_KINDS = frozenset({"F32", "F16", "BF16", "F64"})
# GGUF kinds kept as they are, in their own blocks (`cellbatch.model.kquants`; a kind's
# place here is its id in that layout), with int8 inputs.
GGUF_KEPT_KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
PANEL = 16  # output features per panel of the kernels' layouts
# The products that take int8 activations when those are chosen, by the model's dtype: int4
# projections and the int8 LM head (see the module's docstring for the perplexity that
# chose each set). Other dtypes take float32's.
A8_PRODUCTS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("qkv", "o_proj", "gate_up", "lm_head"),
    torch.float32: ("gate_up", "lm_head"),
}


def a8_products(dtype: torch.dtype) -> tuple[str, ...]:
    """The products that quantise their inputs to int8 in a model computing in `dtype`,
    when its activations are "int8"."""
    return A8_PRODUCTS.get(dtype, A8_PRODUCTS[torch.float32])


def _checked(value: str, choices: tuple[str, ...], option: str, meaning: str) -> str:
    """`value` if it is one of `choices`; else an error that lists them and what they mean,
    raised before a model loads."""
    if value not in choices:
        raise InvalidArgumentError(
            f"unknown {option} {value!r}; use one of {', '.join(choices)} ({meaning})"
        )
    return value


def resolve_quantize(quantize: str) -> str:
    """The checked `quantize` choice."""
    meaning = "auto keeps a GGUF file's precision class and loads other models as float"
    return _checked(quantize, QUANTIZE_CHOICES, "quantize", meaning)


def check_activations(choice: str) -> str:
    """The checked `activations` choice (and CELLBATCH_AMX, which the int8-input products
    read: `cpu.amx_switch`)."""
    amx_switch()
    meaning = "int8 quantises the int4 products' inputs, float keeps the model's dtype"
    return _checked(choice, ACTIVATION_CHOICES, "activations", meaning)


def resolve_activations(choice: str, ops_kind: str, dtype: torch.dtype) -> str:
    """What the quantised products of a8_products(dtype) do with their inputs: "int8"
    (quantised per group of 32) or "float" (the model's dtype). "auto" takes int8 with the
    compiled kernels where they have a vector int8 path (AVX512-VNNI, or AVX2) and the
    model computes in the dtype that `auto` picks on this CPU (the speed mode: bf16 where
    bf16 products are native, else float32); a model asked for another dtype (float32 on
    a bf16 CPU, for precision) keeps float inputs, as does every other case."""
    if check_activations(choice) != "auto":
        return choice
    fast = ops_kind == "compiled" and dtype == cpu_dtype() and cpu_has_int8_products()
    return "int8" if fast else "float"


def target_format(
    quantize: str,
    role: str,
    gguf_kinds: list[str] | None,
    activations: str = "auto",
    a8: str = "int8",
) -> str:
    """The format ("none", "int8", "int4" or "kquant") of one of the model's weights.

    `role`: "projection", "lm_head" or "embedding"; `gguf_kinds`: the GGUF kinds of the
    tensors concatenated into it (None for a checkpoint that is not GGUF); `activations`
    as asked for, `a8` as resolved (resolve_activations). "auto" keeps a GGUF file's
    class: any mix of GGUF_KEPT_KINDS (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: Q4_0 and
    Q4_K_M files alike) -> "kquant", the blocks kept as they are (`cellbatch.model.kquants`,
    every product with int8 inputs, as llama.cpp's), except that Q4_0 and Q4_1 alone,
    which int4 holds exactly, stay int4 where the products' inputs resolved to float (a
    model asked for float32 on a bf16 CPU keeps float inputs); Q8_0 -> int8; float kinds
    and kinds it cannot keep -> float. With `activations` "float" asked for, nothing is
    kept as "kquant" (its products quantise their inputs): Q4_0, Q4_1 and Q4_K -> int4
    (with float inputs) and the other kinds load as float. A float checkpoint
    stays float. The embedding is never int4 (its rows are gathered, not multiplied), and
    with "int4" asked for, the LM head takes int8, as llama.cpp's 4-bit files keep their
    output tensor at 6-8 bits.
    """
    if quantize == "auto":
        if gguf_kinds is None:
            return "none"
        plain_int4 = GGUF_INT4_KINDS - {"Q4_K"}
        if a8 != "int8" and all(kind in plain_int4 for kind in gguf_kinds):
            chosen = "int4"
        elif activations != "float" and all(kind in GGUF_KEPT_KINDS for kind in gguf_kinds):
            return "kquant"
        elif all(kind in GGUF_INT4_KINDS for kind in gguf_kinds):
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
    """w[n, k] = codes[n, k] * scale[n, k // (K / G)]; codes int8 [N, K], scale float32
    [N, G]: one scale per group of K / G inputs (GROUP_SIZE where K allows, else the row)."""

    codes: torch.Tensor
    scale: torch.Tensor
    format = "int8"

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.codes.shape  # codes are [N, K]
        return rows, cols

    @property
    def in_groups(self) -> bool:
        """Whether its scales come per group of GROUP_SIZE inputs (not per row)."""
        return bool(self.scale.shape[1] * GROUP_SIZE == self.codes.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.codes.shape
        groups = self.scale.shape[1]
        grouped = self.codes.view(rows, groups, cols // groups).float()
        return (grouped * self.scale.float()[..., None]).view(rows, cols).to(dtype)

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        return Int8Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]))


@dataclass
class Int4Weight:
    """w[n, k] = codes[n, k] * scale[n, k // 32] + offset[n, k // 32]; codes uint8 [N, K] in
    [0, 15], scale and offset float32 [N, K / 32]."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    format = "int4"

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.codes.shape  # codes are [N, K]
        return rows, cols

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.codes.shape
        grouped = self.codes.view(rows, cols // GROUP_SIZE, GROUP_SIZE).float()
        out = grouped * self.scale.float()[..., None] + self.offset.float()[..., None]
        return out.view(rows, cols).to(dtype)

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        return Int4Weight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.offset for p in parts]),
        )


QuantizedWeight = Int8Weight | Int4Weight


def cat(parts: list[Any]) -> Any:
    """Weights of one format (Int8Weight, Int4Weight, kquants.KQuantWeight) concatenated
    along their output rows (q/k/v into qkv), by their class's `cat`."""
    if len(parts) <= 1:
        return parts[0]
    return type(parts[0]).cat(parts)


# -- conversion --------------------------------------------------------------------


def from_float(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Round-to-nearest quantisation of a float [N, K] weight: int8 symmetric per group of
    32 inputs (per row when K is not a multiple of 32), or int4 asymmetric per group of 32
    (offset: the group's min; codes 0..15 span it to its max). Scales and offsets are
    rounded to float16 values first where float16 holds them to its precision. An int4
    request for K not a multiple of 32 gives int8."""
    if fmt == "int4" and weight.shape[1] % GROUP_SIZE == 0:
        return _int4_from_float(weight)
    return _int8_from_float(weight)


def _int8_from_float(weight: torch.Tensor) -> Int8Weight:
    rows, cols = weight.shape
    size = GROUP_SIZE if cols % GROUP_SIZE == 0 else cols
    groups = weight.float().reshape(rows, cols // size, size)
    (scale,) = _half_values(groups.abs().amax(dim=-1) / 127)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(groups / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(codes.reshape(rows, cols), scale)


def _half_values(scale: torch.Tensor, *offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(scale, *offsets) rounded to float16 values, which the kernels store in half the
    bytes, when that costs no more than float16's precision of a quantisation step: every
    scale zero or in float16's normal range and every offset within its range (a subnormal
    offset moves by at most 2^-25, under 2^-11 of any such scale); else as they are."""
    magnitude = scale.abs()
    normal = (magnitude >= torch.finfo(torch.float16).tiny) & (magnitude <= 65504)
    fits = bool(((magnitude == 0) | normal).all())
    if not (fits and all(bool((offset.abs() <= 65504).all()) for offset in offsets)):
        return (scale, *offsets)
    return tuple(value.half().float() for value in (scale, *offsets))


def _int4_from_float(weight: torch.Tensor) -> Int4Weight:
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale, low = _half_values((high - low) / 15, low)
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round((groups - low[..., None]) * inverse[..., None]).clamp_(0, 15)
    return Int4Weight(codes.to(torch.uint8).reshape(rows, cols), scale, low)


# -- the kernels' panel layouts --------------------------------------------------------
# Output features go in panels of PANEL (the last one padded with zero weights), each panel's
# codes input-major, so that one input's codes for the whole panel lie together:
# - int4: codes int32 [P, K / 8, PANEL], word (p, b, c) holding the codes of feature
#   PANEL p + c for inputs 8b .. 8b + 7 (input 8b + i in bits 4i .. 4i + 3); scales float32
#   [P, K / 32, 2, PANEL] (each group's scale, then its offset);
# - int8: codes int8 [P, K, PANEL]; scales float32 [P, G, PANEL];
# scales in float16 instead where they are float16 values (GGUF's are; `from_float` rounds
# them so when it can), which cuts the bytes read per int4 weight from 0.75 to 0.625.
# kernels/quantized_matmul.cpp reads them; the torch implementations below unpack them.


def _panels(tensor: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [ceil(N / PANEL), PANEL, ...], zero rows appended."""
    pad = -tensor.shape[0] % PANEL
    if pad:
        tensor = torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])])
    return tensor.view(-1, PANEL, *tensor.shape[1:])


def pack(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's (codes, scales) in its kernel layout; the scales float16 when they are all
    float16 values, else float32."""
    if isinstance(weight, Int8Weight):
        codes = _panels(weight.codes).transpose(1, 2).contiguous()
        return codes, _compact(_panels(weight.scale.float()).transpose(1, 2).contiguous())
    codes = _panels(weight.codes.to(torch.int64))
    panels, _, cols = codes.shape
    nibbles = codes.view(panels, PANEL, cols // 8, 8) << (4 * torch.arange(8))
    words = nibbles.sum(dim=-1)  # the nibbles' bits do not overlap: the sum is their OR
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    scale, offset = _panels(weight.scale.float()), _panels(weight.offset.float())
    scales = torch.stack([scale.transpose(1, 2), offset.transpose(1, 2)], dim=2)
    return words.transpose(1, 2).contiguous(), _compact(scales.contiguous())


def pack_a8(weight: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight's (codes, scales) for `int8_matmul_a8`: codes int8 [P, K / 4, PANEL,
    4], each output's codes four inputs together, the operand of VPDPBUSD; scales as
    `pack`'s. Only for groups of GROUP_SIZE inputs (K a multiple of it)."""
    cols = weight.shape[1]
    if not weight.in_groups:
        raise ValueError(f"int8 activations need groups of {GROUP_SIZE} inputs, not {cols}")
    panels = _panels(weight.codes).view(-1, PANEL, cols // 4, 4)
    _, scales = pack(weight)
    return panels.permute(0, 2, 1, 3).contiguous(), scales


def _compact(scales: torch.Tensor) -> torch.Tensor:
    """float32 scales as float16 if that holds them exactly."""
    half = scales.half()
    return half if torch.equal(half.float(), scales) else scales


# -- modules ---------------------------------------------------------------------------


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class QuantizedLinear(nn.Module):
    """y = x w^T (+ bias) for an Int8Weight or Int4Weight, in the input's dtype, by the op
    `int4_matmul` or `int8_matmul` of the model's ops table (`int4_matmul_a8` or
    `int8_matmul_a8` with `activations` "int8", which an int8 weight takes only in groups of
    GROUP_SIZE inputs): the compiled kernel ("compiled"), or the torch implementation that
    rebuilds the float weight for each call ("dequantize"). The weight is held once,
    packed in its op's panel layout (`pack`, `pack_a8`)."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        ops: ProductOps,
        activations: str = "float",
    ) -> None:
        super().__init__()
        self.format = weight.format
        self.out_features, self.in_features = weight.shape
        grouped = isinstance(weight, Int4Weight) or weight.in_groups
        self.activations = activations if grouped else "float"
        self.kernel = "compiled" if ops.kind == "compiled" else "dequantize"
        # The compiled kernel's rows do not depend on the call's other rows, so the model
        # need not pad its products (PackedTransformer.pack_linears).
        self.row_invariant = self.kernel == "compiled"
        a8 = self.activations == "int8"
        if isinstance(weight, Int8Weight):
            codes, scales = pack_a8(weight) if a8 else pack(weight)
            self.op = "int8_matmul_a8" if a8 else "int8_matmul"
        else:
            codes, scales = pack(weight)
            self.op = "int4_matmul_a8" if a8 else "int4_matmul"
        self.matmul: Callable[..., torch.Tensor] = getattr(ops, self.op)
        self.codes, self.scales = _param(codes), _param(scales)
        self.bias = None if bias is None else _param(bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.codes, self.scales, self.out_features)
        return out if self.bias is None else out + self.bias


class QuantizedEmbedding(nn.Module):
    """Token rows gathered from an int8 QuantizedLinear's panels (shared with a tied LM
    head) and dequantised in the model's dtype."""

    def __init__(self, linear: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        if linear.format != "int8":
            raise ValueError("a quantised embedding is int8")
        self.codes, self.scales = linear.codes, linear.scales
        self.format = linear.format
        self.dtype = dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        panel, column = tokens // PANEL, tokens % PANEL
        # [..., K]: `pack`'s codes [P, K, PANEL], or `pack_a8`'s [P, K / 4, PANEL, 4]
        codes = self.codes[panel, :, column]
        if codes.dim() > tokens.dim() + 1:
            codes = codes.flatten(-2)
        scales = self.scales[panel, :, column].float()  # [..., G]
        # torch leaves Tensor.unflatten unannotated.
        grouped: torch.Tensor = (
            codes.unflatten(-1, (scales.shape[-1], -1)).float()  # type: ignore[no-untyped-call]
            * scales[..., None]
        )
        return grouped.flatten(-2).to(self.dtype)


def install(
    model: DecoderModel, weights: dict[str, QuantizedWeight], activations: str = "float"
) -> None:
    """Puts quantised weights into a PackedTransformer whose other weights are loaded:
    "layers.{i}.{name}.weight" replaces that projection (its bias kept), "lm_head.weight"
    the head, "embed.weight" the embedding (and the head too, when tied). Their products
    use the model's ops table; with `activations` "int8" (resolve_activations' answer)
    those of a8_products(model.dtype) quantise their inputs."""
    chosen = a8_products(model.dtype)

    def takes(name: str) -> str:
        return activations if name in chosen else "float"

    for target, weight in weights.items():
        path = target.removesuffix(".weight")
        if path == "embed":
            # A tied head's layout is the embedding's too (QuantizedEmbedding reads both).
            tied = model.lm_head is None
            linear = QuantizedLinear(weight, None, model.ops, takes("lm_head" if tied else path))
            # setattr: the protocol reads these; the module takes the new submodules.
            setattr(model, "embed", QuantizedEmbedding(linear, model.dtype))  # noqa: B010
            if tied:
                setattr(model, "lm_head", linear)  # noqa: B010
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, name)
        linear = QuantizedLinear(weight, getattr(old, "bias", None), model.ops, takes(name))
        setattr(parent, name, linear)
