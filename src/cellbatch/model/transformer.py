"""The packed-step transformer: one forward over a step's tokens from many sequences.

Owns: `PackedTransformer` (a Llama-family decoder whose batch is one token axis),
`resolve_dtype`, and the RoPE frequency rule.
Promises: `forward(tokens, positions, plan, kv, cells, logit_rows)` writes each token's
K/V into its cell of the `KVPool`, attends each token to exactly the cells the
`AttentionPlan` gives its sequence (gathered per plan group, so a token's work scales with
its own context; a sliding-window layer skips the key blocks wholly outside its window),
and returns float32 logits for `logit_rows` only. Numerics follow transformers' eager
attention: compute in the weight dtype, RMSNorm and softmax in float32, RoPE from float32
angles. A token's logits are bit-identical whatever else shares its step (see
PackedTransformer).
Never: owns cells or sequences (`cellbatch.cache` does), samples, or loops in Python over
tokens; the only loops run over layers and the (at most two) plan groups.

Positions index a precomputed cos/sin table, so they must lie in [0, max_positions)
(by default the model's `max_position_embeddings`). A table lookup, unlike computing
cos/sin per step, gives a position the same angles whatever else is in the step.
Attention is written out (two GEMMs and a softmax) rather than calling torch's SDPA: the
CPU flash kernel's rounding depends on the padded key length, i.e. on the other
sequences of the group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cellbatch.cache import AttentionPlan, KVPool
from cellbatch.model.config import ModelConfig
from cellbatch.types import InvalidArgumentError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Keys are gathered and summed in blocks of this many positions (see _weighted_values).
KEY_BLOCK = 64
# Fewest rows per GEMM call for which a row's result does not depend on the row count
# (measured on the development CPU: fp32 rounds calls of < 12 rows differently, bf16 only
# 1-row calls; fp16 is not measured, so it gets fp32's margin).
MIN_GEMM_ROWS: dict[torch.dtype, int] = {torch.float32: 16, torch.bfloat16: 2, torch.float16: 16}


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def resolve_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype for "auto" | "float32" | "bfloat16" | "float16" (or fp32/bf16/fp16).

    "auto" picks bf16 where the hardware has native bf16 matrix units (on the development
    CPU, AVX512-BF16 runs decode-shaped matmuls about 2.2x faster than fp32), else fp32.
    fp16 is never auto on CPU: without AVX512-FP16 it runs about 4x slower than fp32.
    """
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise InvalidArgumentError(f"dtype {name} is not supported; use one of {list(DTYPES)}")
        return name
    key = _DTYPE_ALIASES.get(name, name)
    if key == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if key not in DTYPES:
        raise InvalidArgumentError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[key]


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
    """A bf16 Linear whose weight oneDNN has reordered once for its own CPU kernels.

    On the development CPU (AVX512-BF16) this runs the model's products 1.3-1.5x faster
    at decode batch sizes, with results bit-identical to F.linear for any row count, so
    parity and batch invariance are unchanged.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def can_pack_linears(dtype: torch.dtype, device: str | torch.device) -> bool:
    """oneDNN's reordered weights pay off for bf16 on CPUs with native bf16 products."""
    return (
        dtype == torch.bfloat16
        and torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and cpu_has_fast_bf16()
    )


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: str | torch.device
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@dataclass
class _GroupWork:
    """One plan group prepared for one window size: what every layer of that window reads."""

    rows: torch.Tensor  # [G, Tq] query rows (padded queries repeat a valid row)
    key_rows: torch.Tensor  # [kv_heads * G * Tk] rows of the pool seen as [cells * kv_heads, D]
    keys: int  # Tk: keys per sequence, a multiple of KEY_BLOCK (pad: the scratch cell)
    bias: torch.Tensor  # [kv_heads * G, share * Tq, Tk] 0 where visible, -inf where not
    dest: torch.Tensor  # [N] token rows the valid queries write
    valid: torch.Tensor | None  # [G * Tq] bool, None when every query is valid


