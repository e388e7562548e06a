"""GGUF tensors as quantised weights: Q4_0, Q4_1, Q4_K and Q8_0 blocks read as they are
into int4/int8, the kinds of `kquants` kept in their own blocks, any other kind
dequantised and requantised (`from_gguf`).

Owns: reading GGUF block layouts (scales, offsets and codes out of each block's bytes) and
converting a tensor in row chunks.
Promises: Q4_0, Q4_1 and Q4_K blocks map onto `quantized.Int4Weight` exactly and Q8_0
blocks onto `quantized.Int8Weight` (see `cellbatch.model.quantized`); a conversion holds
at most _CHUNK_ROWS rows in float32 at a time.
Never: opens files (the loader hands it each tensor's array) or decides formats
(`quantized.target_format` does).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from cellbatch.model import kquants
from cellbatch.model.kquants import KQuantWeight
from cellbatch.model.quantized import (
    GGUF_INT4_KINDS,
    GGUF_INT8_KINDS,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    cat,
    from_float,
)

_CHUNK_ROWS = 4096  # rows converted at a time: bounds the float32 scratch of a conversion


def from_gguf(data: np.ndarray, kind: str, fmt: str) -> QuantizedWeight | KQuantWeight:
    """One GGUF tensor's data (rows in torch's order: [rows, bytes] for block kinds,
    [rows, cols] for float kinds) in format `fmt`, converted `_CHUNK_ROWS` rows at a time.
    Q4_0/Q4_1/Q4_K to int4 and Q8_0 to int8 take the blocks as they are, and so does
    "kquant" (`kquants.from_blocks`, any of GGUF_KEPT_KINDS); anything else is dequantised
    (gguf's own dequantiser) chunk by chunk and quantised by `from_float`."""
    chunks = _row_chunks(data)
    if fmt == "kquant":
        return KQuantWeight.cat([kquants.from_blocks(chunk, kind) for chunk in chunks])
    parts: list[QuantizedWeight]
    if fmt == "int4" and kind in GGUF_INT4_KINDS:
        parts = [_int4_from_blocks(chunk, kind) for chunk in chunks]
    elif fmt == "int8" and kind in GGUF_INT8_KINDS:
        parts = [_int8_from_blocks(chunk) for chunk in chunks]
    else:
        parts = [from_float(_dequantize(chunk, kind), fmt) for chunk in chunks]
    weight: QuantizedWeight = cat(parts)  # one part as it is, else its class's `cat`
    return weight


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


def _int8_from_blocks(blocks: np.ndarray) -> Int8Weight:
    """Q8_0 blocks (d, 32 int8 codes) of [rows] rows -> Int8Weight: w = d q, exactly."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 34)
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1)
    return Int8Weight(torch.from_numpy(codes), torch.from_numpy(_halves(b, 0)))


def _int4_from_blocks(blocks: np.ndarray, kind: str) -> Int4Weight:
    """Q4_0 (d, 16 bytes), Q4_1 (d, m, 16 bytes) or Q4_K (d, dmin, 12 bytes of 6-bit
    sub-block scales and mins, 128 bytes) blocks of [rows] rows -> Int4Weight.

    Q4_0/Q4_1: byte j of a block holds element j (low nibble) and j + 16 (high); w = d q + m
    (Q4_0: d (q - 8)). Q4_K: 256 elements in 8 sub-blocks of 32; each 32 bytes hold two
    sub-blocks (low nibbles, then high ones); w = d sc q - dmin mn. Scales and offsets are
    float16 values or their products with 6-bit integers: exact in float32.
    """
    rows = blocks.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        quants = 4 if kind == "Q4_1" else 2
        b = blocks.reshape(rows, -1, quants + 16)
        d = _halves(b, 0)
        offset = _halves(b, 2) if kind == "Q4_1" else -8 * d
        qs = b[..., quants:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        scale = d
    elif kind == "Q4_K":
        b = blocks.reshape(rows, -1, 144)
        d, dmin = _halves(b, 0), _halves(b, 2)
        sc, mn = _q4k_scales_and_mins(b[..., 4:16])
        scale = (d[..., None] * sc).reshape(rows, -1)
        offset = -(dmin[..., None] * mn).reshape(rows, -1)
        qs = b[..., 16:].reshape(rows, -1, 4, 32)
        codes = np.stack([qs & 0x0F, qs >> 4], axis=-2)
    else:
        raise ValueError(f"{kind} blocks cannot be kept as int4")
    return Int4Weight(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32)),
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
