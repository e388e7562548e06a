"""The packed-step transformer: one forward over a step's tokens from many sequences.

Owns: `PackedTransformer` (a Llama-family decoder whose batch is one token axis; its
layers are `cellbatch.model.decoder_layer`'s), `PackedLinear`, `resolve_dtype` and
`resolve_kv_dtype`, and the RoPE frequency rule.
Promises: `forward(tokens, positions, plan, kv, cells, logit_rows)` writes each token's
K/V into its cell of the `KVPool`, attends each token to exactly the cells the
`AttentionPlan` gives its sequence (`cellbatch.model.attention`: a token's work scales with
its own context, and a sliding-window layer reads only its window), and returns float32
logits for `logit_rows` only. Numerics follow transformers' eager attention: compute in
the weight dtype, RMSNorm and softmax in float32, RoPE from float32 angles. A token's
logits are bit-identical whatever else shares its step (see PackedTransformer).
`forward_pooled` gives the final-norm hidden states of chosen rows besides the logits
(what embeddings pool), with the same promise.
Never: owns cells or sequences (`cellbatch.cache` does), samples, or loops in Python over
tokens; the only loops run over layers (and, in the torch attention, the plan groups).

Positions index a precomputed cos/sin table, so they must lie in [0, max_positions)
(by default the model's `max_position_embeddings`). A table lookup, unlike computing
cos/sin per step, gives a position the same angles whatever else is in the step.
Attention does not call torch's SDPA: the CPU flash kernel's rounding depends on the
padded key length, i.e. on the other sequences of the group.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from cellbatch.cache import AttentionPlan
from cellbatch.kv_format import KV_INT8, is_int8_name
from cellbatch.kv_pool import KVPool
from cellbatch.model.attention import MIN_GEMM_ROWS, CellAttention
from cellbatch.model.config import ModelConfig
from cellbatch.model.cpu import cpu_dtype, cpu_has_fast_bf16
from cellbatch.model.decoder_layer import (
    PROJECTIONS,
    DecoderLayer,
    LayerAttention,
    RMSNorm,
    StepAttention,
)
from cellbatch.model.gemm import in_fixed_calls, rows_per_call
from cellbatch.model.ops import resolve
from cellbatch.types import InvalidArgumentError

if TYPE_CHECKING:
    from cellbatch.model.adapters import LoraStep
    from cellbatch.model.quantized import QuantizedEmbedding

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# oneDNN's products on reordered weights (PackedLinear) round only 1-row calls differently,
# in fp32 and bf16 alike.
PACKED_MIN_GEMM_ROWS = 2


def resolve_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype for "auto" | "float32" | "bfloat16" | "float16" (or fp32/bf16/fp16).

    "auto" picks bf16 where the hardware has native bf16 matrix units (AVX512-BF16 or AMX:
    half the bytes of fp32 per weight and activation, twice the products per instruction), else
    fp32. fp16 is never auto on CPU: without AVX512-FP16 torch emulates it, slower than fp32.
    """
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise InvalidArgumentError(f"dtype {name} is not supported; use one of {list(DTYPES)}")
        return name
    key = _DTYPE_ALIASES.get(name, name)
    if key == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return cpu_dtype()
    if key not in DTYPES:
        raise InvalidArgumentError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[key]


def resolve_kv_dtype(
    name: str | torch.dtype | None, weight_dtype: torch.dtype, device: str | torch.device = "cpu"
) -> torch.dtype:
    """The KV pool's dtype: None -> the weights' dtype; "int8" (or torch.int8) -> the int8
    cache, quantised per (cell, head) (`cellbatch.kv_format`); else `resolve_dtype`'s."""
    if name is None:
        return weight_dtype
    if is_int8_name(name):
        return KV_INT8
    try:
        return resolve_dtype(name, device)
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"unknown KV dtype {name!r}; use auto, {', '.join(DTYPES)} or int8"
        ) from None


