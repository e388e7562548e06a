"""GGUF block formats kept as they are: Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 (and Q4_0, Q4_1 beside
them), held in the kernels' panel layout, multiplied by `kquant_matmul_a8` with int8 inputs.

Owns: what a kept kind's numbers are (`KIND_IDS`), reading them out of GGUF blocks
(`from_blocks`), the panel layout that `kernels/quantized_kq*.cpp` read (`pack`), reading
it back (`unpack`, `dense`: the torch implementation and the tests use them),
`KQuantWeight` and the modules that multiply and gather with it (`KQuantLinear`,
`KQuantEmbedding`, `install`).
Promises:
- Every kept weight is w = s q + o per sub-group of inputs, with codes q and the file's own
  scales: Q4_0 s = d, o = -8d; Q4_1 s = d, o = m; Q5_0 s = d, o = -16d; Q5_1 s = d, o = m
  (groups of 32, q 4 or 5 bits); Q4_K and Q5_K s = d sc, o = -dmin mn (groups of 32 inside
  blocks of 256, sc and mn 6-bit integers, q 4 or 5 bits); Q6_K s = d sc, o = -32 s (groups
  of 16, sc int8, q 6 bits). `dense` gives gguf's own dequantised values bit for bit (each
  s is exact in float32, and each value is rounded once, in gguf's order).
- The layout is about as large as the file: Q4_K 4.625 bits per weight (the file 4.5),
  Q5_K 5.625 (5.5), Q6_K, Q4_0, Q4_1, Q5_0 and Q5_1 as the file (6.5625, 4.5, 5, 5.5, 6).
- A weight whose parts are of different kinds (q, k and v of mixed kinds in one qkv) is one
  product: its rows are segments, each of one kind, one after another.
Never: requantises (a kind not kept here is not this module's), or reads files.

The layout (kernels/quantized_kq.h reads the same): `codes` uint8 starts with a header of
int32 words [MAGIC, segments, in_features, 0, then per segment: kind id, rows, byte offset
of its codes, byte offset of its scales], 64-byte aligned; `scales` is uint8. A segment's
rows go in panels of PANEL outputs (the last one padded with zero weights); per panel and
group of 32 inputs its codes take
- 256 bytes of nibbles: word (b, c), b = 0..3, c = 0..15, byte j holding the low 4 bits of
  output c's code of input 8b + j in its low nibble and of input 8b + 4 + j in its high one
  (so a word's low nibbles are inputs 8b .. 8b + 3 in order, its high ones 8b + 4 .. 8b + 7);
- 5-bit kinds: 64 bytes more, word c: bit 8j + s is bit 4 of input 4s + j's code;
- Q6_K: 128 bytes more, words (w, c), w = 0, 1: bits 8j + 2t, 8j + 2t + 1 are bits 4 and 5
  of input 4(4w + t) + j's code;
and its scales
- Q4_0/Q5_0, per group: d[16] float16; Q4_1/Q5_1, per group: d[16], m[16] float16;
- Q4_K/Q5_K, per block of 256: d[16], dmin[16] float16, then per group sc[16], mn[16] uint8;
- Q6_K, per block of 256: d[16] float16, then per group of 16 sc[16] int8.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from cellbatch.model.quantized import GGUF_KEPT_KINDS, GROUP_SIZE, PANEL

MAGIC = 0x3230514B  # "KQ02"
KINDS = GGUF_KEPT_KINDS  # a kind's id in the layout is its place here
KIND_IDS = {kind: i for i, kind in enumerate(KINDS)}
BLOCK = 256  # inputs per K-quant block
_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
_ZERO = {"Q4_0": 8, "Q5_0": 16}  # w = d (q - zero) for these, which keep no m
_WITH_M = frozenset({"Q4_1", "Q5_1"})
CODE_BYTES = {4: 256, 5: 320, 6: 384}  # per panel and group of 32 inputs
_HEADER_WORDS = 4
_SEGMENT_WORDS = 4
_ALIGN = 64


def in_blocks(kind: str) -> bool:
    """Whether `kind` comes in blocks of 256 inputs (else groups of 32)."""
    return kind.endswith("_K")


def keeps(kind: str, in_features: int) -> bool:
    """Whether a tensor of `kind` with `in_features` inputs can be kept."""
    return kind in KIND_IDS and in_features % (BLOCK if in_blocks(kind) else GROUP_SIZE) == 0


def scale_bytes(kind: str, in_features: int) -> int:
    """Bytes of one panel's scales."""
    if kind == "Q6_K":
        return in_features // BLOCK * (32 + 256)
    if in_blocks(kind):
        return in_features // BLOCK * (64 + 256)
    return in_features // GROUP_SIZE * (64 if kind in _WITH_M else 32)


