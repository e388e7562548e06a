"""The model's custom ops, `cellbatch::cell_attention`, `rms_norm`, `rope_store`,
`silu_mul`, `int4_matmul`, `int4_matmul_a8`, `int8_matmul`, `int8_matmul_a8` and
`kquant_matmul_a8` (GGUF block kinds kept as they are, `cellbatch.model.kquants`) and
`kquant_rows` (such a weight's rows dequantised: a kept embedding),
`lora_add`, the whole-layer `decoder_layer` over them, `argmax_rows` (greedy draws from a
step's logits), and the table of them a model calls.

Owns: the ops' schemas; their pure-torch implementations (attention's is
`cellbatch.model.attention.cell_attention_torch`, the quantised products' are in
`cellbatch.model.quantized_torch`, over the weight layouts of `cellbatch.model.quantized`);
their fake implementations (shapes only, so that torch.export and torch.compile can trace a
model through them); `Ops`, one table of them; and `resolve`, which turns a user's choice
("auto", "compiled", "torch") into a table.
Promises: two namespaces with the same schemas, defined on import. `cellbatch::` runs the
compiled CPU kernels once `cellbatch.model.kernels` has loaded the library built at
install, and the torch implementations elsewhere (other devices, or no library);
`cellbatch_torch::` always runs the torch implementations. A table holds the ops of one
namespace, so a model has one code path whichever it got; `Ops.kind` says which
("compiled" or "torch"). The torch implementations follow transformers' roundings: RMSNorm
normalises in float32 and scales in the compute dtype, RoPE multiplies and adds in the
compute dtype with cos/sin rounded to it, SiLU is rounded to the compute dtype and then
multiplied by `up` in it.
Never: compiles anything, or loads the compiled library unless a choice asks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from cellbatch.kv_format import store_heads
from cellbatch.model import kernels
from cellbatch.model.attention import cell_attention_torch
from cellbatch.model.gemm import in_fixed_calls
from cellbatch.model.quantized_torch import (
    int4_matmul_a8_torch,
    int4_matmul_torch,
    int8_matmul_a8_torch,
    int8_matmul_torch,
    kquant_matmul_a8_torch,
    kquant_rows_torch,
)
from cellbatch.types import InvalidArgumentError

NAMESPACE = "cellbatch"
TORCH_NAMESPACE = "cellbatch_torch"
KERNEL_CHOICES = ("auto", "compiled", "torch")

# The compiled kernels (kernels/*.cpp) implement these for the CPU under NAMESPACE.
SCHEMAS: dict[str, str] = {
    "cell_attention": (
        "cell_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cells, Tensor rows, "
        "Tensor pos, Tensor cell_offsets, Tensor block_starts, int window, float scale, "
        "Tensor(a!) out) -> ()"
    ),
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "rope_store": (
        "rope_store(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor cells, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache) -> ()"
    ),
    "silu_mul": "silu_mul(Tensor gate_up) -> Tensor",
    "int4_matmul": (
        "int4_matmul(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor"
    ),
    "int4_matmul_a8": (
        "int4_matmul_a8(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor"
    ),
    "int8_matmul": (
        "int8_matmul(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor"
    ),
    "int8_matmul_a8": (
        "int8_matmul_a8(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor"
    ),
    "kquant_matmul_a8": (
        "kquant_matmul_a8(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor"
    ),
    "kquant_rows": (
        "kquant_rows(Tensor codes, Tensor scales, Tensor rows, int in_features, "
        "int out_features) -> Tensor"
    ),
    "decoder_layer": (
        "decoder_layer(Tensor hidden, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor cells, Tensor plan_cells, Tensor plan_rows, "
        "Tensor plan_positions, Tensor plan_cell_offsets, Tensor plan_block_starts, "
        "int num_tokens, int window, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor qkv_codes, Tensor qkv_scales, int qkv_kind, Tensor o_codes, Tensor o_scales, "
        "int o_kind, Tensor gate_up_codes, Tensor gate_up_scales, int gate_up_kind, "
        "int intermediate, Tensor down_codes, Tensor down_scales, int down_kind, "
        "int num_heads, int num_kv_heads, int head_dim, float scale, Tensor[] lora) -> Tensor"
    ),
    "lora_add": (
        "lora_add(Tensor(a!) out, Tensor x, Tensor rows, Tensor offsets, Tensor[] weights) -> ()"
    ),
    "argmax_rows": "argmax_rows(Tensor logits) -> Tensor",
}
# decoder_layer's product kinds: a product's kind is the index of its op here (the same
# order as PRODUCT_OPS in kernels/decoder_layer.cpp).
PRODUCT_OPS = (
    "int4_matmul",
    "int4_matmul_a8",
    "int8_matmul",
    "int8_matmul_a8",
    "kquant_matmul_a8",
)
# lora_add computes each row in calls of exactly this many rows (the torch implementation),
# so that a row's low-rank product never depends on the other rows (cellbatch.model.gemm).
LORA_ROWS_PER_CALL = 16


# -- the pure-torch implementations -----------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm over the last dimension of x."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout: x * cos + rotate_half(x) * sin, cos/sin [T, 1, D/2]
    in x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_store_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cells: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Rotates q [T, H, D] in place and stores the rotated k and v [T, KVH, D] of the first
    len(cells) tokens in their cells (later rows are padding), in the caches' dtype (int8:
    quantised per head, `cellbatch.kv_format`); cos, sin float32 [>= T, D/2]."""
    tokens, stored = q.shape[0], cells.shape[0]
    cos = cos[:tokens].to(q.dtype)[:, None, :]
    sin = sin[:tokens].to(q.dtype)[:, None, :]
    q.copy_(rotate(q, cos, sin))
    rotated = rotate(k[:stored], cos[:stored], sin[:stored])
    k_cache.index_copy_(0, cells, store_heads(rotated, k_cache.dtype))
    v_cache.index_copy_(0, cells, store_heads(v[:stored], v_cache.dtype))