def _prepare_groups(
    plan: AttentionPlan,
    window: int | None,
    scratch_cell: int,
    min_query_rows: int,
    kv_heads: int,
    share: int,
    dtype: torch.dtype,
) -> list[_GroupWork]:
    """Pads each group so that a query's result does not depend on the other sequences in
    its group: keys to whole KEY_BLOCKs aligned on absolute positions, and (when
    `min_query_rows` > 1) multi-token groups to at least that many query rows. The mask
    becomes an additive bias laid out like the layers' score products, built once per
    step and window rather than once per layer."""
    work = []
    for group in plan.groups:
        rows, cells, visible, valid = group.rows, group.cells, group.mask(window), group.query_valid
        if window is not None:
            # Blocks of keys wholly at positions <= (lowest query position) - window are
            # invisible to the whole group: leave them out of the gather.
            lowest = int(group.query_pos[valid].min())
            start = max(0, lowest - window + 1) // KEY_BLOCK * KEY_BLOCK
            cells, visible = cells[:, start:], visible[..., start:]
        pad_keys = -cells.shape[1] % KEY_BLOCK
        cells = F.pad(cells, (0, pad_keys), value=scratch_cell)
        visible = F.pad(visible, (0, pad_keys), value=False)
        num_groups, num_queries = rows.shape
        if 1 < num_queries < min_query_rows:
            extra = min_query_rows - num_queries
            rows = torch.cat([rows, rows[:, -1:].expand(num_groups, extra)], dim=1)
            visible = torch.cat([visible, visible[:, :, -1:].expand(-1, -1, extra, -1)], dim=2)
            valid = F.pad(valid, (0, extra), value=False)
            num_queries = min_query_rows
        keys = cells.shape[1]
        bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        bias.masked_fill_(~visible, float("-inf"))
        # [G, 1, Tq, Tk] -> [kv_heads * G, share * Tq, Tk], the layout of the score products.
        bias = bias[None].expand(kv_heads, num_groups, share, num_queries, keys)
        # Row h + kv_heads * cell of the pool seen as [cells * kv_heads, D] is head h of
        # that cell: one row gather yields K/V already laid out [kv_heads, G, Tk, D].
        heads = torch.arange(kv_heads, device=cells.device)[:, None]
        all_valid = bool(valid.all())
        work.append(
            _GroupWork(
                rows=rows,
                key_rows=(cells.reshape(1, -1) * kv_heads + heads).reshape(-1),
                keys=keys,
                bias=bias.reshape(kv_heads * num_groups, share * num_queries, keys),
                dest=rows.reshape(-1) if all_valid else rows[valid],
                valid=None if all_valid else valid.reshape(-1),
            )
        )
    return work