@dataclass
class Segment:
    """Rows of one kind in the panel layout: codes uint8 [P, K / 32, CODE_BYTES], scales
    uint8 [P, scale_bytes]."""

    kind: str
    rows: int
    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * GROUP_SIZE

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()


@dataclass
class KQuantWeight:
    """A weight kept in its GGUF kinds: segments of rows, each of one kind."""

    segments: list[Segment]
    format = "kquant"

    @property
    def shape(self) -> tuple[int, int]:
        return sum(s.rows for s in self.segments), self.segments[0].in_features

    @property
    def kinds(self) -> list[str]:
        return [s.kind for s in self.segments]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([dense_segment(s) for s in self.segments]).to(dtype)

    @staticmethod
    def cat(parts: list[KQuantWeight]) -> KQuantWeight:
        """Rows one after another; neighbouring segments of one kind merge where the first
        fills its panels."""
        if len(parts) == 1:
            return parts[0]
        merged: list[Segment] = []
        for segment in (s for part in parts for s in part.segments):
            last = merged[-1] if merged else None
            if last is not None and last.kind == segment.kind and last.rows % PANEL == 0:
                merged[-1] = Segment(
                    last.kind,
                    last.rows + segment.rows,
                    torch.cat([last.codes, segment.codes]),
                    torch.cat([last.scales, segment.scales]),
                )
            else:
                merged.append(segment)
        return KQuantWeight(merged)


# -- from GGUF blocks -------------------------------------------------------------------