# ATen runs an elementwise op over more elements than this (at::internal::GRAIN_SIZE) on
# several threads, cutting the flat range wherever the count falls; the piece of a cut row
# that ends a thread's share goes through the vectorised loop's scalar tail, whose exp
# rounds differently from the vector one. A block of at most this many elements runs on
# one thread, where every row takes the same path whatever its place in the step.
ELEMENTWISE_GRAIN = 32768


def argmax_rows_torch(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> int64 [rows]: each row's first maximal index, or its first NaN's."""
    return logits.max(dim=-1).indices


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2I] (gate | up) -> [rows, I]: silu(gate) * up, a row's result independent
    of the other rows and of the thread count (blocks of ELEMENTWISE_GRAIN)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if gate_up.device.type != "cpu":  # no thread split there: one kernel for every row
        return F.silu(gate) * up
    out = torch.empty_like(up, memory_format=torch.contiguous_format)
    block = max(1, ELEMENTWISE_GRAIN // gate.shape[-1])
    for start in range(0, gate.shape[0], block):
        rows = slice(start, start + block)
        torch.mul(F.silu(gate[rows]), up[rows], out=out[rows])
    return out


def lora_add_torch(
    out: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    weights: Sequence[torch.Tensor],
) -> None:
    """Adds x[r] · A_g^T · B_g to out[r] for each row r of group g: rows[offsets[g] :
    offsets[g + 1]] take weights[4g : 4g + 4] (a [R, K], b flat, segments [S, 4], scales
    [R] or empty: the layout of `cellbatch.model.lora`; R = 0 adds nothing). Computed in
    float32 (int8 A and B widened, x · A^T times the scales), every product in calls of
    LORA_ROWS_PER_CALL rows, and rounded once into out."""
    bounds = offsets.tolist()
    for group in range(len(bounds) - 1):
        a, b, segments, scales = weights[4 * group : 4 * group + 4]
        begin, end = bounds[group], bounds[group + 1]
        if a.shape[0] == 0 or end == begin:
            continue
        picked = rows[begin:end]
        low = in_fixed_calls(
            partial(torch.matmul, other=a.float().t()),
            x.index_select(0, picked).float(),
            LORA_ROWS_PER_CALL,
        )
        if scales.numel():
            low = low * scales
        delta = torch.zeros(end - begin, out.shape[1], dtype=torch.float32, device=out.device)
        start = 0
        for rank_start, rank_count, column, columns in segments.tolist():
            block = b[start : start + rank_count * columns].view(rank_count, columns).float()
            start += rank_count * columns
            part = low[:, rank_start : rank_start + rank_count]
            delta[:, column : column + columns] += in_fixed_calls(
                partial(torch.matmul, other=block), part, LORA_ROWS_PER_CALL
            )
        summed = out.index_select(0, picked).float() + delta
        out.index_copy_(0, picked, summed.to(out.dtype))


def decoder_layer_torch(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cells: torch.Tensor,
    plan_cells: torch.Tensor,
    plan_rows: torch.Tensor,
    plan_positions: torch.Tensor,
    plan_cell_offsets: torch.Tensor,
    plan_block_starts: torch.Tensor,
    num_tokens: int,
    window: int,
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
    eps: float,
    qkv_codes: torch.Tensor,
    qkv_scales: torch.Tensor,
    qkv_kind: int,
    o_codes: torch.Tensor,
    o_scales: torch.Tensor,
    o_kind: int,
    gate_up_codes: torch.Tensor,
    gate_up_scales: torch.Tensor,
    gate_up_kind: int,
    intermediate: int,
    down_codes: torch.Tensor,
    down_scales: torch.Tensor,
    down_kind: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    lora: Sequence[torch.Tensor],
) -> torch.Tensor:
    """A Llama layer whose four products are quantised ops (kinds: PRODUCT_OPS), as the
    torch implementations of its steps run it: the steps of `DecoderLayer.forward`.
    `lora` (empty: none) is `cellbatch.model.adapters.LayerLora.args`: rows, offsets, then
    per product in the layer's order its groups' weights, added by `lora_add`."""
    ops = getattr(torch.ops, TORCH_NAMESPACE)
    products = iter(range(4))

    def product(
        kind: int, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int
    ) -> torch.Tensor:
        out: torch.Tensor = getattr(ops, PRODUCT_OPS[kind])(x, codes, scales, n)
        index = next(products)
        if lora:
            per = (len(lora) - 2) // 4
            weights = list(lora[2 + index * per : 2 + (index + 1) * per])
            ops.lora_add(out, x, lora[0], lora[1], weights)
        return out

    tokens, width = hidden.shape
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = product(
        qkv_kind, ops.rms_norm(hidden, input_norm, eps), qkv_codes, qkv_scales, q_size + 2 * kv_size
    )
    q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
    q = q.view(tokens, num_heads, head_dim)
    k, v = k.view(tokens, num_kv_heads, head_dim), v.view(tokens, num_kv_heads, head_dim)
    ops.rope_store(q, k, v, cos, sin, cells, k_cache, v_cache)
    attended = hidden.new_empty(tokens, q_size)
    attended[num_tokens:].zero_()
    plan = (plan_cells, plan_rows, plan_positions, plan_cell_offsets, plan_block_starts)
    ops.cell_attention(q, k_cache, v_cache, *plan, window, scale, attended)
    mid = hidden + product(o_kind, attended, o_codes, o_scales, width)
    gate_up = product(
        gate_up_kind,
        ops.rms_norm(mid, post_norm, eps),
        gate_up_codes,
        gate_up_scales,
        2 * intermediate,
    )
    out: torch.Tensor = mid + product(
        down_kind, ops.silu_mul(gate_up), down_codes, down_scales, width
    )
    return out


_TORCH_IMPLS: dict[str, Callable[..., Any]] = {
    "cell_attention": cell_attention_torch,
    "rms_norm": rms_norm_torch,
    "rope_store": rope_store_torch,
    "silu_mul": silu_mul_torch,
    "int4_matmul": int4_matmul_torch,
    "int4_matmul_a8": int4_matmul_a8_torch,
    "int8_matmul": int8_matmul_torch,
    "int8_matmul_a8": int8_matmul_a8_torch,
    "kquant_matmul_a8": kquant_matmul_a8_torch,
    "kquant_rows": kquant_rows_torch,
    "decoder_layer": decoder_layer_torch,
    "lora_add": lora_add_torch,
    "argmax_rows": argmax_rows_torch,
}


# -- fake implementations: output shapes for tracing --------------------------------------


def _returns_nothing(*args: Any) -> None:
    """The ops that only write their mutable arguments."""


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _silu_mul_fake(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


def _matmul_fake(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def _kquant_rows_fake(
    codes: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    in_features: int,
    out_features: int,
) -> torch.Tensor:
    return codes.new_empty(rows.shape[0], in_features, dtype=torch.float32)


def _decoder_layer_fake(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


def _argmax_rows_fake(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.long)


_FAKES: dict[str, Callable[..., Any]] = {
    "cell_attention": _returns_nothing,
    "rms_norm": _rms_norm_fake,
    "rope_store": _returns_nothing,
    "silu_mul": _silu_mul_fake,
    "int4_matmul": _matmul_fake,
    "int4_matmul_a8": _matmul_fake,
    "int8_matmul": _matmul_fake,
    "int8_matmul_a8": _matmul_fake,
    "kquant_matmul_a8": _matmul_fake,
    "kquant_rows": _kquant_rows_fake,
    "decoder_layer": _decoder_layer_fake,
    "lora_add": _returns_nothing,
    "argmax_rows": _argmax_rows_fake,
}


def _define(namespace: str) -> torch.library.Library:
    """Defines every op under `namespace` with its torch implementation for any device
    (a backend kernel registered later, such as the compiled CPU one, takes precedence).
    An op a program loaded earlier has defined (`cellbatch.export.custom_ops`, from the
    same schema) only gets its implementations."""
    # torch leaves Library's constructor, define and impl unannotated.
    library = torch.library.Library(namespace, "FRAGMENT")  # type: ignore[no-untyped-call]
    for name, schema in SCHEMAS.items():
        if not hasattr(getattr(torch.ops, namespace), name):
            library.define(schema)  # type: ignore[no-untyped-call]
        library.impl(name, _TORCH_IMPLS[name], "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        torch.library.register_fake(f"{namespace}::{name}", _FAKES[name], lib=library)
    return library


# Registrations live as long as their Library objects: these stay for the process.
_LIBRARIES = [_define(NAMESPACE), _define(TORCH_NAMESPACE)]


# -- the table a model calls ------------------------------------------------------------


@dataclass(frozen=True)
class Ops:
    """One namespace's ops; every field takes the arguments of its schema."""

    kind: str  # "compiled" or "torch"
    cell_attention: Callable[..., None]
    rms_norm: Callable[..., torch.Tensor]
    rope_store: Callable[..., None]
    silu_mul: Callable[..., torch.Tensor]
    int4_matmul: Callable[..., torch.Tensor]
    int4_matmul_a8: Callable[..., torch.Tensor]
    int8_matmul: Callable[..., torch.Tensor]
    int8_matmul_a8: Callable[..., torch.Tensor]
    kquant_matmul_a8: Callable[..., torch.Tensor]
    kquant_rows: Callable[..., torch.Tensor]
    decoder_layer: Callable[..., torch.Tensor]
    lora_add: Callable[..., None]
    argmax_rows: Callable[..., torch.Tensor]


def table(namespace: str) -> Ops:
    """The ops of `namespace` (NAMESPACE: "compiled", TORCH_NAMESPACE: "torch")."""
    ops = getattr(torch.ops, namespace)
    kind = "compiled" if namespace == NAMESPACE else "torch"
    return Ops(kind, **{name: getattr(ops, name).default for name in SCHEMAS})


def resolve(choice: str, device: str | torch.device) -> Ops:
    """The ops a model on `device` should call for `choice`: "auto" takes the compiled
    ones on the CPU where their library loads (else, with one warning, torch's),
    "compiled" insists on them (and says why they are missing), "torch" never loads them."""
    if choice not in KERNEL_CHOICES:
        raise InvalidArgumentError(f"unknown kernels {choice!r}; use one of {KERNEL_CHOICES}")
    on_cpu = torch.device(device).type in ("cpu", "meta")
    if choice == "compiled" and not on_cpu:
        raise InvalidArgumentError(
            "the compiled kernels run on the CPU only; use kernels='auto' or 'torch'"
        )
    if choice == "torch" or not on_cpu:
        return table(TORCH_NAMESPACE)
    if kernels.load():
        return table(NAMESPACE)
    if choice == "compiled":
        raise InvalidArgumentError(
            f"the compiled kernels are not available ({kernels.unavailable_reason()}); "
            "use kernels='torch' or 'auto'"
        )
    return table(TORCH_NAMESPACE)
