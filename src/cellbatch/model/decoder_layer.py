"""One decoder layer of the packed-step transformer: pre-norm attention and a SwiGLU MLP
over a step's hidden rows.

Owns: `DecoderLayer` (fused q/k/v and gate/up products, as `nn.Linear`s that loading may
swap for quantised or packed ones), `RMSNorm`, what a layer attends with
(`LayerAttention`) and the names of its products (`PROJECTIONS`).
Promises: the layer's steps are the ops of the model's table (`cellbatch.model.ops`), so a
row's result does not depend on the other rows of its step; `fuse` runs the same steps as
the one compiled op `decoder_layer`, with the same bits.
Never: owns the KV cache or the plan (it is handed both each step), or pads the rows
(`PackedTransformer` does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from cellbatch.cache import AttentionPlan, FlatAttentionPlan
from cellbatch.model.config import ModelConfig
from cellbatch.model.device_attention import CellRows
from cellbatch.model.ops import PRODUCT_OPS, Ops
from cellbatch.types import ModelGeometry

if TYPE_CHECKING:
    from cellbatch.model.adapters import LayerLora

# A DecoderLayer's weight-matrix products, by attribute name.
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")
# What a step's attention is handed: the CPU op's flat plan (CellAttention), or the cell
# rows of a model on a device (cellbatch.model.device_attention.DeviceAttention).
StepAttention = FlatAttentionPlan | CellRows


class LayerAttention(Protocol):
    """What a layer attends with: CellAttention, or a DeviceAttention on a device."""

    geometry: ModelGeometry

    def prepare(self, plan: AttentionPlan) -> Any: ...

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        prepared: Any,
        window: int | None,
    ) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype (the op
    `rms_norm` of the model's table)."""

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: str | torch.device, ops: Ops
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU MLP, with fused q/k/v and gate/up projections."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: str | torch.device,
        attention: LayerAttention,
        ops: Ops,
    ) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.attention = attention
        self.ops = ops
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device, ops)
        self.qkv = nn.Linear(
            c.hidden_size,
            c.q_size + 2 * c.kv_size,
            bias=c.attention_bias,
            dtype=dtype,
            device=device,
        )
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device, ops) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device, ops) if c.qk_norm else None
        self.o_proj = nn.Linear(
            c.q_size, c.hidden_size, bias=c.attention_out_bias, dtype=dtype, device=device
        )
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device, ops)
        self.gate_up = nn.Linear(
            c.hidden_size, 2 * c.intermediate_size, bias=False, dtype=dtype, device=device
        )
        self.down = nn.Linear(
            c.intermediate_size, c.hidden_size, bias=False, dtype=dtype, device=device
        )
        # The arguments of ops.decoder_layer after the step's own, when the layer runs as
        # that one op (`fuse`); None: the Python steps below.
        self.fused: tuple[object, ...] | None = None

    def fuse(self, enabled: bool = True) -> bool:
        """Runs the layer as the compiled op `decoder_layer` (one call instead of ~15; the
        same bits) when `enabled` and it can: compiled kernels, and all four products
        quantised ones without a bias (cellbatch.model.quantized), no q/k norms."""
        products = [getattr(self, name) for name in PROJECTIONS]
        can = (
            enabled
            and self.ops.kind == "compiled"
            and self.q_norm is None
            and all(getattr(p, "op", None) in PRODUCT_OPS and p.bias is None for p in products)
        )
        self.fused = None
        if can:
            qkv, o_proj, gate_up, down = (
                (p.codes, p.scales, PRODUCT_OPS.index(p.op)) for p in products
            )
            self.fused = (
                self.input_norm.weight,
                self.post_norm.weight,
                self.input_norm.eps,
                *qkv,
                *o_proj,
                *gate_up,
                self.down.in_features,
                *down,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.attention.geometry.attention_scale,
            )
        return can

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cells: torch.Tensor,
        prepared: StepAttention,
        window: int | None,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        """The layer over a step's hidden rows; `lora` adds the step's adapters to the
        rows that carry one (cellbatch.model.adapters), after each product."""
        if self.fused is not None:  # compiled ops, hence CellAttention and its flat plan
            prepared = cast(FlatAttentionPlan, prepared)
            out: torch.Tensor = self.ops.decoder_layer(
                hidden,
                cos,
                sin,
                k_cache,
                v_cache,
                cells,
                *prepared.tensors,
                prepared.num_tokens,
                window or 0,
                *self.fused,
                [] if lora is None else lora.args,
            )
            return out
        tokens = hidden.shape[0]
        normed = self.input_norm(hidden)
        qkv = self._adapted(0, self.qkv(normed), normed, lora)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # then k_norm is one too (config.qk_norm)
            q, k = self.q_norm(q), cast("RMSNorm", self.k_norm)(k)
        # Rows past len(cells) are padding (PackedTransformer.min_rows): never stored.
        self.ops.rope_store(q, k, v, cos, sin, cells, k_cache, v_cache)
        attended = self.attention.attend(q, k_cache, v_cache, prepared, window)
        hidden = hidden + self._adapted(1, self.o_proj(attended), attended, lora)
        normed = self.post_norm(hidden)
        activated = self.ops.silu_mul(self._adapted(2, self.gate_up(normed), normed, lora))
        return hidden + self._adapted(3, self.down(activated), activated, lora)

    def _adapted(
        self, product: int, out: torch.Tensor, x: torch.Tensor, lora: LayerLora | None
    ) -> torch.Tensor:
        """`out` = product `product` (PROJECTIONS' order) of x, plus the adapters' low-rank
        products on their rows."""
        weights = None if lora is None else lora.products[product]
        if weights is not None:
            assert lora is not None
            self.ops.lora_add(out, x, lora.rows, lora.offsets, weights)
        return out