def _halves(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at `offset` of each block, [...]."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of a group of 32 (element j low nibble, j + 16 high) -> [..., 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (sc, mn) uint8 [..., 8]."""
    first, second, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([first & 63, (low & 0x0F) | ((first >> 6) << 4)], axis=-1)
    mn = np.concatenate([second & 63, (low >> 4) | ((second >> 6) << 4)], axis=-1)
    return sc, mn


def decode(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """GGUF blocks of [rows] rows -> (codes uint8 [rows, K], the scale fields): d (Q4_1,
    Q5_1: and m) float16 [rows, K / 32] (group kinds); d, dmin float16 [rows, K / 256] and
    sc, mn uint8 [rows, K / 32] (Q4_K, Q5_K); d float16 [rows, K / 256] and sc int8 [rows,
    K / 16] (Q6_K)."""
    rows = blocks.shape[0]
    if not in_blocks(kind):
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}[kind]
        b = blocks.reshape(rows, -1, size)
        d = _halves(b, 0)
        at = 4 if kind in _WITH_M else 2
        codes = _nibbles(b[..., size - 16 :])
        if kind in ("Q5_0", "Q5_1"):
            high = np.ascontiguousarray(b[..., at : at + 4]).view(np.uint32)
            bits = (high >> np.arange(32, dtype=np.uint32)) & 1
            codes = codes | (bits.astype(np.uint8) << 4)
        return codes.reshape(rows, -1), {"d": d} | ({"m": _halves(b, 2)} if kind in _WITH_M else {})
    if kind in ("Q4_K", "Q5_K"):
        b = blocks.reshape(rows, -1, 144 if kind == "Q4_K" else 176)
        sc, mn = _scales_and_mins(b[..., 4:16])
        qs = b[..., -128:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        codes = (qs & 0x0F).reshape(rows, -1, 8, 32)
        if kind == "Q5_K":
            qh = b[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
            codes = codes | ((qh & 1) << 4)
        fields = {"d": _halves(b, 0), "dmin": _halves(b, 2)}
        return codes.reshape(rows, -1), fields | {
            "sc": sc.reshape(rows, -1),
            "mn": mn.reshape(rows, -1),
        }
    if kind != "Q6_K":
        raise ValueError(f"{kind} blocks are not kept as they are")
    b = blocks.reshape(rows, -1, 210)
    ql = b[..., :128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    low = (ql & 0x0F).reshape(rows, -1, 2, 4, 32)
    codes = low | ((qh & 3) << 4)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
    return codes.reshape(rows, -1), {"d": _halves(b, 208), "sc": sc.reshape(rows, -1)}


def _panel_major(array: np.ndarray) -> np.ndarray:
    """[rows, ...] -> [P, ..., PANEL]: zero rows appended, the panel's outputs last."""
    pad = -array.shape[0] % PANEL
    if pad:
        array = np.concatenate([array, np.zeros((pad, *array.shape[1:]), array.dtype)])
    panels = array.reshape(-1, PANEL, *array.shape[1:])
    return np.moveaxis(panels, 1, -1)


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes uint8 [rows, K] -> [P, K / 32, CODE_BYTES[bits]] (the module's layout)."""
    q = _panel_major(codes.reshape(codes.shape[0], -1, 4, 2, 4))  # [P, G, b, half, j, c]
    nibbles = (q[:, :, :, 0] & 0x0F) | ((q[:, :, :, 1] & 0x0F) << 4)  # [P, G, b, j, c]
    parts = [nibbles.transpose(0, 1, 2, 4, 3).reshape(*q.shape[:2], -1)]
    by_step = q.reshape(*q.shape[:2], 8, 4, PANEL) >> 4  # [P, G, s, j, c]: bits 4 and up
    if bits == 5:
        high = ((by_step & 1) << np.arange(8, dtype=np.uint8)[:, None, None]).sum(
            axis=2, dtype=np.uint8
        )  # [P, G, j, c]
        parts.append(high.transpose(0, 1, 3, 2).reshape(*q.shape[:2], -1))
    elif bits == 6:
        pairs = by_step.reshape(*q.shape[:2], 2, 4, 4, PANEL) & 3  # [P, G, w, t, j, c]
        shifts = (2 * np.arange(4, dtype=np.uint8))[:, None, None]
        high = (pairs << shifts).sum(axis=3, dtype=np.uint8)  # [P, G, w, j, c]
        parts.append(high.transpose(0, 1, 2, 4, 3).reshape(*q.shape[:2], -1))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1))


def _bytes(array: np.ndarray, panels: int, units: int) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint8).reshape(panels, units, -1)


def _pack_scales(kind: str, fields: dict[str, np.ndarray]) -> np.ndarray:
    """The scale fields of `decode` -> [P, scale_bytes]."""
    d = _panel_major(fields["d"])  # [P, units, 16]
    panels, units = d.shape[:2]
    if not in_blocks(kind):
        parts = [_bytes(_panel_major(fields[f]), panels, units) for f in ("d", "m") if f in fields]
    elif kind == "Q6_K":
        sc = _panel_major(fields["sc"].reshape(-1, units, 16))  # [P, S, 16 groups, c]
        parts = [_bytes(d, panels, units), _bytes(sc, panels, units)]
    else:
        dmin = _panel_major(fields["dmin"])
        sc = _panel_major(fields["sc"].reshape(-1, units, 8))  # [P, S, 8, c]
        mn = _panel_major(fields["mn"].reshape(-1, units, 8))
        pairs = np.stack([sc, mn], axis=3)  # [P, S, 8, 2, c]
        parts = [
            _bytes(d, panels, units),
            _bytes(dmin, panels, units),
            _bytes(pairs, panels, units),
        ]
    return np.concatenate(parts, axis=-1).reshape(panels, -1)


def from_blocks(blocks: np.ndarray, kind: str) -> KQuantWeight:
    """GGUF blocks of `kind` ([rows, bytes], rows in torch's order) as they are."""
    codes, fields = decode(blocks, kind)
    packed = _pack_codes(codes, _BITS[kind])
    scales = _pack_scales(kind, fields)
    return KQuantWeight(
        [Segment(kind, blocks.shape[0], torch.from_numpy(packed), torch.from_numpy(scales))]
    )


# -- the op's tensors --------------------------------------------------------------------


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def pack(weight: KQuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The (codes, scales) that `kquant_matmul_a8` takes: the header, then each segment."""
    count = len(weight.segments)
    header_size = _aligned(4 * (_HEADER_WORDS + _SEGMENT_WORDS * count))
    header = [MAGIC, count, weight.shape[1], 0]
    codes_at, scales_at = header_size, 0
    for segment in weight.segments:
        header += [KIND_IDS[segment.kind], segment.rows, codes_at, scales_at]
        codes_at += _aligned(segment.codes.numel())
        scales_at += _aligned(segment.scales.numel())
    codes = torch.zeros(codes_at, dtype=torch.uint8)
    scales = torch.zeros(scales_at, dtype=torch.uint8)
    codes[: 4 * len(header)] = torch.tensor(header, dtype=torch.int32).view(torch.uint8)
    for segment, (_, _, at, scales_of) in zip(weight.segments, _entries(header), strict=True):
        codes[at : at + segment.codes.numel()] = segment.codes.reshape(-1)
        scales[scales_of : scales_of + segment.scales.numel()] = segment.scales.reshape(-1)
    return codes, scales


def _entries(header: list[int]) -> Iterator[tuple[int, int, int, int]]:
    for i in range(header[1]):
        at = _HEADER_WORDS + _SEGMENT_WORDS * i
        yield header[at], header[at + 1], header[at + 2], header[at + 3]


def unpack(codes: torch.Tensor, scales: torch.Tensor) -> KQuantWeight:
    """`pack`'s tensors read back (views of them)."""
    return KQuantWeight([segment_view(codes, scales, where) for where in segments_of(codes)])


@dataclass(frozen=True)
class Where:
    """Where a segment lies in `pack`'s tensors."""

    kind: str
    rows: int
    in_features: int
    codes_at: int
    scales_at: int


def segments_of(codes: torch.Tensor) -> list[Where]:
    """The header of `pack`'s codes."""
    words = codes[: 4 * _HEADER_WORDS].view(torch.int32).tolist()
    if words[0] != MAGIC:
        raise ValueError("not this version's kquant codes (no KQ02 header): convert again")
    header = codes[: 4 * (_HEADER_WORDS + _SEGMENT_WORDS * words[1])].view(torch.int32).tolist()
    return [
        Where(KINDS[kind_id], rows, header[2], at, scales_at)
        for kind_id, rows, at, scales_at in _entries(header)
    ]


def segment_view(codes: torch.Tensor, scales: torch.Tensor, where: Where) -> Segment:
    """The segment `where` names, as views of `pack`'s tensors."""
    panels, groups = -(-where.rows // PANEL), where.in_features // GROUP_SIZE
    size = panels * groups * CODE_BYTES[_BITS[where.kind]]
    scale_size = panels * scale_bytes(where.kind, where.in_features)
    return Segment(
        where.kind,
        where.rows,
        codes[where.codes_at : where.codes_at + size].view(panels, groups, -1),
        scales[where.scales_at : where.scales_at + scale_size].view(panels, -1),
    )


# -- reading the layout back (the torch implementation, the embedding and the tests) --------


def segment_terms(
    segment: Segment, panels: torch.Tensor | None = None, columns: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The segment's outputs by row: all of them (padding rows included), those of the
    panels `panels` names, or output `columns[i]` of panel `panels[i]`: (codes float32
    [n, K] (Q6_K: q - 32), scale s [n, K / size], offset o [n, K / size] or None (Q6_K)),
    size 16 for Q6_K, else 32."""
    kind, codes, scales = segment.kind, segment.codes, segment.scales
    count, groups = codes.shape[:2]

    def select(t: torch.Tensor) -> torch.Tensor:  # [P, PANEL, ...] -> [n, C, ...]
        if panels is None:
            return t
        return t[panels] if columns is None else t[panels, columns].unsqueeze(1)

    nibbles = select(codes[..., :256].view(count, groups, 4, PANEL, 4).permute(0, 3, 1, 2, 4))
    n, width = nibbles.shape[:2]
    q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-2).view(n, width, groups, 32)
    q = q.to(torch.int32)
    if _BITS[kind] == 5:  # [n, C, G, j] -> bit s of byte j: input 4s + j
        high = select(codes[..., 256:320].view(count, groups, PANEL, 4).permute(0, 2, 1, 3))
        steps = torch.arange(8, dtype=torch.int32)[:, None]
        q = q | (((high.to(torch.int32)[..., None, :] >> steps) & 1).reshape(q.shape) << 4)
    elif _BITS[kind] == 6:  # [n, C, G, w, j] -> bits 2t of byte j: input 16w + 4t + j
        high = select(codes[..., 256:384].view(count, groups, 2, PANEL, 4).permute(0, 3, 1, 2, 4))
        shifts = 2 * torch.arange(4, dtype=torch.int32)[:, None]
        q = q | (((high.to(torch.int32)[..., None, :] >> shifts) & 3).reshape(q.shape) << 4)
    q = q.reshape(n * width, -1)
    units = _units(kind, groups)
    per_unit = scales.view(count, units, -1)

    def field(start: int, per: int, dtype: torch.dtype) -> torch.Tensor:
        """`per` values of `dtype` per unit and output from byte `start`: [n C, units per]."""
        size = torch.empty((), dtype=dtype).element_size()
        raw = per_unit[..., start : start + per * PANEL * size]
        raw = raw.view(count, units, per, PANEL, size).permute(0, 3, 1, 2, 4)
        values = select(raw).contiguous().view(dtype)  # [n, C, units, per, 1]
        return values.float().reshape(n * width, units * per)

    if not in_blocks(kind):
        d = field(0, 1, torch.float16)
        m = field(32, 1, torch.float16) if kind in _WITH_M else torch.zeros_like(d)
        return q.float(), d, m - _ZERO.get(kind, 0) * d
    if kind == "Q6_K":
        s = field(0, 1, torch.float16).repeat_interleave(16, dim=1) * field(32, 16, torch.int8)
        return (q - 32).float(), s, None
    d, dmin = field(0, 1, torch.float16), field(32, 1, torch.float16)
    pairs = field(64, 16, torch.uint8).view(n * width, units, 8, 2)
    s = d.repeat_interleave(8, dim=1) * pairs[..., 0].flatten(1)
    return q.float(), s, -(dmin.repeat_interleave(8, dim=1) * pairs[..., 1].flatten(1))


def _units(kind: str, groups: int) -> int:
    """Scale units per panel: blocks of 256 or groups of 32."""
    return groups * GROUP_SIZE // BLOCK if in_blocks(kind) else groups


def dense_segment(
    segment: Segment, panels: torch.Tensor | None = None, columns: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 weight of the segment's rows (or of the outputs `segment_terms` selects),
    each value rounded once, as gguf's dequantiser rounds it."""
    q, s, o = segment_terms(segment, panels, columns)
    size = q.shape[1] // s.shape[1]
    grouped = q.view(q.shape[0], s.shape[1], size)
    values = grouped * s[..., None] if o is None else grouped * s[..., None] + o[..., None]
    out = values.reshape(q.shape[0], -1)
    return out if panels is not None else out[: segment.rows]


# -- modules ---------------------------------------------------------------------------


class KQuantOps(Protocol):
    """The part of an ops table (`cellbatch.model.ops.Ops`) that a kept weight calls."""

    @property
    def kind(self) -> str: ...

    @property
    def kquant_matmul_a8(self) -> Callable[..., torch.Tensor]: ...

    @property
    def kquant_rows(self) -> Callable[..., torch.Tensor]: ...


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class KQuantLinear(nn.Module):
    """y = x w^T (+ bias) for a KQuantWeight, in the input's dtype, by the op
    `kquant_matmul_a8` of the model's ops table: the inputs quantised to int8 per group of
    32, always (as llama.cpp's K-quant products quantise theirs). `format` names its kinds
    ("Q4_K", "Q4_K+Q6_K"); `bytes_by_kind` what each holds."""

    def __init__(self, weight: KQuantWeight, bias: torch.Tensor | None, ops: KQuantOps) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format = "+".join(dict.fromkeys(weight.kinds))
        codes, scales = pack(weight)
        # Each kind's share of the tensors (the header and padding with the first segment).
        self.bytes_by_kind: dict[str, int] = {}
        sizes = [_aligned(s.codes.numel()) + _aligned(s.scales.numel()) for s in weight.segments]
        sizes[0] += codes.numel() + scales.numel() - sum(sizes)
        for segment, size in zip(weight.segments, sizes, strict=True):
            self.bytes_by_kind[segment.kind] = self.bytes_by_kind.get(segment.kind, 0) + size
        self.activations = "int8"
        self.kernel = "compiled" if ops.kind == "compiled" else "dequantize"
        self.row_invariant = self.kernel == "compiled"
        self.op = "kquant_matmul_a8"
        self.matmul: Callable[..., torch.Tensor] = ops.kquant_matmul_a8
        self.codes, self.scales = _param(codes), _param(scales)
        self.bias = None if bias is None else _param(bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.codes, self.scales, self.out_features)
        return out if self.bias is None else out + self.bias


class KQuantEmbedding(nn.Module):
    """Token rows gathered from a KQuantLinear's panels (shared with a tied LM head) by the
    op `kquant_rows` of the model's ops table, each dequantised as gguf does and rounded to
    the model's dtype."""

    def __init__(self, linear: KQuantLinear, dtype: torch.dtype, ops: KQuantOps) -> None:
        super().__init__()
        self.codes, self.scales = linear.codes, linear.scales
        self.out_features, self.in_features = linear.out_features, linear.in_features
        self.format = linear.format
        self.bytes_by_kind = linear.bytes_by_kind
        self.dtype = dtype
        self.rows_of: Callable[..., torch.Tensor] = ops.kquant_rows

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.rows_of(
            self.codes, self.scales, tokens.reshape(-1), self.in_features, self.out_features
        )
        return rows.view(*tokens.shape, -1).to(self.dtype)


def install(model: Any, weights: dict[str, KQuantWeight]) -> None:
    """Puts kept weights into a PackedTransformer whose other weights are loaded, as
    `quantized.install` puts quantised ones: "layers.{i}.{name}.weight" replaces that
    projection (its bias kept), "lm_head.weight" the head, "embed.weight" the embedding
    (and the head too, when tied)."""
    for target, weight in weights.items():
        path = target.removesuffix(".weight")
        if path == "embed":
            linear = KQuantLinear(weight, None, model.ops)
            model.embed = KQuantEmbedding(linear, model.dtype, model.ops)
            if model.lm_head is None:
                model.lm_head = linear
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, name)
        setattr(parent, name, KQuantLinear(weight, getattr(old, "bias", None), model.ops))