def rope_inverse_frequencies(
    config: ModelConfig, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """float32 [head_dim / 2]: RoPE inverse frequencies with the config's scaling.

    Same float32 operations as transformers, so the angles match bit for bit.
    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "freq_factors":
        return inv / torch.tensor(scaling.freq_factors, dtype=torch.float32, device=device)
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_freq_wavelen, inv / scaling.factor, inv)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class PackedLinear(nn.Module):
    """A Linear whose weight oneDNN has reordered once for its own CPU kernels, so that no
    call reorders it again: faster than F.linear at decode batch sizes.

    - bf16: bit-identical to F.linear for any row count (torch's bf16 F.linear is oneDNN
      too);
    - fp32: F.linear goes to MKL, which rounds a row differently by row count; oneDNN on
      reordered weights does not, from 2 rows (hence `PACKED_MIN_GEMM_ROWS`). It rounds
      differently from MKL, within about 1e-5 of transformers' logits, so greedy tokens
      agree unless the top two logits nearly tie.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # On AMX CPUs a bf16 row's rounding depends on the call's row count (gemm.py).
        self.rows_per_call = rows_per_call(weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_fixed_calls(self._linear, x, self.rows_per_call)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.weight, self.bias, "none", [], ""
        )
        return out


def can_pack_linears(dtype: torch.dtype, device: str | torch.device) -> bool:
    """oneDNN's reordered weights pay off for fp32 on any CPU it supports, and for bf16
    on CPUs with native bf16 products (fp16 is not measured)."""
    if torch.device(device).type != "cpu":
        return False
    # torch leaves mkldnn.is_available unannotated.
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_fast_bf16())