def _weighted_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [B, M, Tk] @ values [B, Tk, D] -> [B, M, D], batch-invariantly.

    fp32 GEMMs choose how to split the Tk sum from Tk itself, so a padded Tk changed the
    rounding; there the sum runs as fixed KEY_BLOCK-key products added in block order
    (masked keys add exact zeros). bf16/fp16 GEMMs proved invariant to Tk in one call,
    which also keeps their fp32 accumulation over all keys.
    """
    if probs.dtype != torch.float32:
        return torch.bmm(probs, values)
    batch, rows, keys = probs.shape
    blocks = keys // KEY_BLOCK
    per_block = torch.matmul(
        probs.view(batch, rows, blocks, KEY_BLOCK).transpose(1, 2),
        values.view(batch, blocks, KEY_BLOCK, values.shape[-1]),
    )
    return per_block.sum(dim=1)


class DecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU MLP, with fused q/k/v and gate/up projections."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.qkv = nn.Linear(
            c.hidden_size,
            c.q_size + 2 * c.kv_size,
            bias=c.attention_bias,
            dtype=dtype,
            device=device,
        )
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device) if c.qk_norm else None
        self.o_proj = nn.Linear(
            c.q_size, c.hidden_size, bias=c.attention_out_bias, dtype=dtype, device=device
        )
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.gate_up = nn.Linear(
            c.hidden_size, 2 * c.intermediate_size, bias=False, dtype=dtype, device=device
        )
        self.down = nn.Linear(
            c.intermediate_size, c.hidden_size, bias=False, dtype=dtype, device=device
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cells: torch.Tensor,
        groups: list[_GroupWork],
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv(self.input_norm(hidden))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # Rows past len(cells) are padding (PackedTransformer.min_rows): never stored.
        real = cells.shape[0]
        k_cache.index_copy_(0, cells, k[:real].to(k_cache.dtype))
        v_cache.index_copy_(0, cells, v[:real].to(v_cache.dtype))
        attended = self._attend(q, k_cache, v_cache, groups, zero_fill=real < tokens)
        hidden = hidden + self.o_proj(attended)
        gate, up = self.gate_up(self.post_norm(hidden)).chunk(2, dim=-1)
        return hidden + self.down(F.silu(gate) * up)

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        groups: list[_GroupWork],
        zero_fill: bool,
    ) -> torch.Tensor:
        """Grouped-query attention per plan group, as transformers' eager attention does it
        (scores in the compute dtype, softmax in fp32). Laid out KV-head-major: the query
        heads sharing a KV head are stacked as rows of one product, so K/V are never
        repeated; scale and mask are applied inside the score GEMM (baddbmm)."""
        kv_heads, head_dim = self.num_kv_heads, self.head_dim
        share = self.num_heads // kv_heads
        new = q.new_zeros if zero_fill else q.new_empty
        out = new(q.shape[0], self.num_heads * head_dim)
        for g in groups:
            num_groups, num_queries = g.rows.shape
            batch = kv_heads * num_groups
            # q[rows]: [G, Tq, kv_heads * share, D] -> [kv_heads * G, share * Tq, D]
            query = (
                q[g.rows]
                .view(num_groups, num_queries, kv_heads, share, head_dim)
                .permute(2, 0, 3, 1, 4)
                .reshape(batch, share * num_queries, head_dim)
            )
            # One row gather each into contiguous [kv_heads * G, Tk, D] (so every group
            # size takes the same GEMM path); the pool's dtype may differ from ours.
            key, value = (
                cache.view(-1, head_dim)
                .index_select(0, g.key_rows)
                .view(batch, g.keys, head_dim)
                .to(q.dtype)
                for cache in (k_cache, v_cache)
            )
            scores = torch.baddbmm(g.bias, query, key.transpose(1, 2), alpha=self.scale)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            attended = (
                _weighted_values(probs, value)
                .view(kv_heads, num_groups, share, num_queries, head_dim)
                .permute(1, 3, 0, 2, 4)
                .reshape(num_groups * num_queries, self.num_heads * head_dim)
            )
            out.index_copy_(0, g.dest, attended if g.valid is None else attended[g.valid])
        return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout: x * cos + rotate_half(x) * sin, cos/sin [T, 1, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class PackedTransformer(nn.Module):
    """A Llama-family decoder over one packed token axis (DESIGN §7).

    Batch invariance: a token's logits are bit-identical whatever else shares its step
    (other sequences, their lengths, the token's place on the axis, the chunking of its
    prompt). Three things make it so: every matrix product runs on at least `min_rows`
    rows (zero rows are appended, then dropped; default MIN_GEMM_ROWS of the dtype), since
    CPU GEMMs round a row differently in calls of very few rows; attention operands are
    made contiguous so every group size takes the same GEMM path; and keys are padded to
    whole KEY_BLOCKs aligned on positions (see _weighted_values).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_positions: int | None = None,
        min_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.max_positions = max_positions or config.max_position_embeddings
        self.min_rows = MIN_GEMM_ROWS.get(dtype, 16) if min_rows is None else min_rows
        share = config.num_heads // config.num_kv_heads
        # Attention products stack `share` heads per query: this many queries fill min_rows.
        self._min_query_rows = -(-self.min_rows // share)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (
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

    def pack_linears(self) -> None:
        """Swaps every projection and the LM head for a PackedLinear where that is faster
        (see can_pack_linears); a tied head gets its own packed copy of the embedding."""
        if not can_pack_linears(self.dtype, self.embed.weight.device):
            return
        for layer in self.layers:
            for name in ("qkv", "o_proj", "gate_up", "down"):
                linear = getattr(layer, name)
                setattr(layer, name, PackedLinear(linear.weight, linear.bias))
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        self.lm_head = PackedLinear(head, None)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embed.weight)
        return self.lm_head(hidden)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        kv: KVPool,
        cells: torch.Tensor,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """tokens, positions, cells: [T] long; logit_rows: [R] long -> float32 logits [R, V].

        The pool must already hold rows for `cells` (`kv.ensure`), and `plan` must be the
        cache's plan for this very step (every token in exactly one group).
        """
        pad = self.min_rows - tokens.shape[0]
        if pad > 0:
            # Padding rows (token 0 at position 0) go through the layers but are never
            # stored in the pool nor attended to.
            tokens, positions = F.pad(tokens, (0, pad)), F.pad(positions, (0, pad))
        cos = self.rope_cos[positions].to(self.dtype)[:, None, :]
        sin = self.rope_sin[positions].to(self.dtype)[:, None, :]
        c = self.config
        work = {
            window: _prepare_groups(
                plan,
                window,
                kv.scratch_cell,
                self._min_query_rows,
                c.num_kv_heads,
                c.num_heads // c.num_kv_heads,
                self.dtype,
            )
            for window in set(c.layer_windows)
        }
        hidden = self.embed(tokens)
        for index, layer in enumerate(self.layers):
            window = self.config.layer_windows[index]
            hidden = layer(hidden, cos, sin, kv.k[index], kv.v[index], cells, work[window])
        last = hidden[logit_rows]
        rows = last.shape[0]
        if rows < self.min_rows:
            last = F.pad(last, (0, 0, 0, self.min_rows - rows))
        return self._logits(self.norm(last))[:rows].float()