class PackedTransformer(nn.Module):
    """A Llama-family decoder over one packed token axis (docs/design.md#model).

    Batch invariance: a token's logits are bit-identical whatever else shares its step
    (other sequences, their lengths, the token's place on the axis, the chunking of its
    prompt). Two things make it so: every matrix product runs on at least `min_rows`
    rows (zero rows are appended, then dropped; default MIN_GEMM_ROWS of the dtype), since
    CPU GEMMs round a row differently in calls of very few rows; and attention and the
    elementwise steps keep the same promise (`cellbatch.model.attention`, `kernels`).

    `kernels` picks the implementation of attention and of the per-layer elementwise steps
    (RMSNorm, RoPE with the K/V store, SiLU-times-up), which the model calls as the custom
    ops of one table (`cellbatch.model.ops`, kept as `ops`): "compiled" (the CPU kernels
    built when the package was installed), "torch", or "auto" (compiled on the CPU where
    they were built). The two agree to rounding, not bit for bit.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_positions: int | None = None,
        min_rows: int | None = None,
        kernels: str = "auto",
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.max_positions = max_positions or config.max_position_embeddings
        self.min_rows = MIN_GEMM_ROWS.get(dtype, 16) if min_rows is None else min_rows
        self._min_rows_given = min_rows is not None
        self.ops = resolve(kernels, device)
        self.geometry = dataclasses.replace(config.geometry, max_positions=self.max_positions)
        self.attention: LayerAttention = CellAttention(self.geometry, self.ops.cell_attention)
        # quantized.install may replace the embedding and the head.
        self.embed: nn.Embedding | QuantizedEmbedding = nn.Embedding(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device, self.attention, self.ops)
            for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, self.ops)
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device
            )
        )
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.reset_rope("cpu" if torch.device(device).type == "meta" else device)

    def reset_rope(self, device: str | torch.device) -> None:
        """(Re)builds the float32 cos/sin tables [max_positions, head_dim / 2] on `device`
        (the loader calls this after materialising a model built on the meta device)."""
        inv = rope_inverse_frequencies(self.config, device)
        angles = torch.arange(self.max_positions, device=device).float()[:, None] * inv[None, :]
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def set_attention(self, attention: LayerAttention) -> None:
        """Every layer attends with `attention` from now on (a model on a device takes a
        DeviceAttention and is then run through `forward_flat` with `CellRows`)."""
        self.attention = attention
        for layer in self.layers:
            cast(DecoderLayer, layer).attention = attention

    def pack_linears(self) -> None:
        """Swaps every projection and the LM head for a PackedLinear where that is faster
        (see can_pack_linears); a tied head gets its own packed copy of the embedding.
        Quantised ones (cellbatch.model.quantized) stay as they are.
        Unless min_rows was given, products then pad only to PACKED_MIN_GEMM_ROWS, or not
        at all when every product is row-invariant (the compiled quantised kernels)."""
        if not self._min_rows_given and all(
            getattr(product, "row_invariant", False) for product in self._products()
        ):
            self.min_rows = 1
            return
        if not can_pack_linears(self.dtype, self.norm.weight.device):
            return
        if not self._min_rows_given:
            self.min_rows = PACKED_MIN_GEMM_ROWS
        for layer in self.layers:
            for name in PROJECTIONS:
                linear = getattr(layer, name)
                if isinstance(linear, nn.Linear):
                    setattr(layer, name, PackedLinear(linear.weight, linear.bias))
        if self.lm_head is None or isinstance(self.lm_head, nn.Linear):
            # Tied: the embedding is float (a quantised one comes with its own head).
            head = (
                cast(nn.Embedding, self.embed).weight
                if self.lm_head is None
                else self.lm_head.weight
            )
            self.lm_head = PackedLinear(head, None)

    def fuse_layers(self, enabled: bool = True) -> int:
        """Runs each layer that can as the one op `decoder_layer` (DecoderLayer.fuse), or
        none when not `enabled` (torch.export traces the layers' own steps). Returns how
        many layers run fused."""
        return sum(cast(DecoderLayer, layer).fuse(enabled) for layer in self.layers)

    def _products(self) -> list[nn.Module]:
        """Every module that multiplies by a weight matrix: the projections and the head
        (the embedding's own module when the head is tied to it)."""
        head = self.embed if self.lm_head is None else self.lm_head
        return [getattr(layer, name) for layer in self.layers for name in PROJECTIONS] + [head]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            # Tied: the embedding is float (a quantised one comes with its own head).
            return F.linear(hidden, cast(nn.Embedding, self.embed).weight)
        logits: torch.Tensor = self.lm_head(hidden)
        return logits

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        kv: KVPool,
        cells: torch.Tensor,
        logit_rows: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """tokens, positions, cells: [T] long; logit_rows: [R] long -> float32 logits [R, V].

        The pool must already hold rows for `cells` (`kv.ensure`), and `plan` must be the
        cache's plan for this very step (every token in exactly one group). `lora`: the
        step's adapter rows (`AdapterBank.step`), None where no row has an adapter.
        """
        prepared = self.attention.prepare(plan)
        return self.forward_flat(tokens, positions, cells, prepared, kv.k, kv.v, logit_rows, lora)

    def forward_flat(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cells: torch.Tensor,
        attention: StepAttention,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        logit_rows: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """`forward` on tensors alone, the form `cellbatch.export` traces (without `lora`):
        the plan flat (`cellbatch.cache.flatten_plan`) and the pool as its per-layer K and
        V tensors."""
        hidden = self._decode_layers(tokens, positions, cells, attention, k, v, lora)
        return self._head(hidden, logit_rows)

    def forward_pooled(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        kv: KVPool,
        cells: torch.Tensor,
        logit_rows: torch.Tensor,
        hidden_rows: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the float32 hidden states [len(hidden_rows), H] of `hidden_rows`
        after the final norm (transformers' `last_hidden_state`)."""
        prepared = self.attention.prepare(plan)
        hidden = self._decode_layers(tokens, positions, cells, prepared, kv.k, kv.v, lora)
        return self._head(hidden, logit_rows), self._final_norm(hidden, hidden_rows).float()

    def _decode_layers(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cells: torch.Tensor,
        attention: StepAttention,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """The last layer's output for every token (and padding row: see min_rows), each
        row with its LoRA adapter where `lora` gives one."""
        pad = self.min_rows - tokens.shape[0]
        if pad > 0:
            # Padding rows (token 0 at position 0) go through the layers but are never
            # stored in the pool nor attended to.
            tokens, positions = F.pad(tokens, (0, pad)), F.pad(positions, (0, pad))
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        hidden = self.embed(tokens)
        for index, layer in enumerate(self.layers):
            window = self.config.layer_windows[index]
            adapters = None if lora is None else lora.layers[index]
            hidden = layer(hidden, cos, sin, k[index], v[index], cells, attention, window, adapters)
        out: torch.Tensor = hidden
        return out

    def _head(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits [len(rows), V] of `rows` of the last layer's output. The rows
        are padded with zero rows to `min_rows` first, so that the head's product rounds
        as it does for any count."""
        last = hidden[rows]
        count = last.shape[0]
        if count < self.min_rows:
            last = F.pad(last, (0, 0, 0, self.min_rows - count))
        return self._logits(self.norm(last))[:count].float()

    def _final_norm(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The final norm of `rows` of the last layer's output (a row's norm reads that
        row alone)."""
        normed: torch.Tensor = self.norm(hidden[rows])
        return normed
