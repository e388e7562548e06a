"""LoRA adapters as PEFT saves them, read and laid out for the fused projections.

Owns: `read_adapter` (a PEFT folder, `adapter_config.json` + `adapter_model.safetensors`,
checked against a model's `ModelConfig` and turned into a `LoraAdapter`), the scale rule
(`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`, per module where
`alpha_pattern` names it) and `ProductLora`, one adapter's low-rank pair for one of a
layer's four products in the layout of the op `lora_add` (`cellbatch.model.ops`).
Promises: an adapter either loads whole or not at all: a malformed folder, a config this
code does not run (DoRA, `modules_to_save`, LoRA biases, `fan_in_fan_out`), a module the
model lacks, a layer past the model's or a tensor of the wrong shape is one
`AdapterError` naming the file and every mismatch found (expected against got).
Beside a quantised base (`int8=True`) A and B are held as int8, a row of each per rank
(half the bytes a token reads; llama.cpp runs q8_0 adapters the same way), otherwise in
the model's dtype (float32 stays PEFT's arithmetic).
cellbatch fuses q/k/v into `qkv` and gate/up into `gate_up`: an adapter on q alone adds
to the first `q_size` columns of qkv's output, on up alone to the second half of
gate_up's, and so on (`ProductLora.segments`). The scale is folded into B in float32
before B takes the model's dtype, so the op adds `x · A · B` per row.
Never: touches a model's own weights (a base model stays as it loaded), or holds an
adapter's files open after reading.

Layout (what `lora_add` reads): for a product with K inputs, the modules an adapter
targets in it are concatenated along the rank: `a` [R, K] (R the sum of their ranks;
module m's lora_A in rows [r0, r0 + r_m)); `b` holds each module's scaled lora_B
transposed, [r_m, n_m] row-major, one after the other; `segments` int64 [S, 4] gives
per module (rank_start, rank_count, column_start, column_count) of the product's output;
`scales` is empty, or, where `a` and `b` are int8, float32 [R]: each rank's row of A and
its row of B (a rank belongs to one module) are quantised symmetrically (the row's
largest magnitude maps to 127, values round to the nearest, ties to even), and
scales[r] = A row r's scale times B row r's, so the op adds ((x · A^T) * scales) · B.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from cellbatch.model.config import ModelConfig
from cellbatch.types import InvalidArgumentError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The modules an adapter may target: PEFT's names of a Llama layer's linear layers, each
# with the fused product it lands in.
MODULE_PRODUCTS: dict[str, str] = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "o_proj": "o_proj",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
    "down_proj": "down",
}
# The fused products in the order decoder layers run them (decoder_layer.PROJECTIONS).
PRODUCTS = ("qkv", "o_proj", "gate_up", "down")
_KEY = re.compile(
    r"(?:^|\.)layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>[a-z_]+)"
    r"\.lora_(?P<side>[AB])\.weight$"
)
_LISTED = 8  # problems quoted in one error


class AdapterError(InvalidArgumentError):
    """An adapter that cannot run on this model; the message names the file and why."""


@dataclass(frozen=True)
class ProductLora:
    """One adapter's low-rank pair for one fused product (see the module's layout)."""

    a: torch.Tensor  # [R, K]
    b: torch.Tensor  # flat: per segment [rank_count, column_count], row-major
    segments: torch.Tensor  # int64 [S, 4]: rank_start, rank_count, column_start, column_count
    scales: torch.Tensor  # float32 [R] where a and b are int8, else empty

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.a, self.b, self.segments, self.scales)
        )


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter laid out for one model: per layer, per fused product it
    targets, its ProductLora."""

    path: Path
    rank: int  # the largest module rank
    targets: tuple[str, ...]  # PEFT module names it adapts, in MODULE_PRODUCTS' order
    layers: tuple[Mapping[str, ProductLora], ...]  # one per model layer; product -> pair
    dtype: torch.dtype
    int8: bool  # A and B held as int8 (see the module)

    @property
    def nbytes(self) -> int:
        return sum(pair.nbytes for layer in self.layers for pair in layer.values())


@dataclass(frozen=True)
class _Settings:
    """What is read of adapter_config.json."""

    alpha: float
    rslora: bool
    alpha_pattern: Mapping[str, float]

    def scale(self, module_path: str, rank: int) -> float:
        """PEFT's scaling of one module: its alpha over its rank (over sqrt(rank) with
        rsLoRA); `alpha_pattern` overrides alpha for the modules it names."""
        alpha = float(_pattern_value(self.alpha_pattern, module_path, self.alpha))
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank


def _pattern_value(patterns: Mapping[str, Any], module_path: str, default: Any) -> Any:
    """PEFT's rule for rank_pattern/alpha_pattern keys: a key applies to a module whose
    full name it matches as a regular expression at a dot boundary, to the end."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(?:.*\.)?(?:{key})", module_path):
            return value
    return default


def read_adapter(
    folder: str | Path, config: ModelConfig, dtype: torch.dtype, int8: bool = False
) -> LoraAdapter:
    """The PEFT LoRA adapter in `folder`, checked against `config` and laid out with
    weights in `dtype` (the model's compute dtype), or in int8 with `int8`; AdapterError
    naming the file and every problem found when it cannot run on this model."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise AdapterError(
            f"LoRA adapter {path} is not a folder; pass the folder PEFT's save_pretrained "
            f"wrote ({CONFIG_FILE} + {WEIGHTS_FILE})"
        )
    settings = _read_settings(path / CONFIG_FILE)
    tensors = _read_tensors(path / WEIGHTS_FILE)
    pairs = _pairs(path / WEIGHTS_FILE, tensors, config)
    layers: list[dict[str, ProductLora]] = [{} for _ in range(config.num_layers)]
    for layer in range(config.num_layers):
        for product in PRODUCTS:
            modules = [
                (module, pairs[(layer, module)])
                for module in MODULE_PRODUCTS
                if MODULE_PRODUCTS[module] == product and (layer, module) in pairs
            ]
            if modules:
                pair = _product_lora(layer, modules, config, settings)
                layers[layer][product] = int8_pair(pair) if int8 else _as_dtype(pair, dtype)
    targets = tuple(m for m in MODULE_PRODUCTS if any(m == key[1] for key in pairs))
    rank = max(int(a.shape[0]) for a, _ in pairs.values())
    return LoraAdapter(path, rank, targets, tuple(layers), dtype, int8)


def _read_settings(file: Path) -> _Settings:
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterError(
            f"{file} is missing: a PEFT LoRA adapter folder holds {CONFIG_FILE} and "
            f"{WEIGHTS_FILE} (what PeftModel.save_pretrained writes)"
        ) from None
    except (OSError, ValueError) as error:
        raise AdapterError(f"{file} is not readable JSON: {error}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    problems = []
    kind = raw.get("peft_type")
    if kind != "LORA":
        problems.append(f"peft_type is {kind!r}, only 'LORA' adapters run here")
    unsupported = {
        "use_dora": "DoRA adapters (use_dora) are not supported; merge or retrain without it",
        "fan_in_fan_out": "fan_in_fan_out is for Conv1D layers (GPT-2), not Llama-family ones",
        "lora_bias": "LoRA biases (lora_bias) are not supported",
    }
    problems += [why for key, why in unsupported.items() if raw.get(key)]
    if raw.get("modules_to_save"):
        problems.append(
            f"modules_to_save {raw['modules_to_save']!r}: full copies of base modules are "
            "not supported, only low-rank pairs"
        )
    if raw.get("bias", "none") != "none":
        problems.append(f"bias is {raw.get('bias')!r}; only 'none' is supported")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        lacking = [t for t in targets if t not in MODULE_PRODUCTS]
        if lacking:
            problems.append(
                f"target_modules {lacking} are not among the model's adaptable modules "
                f"({', '.join(MODULE_PRODUCTS)})"
            )
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        problems.append(f"r must be an integer >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        problems.append(f"lora_alpha must be a number, got {alpha!r}")
    patterns = {key: raw.get(key) or {} for key in ("rank_pattern", "alpha_pattern")}
    problems += [
        f"{key} must be an object of module patterns, got {value!r}"
        for key, value in patterns.items()
        if not isinstance(value, dict)
    ]
    if problems:
        raise AdapterError(f"{file}: " + "; ".join(problems))
    # rank_pattern gives ranks other than r: each module's rank is read from its tensors.
    rslora = bool(raw.get("use_rslora", False))
    return _Settings(float(cast(float, alpha)), rslora, patterns["alpha_pattern"])


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        hint = " (adapter_model.bin is not supported: save with safe_serialization)"
        bin_file = file.with_name("adapter_model.bin")
        raise AdapterError(f"{file} is missing" + (hint if bin_file.is_file() else ""))
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(f"{file} is not a readable safetensors file: {error}") from None


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each module's (in_features, out_features) in this model."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _pairs(
    file: Path, tensors: Mapping[str, torch.Tensor], config: ModelConfig
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [r, in], B [out, r]) of every module the file adapts, after
    checking every name and shape against the model (one error listing them all)."""
    shapes = _expected_shapes(config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    problems: list[str] = []
    for name, tensor in tensors.items():
        match = _KEY.search(name)
        if match is None:
            problems.append(f"unexpected tensor {name} (only lora_A/lora_B of {_modules()})")
            continue
        layer, module, side = int(match["layer"]), match["module"], match["side"]
        if module not in shapes:
            problems.append(f"{name}: the model has no adaptable module {module!r}")
        elif layer >= config.num_layers:
            problems.append(f"{name}: layer {layer}, but the model has {config.num_layers}")
        elif not tensor.is_floating_point() or tensor.dim() != 2:
            problems.append(
                f"{name}: a 2-d float tensor expected, got {tensor.dtype} {tuple(tensor.shape)}"
            )
        else:
            found.setdefault((layer, module), {})[side] = tensor
    pairs = {}
    for (layer, module), sides in sorted(found.items()):
        where = f"layers.{layer}.{module}"
        if set(sides) != {"A", "B"}:
            problems.append(f"{where}: lora_A and lora_B both needed, found {sorted(sides)}")
            continue
        a, b = sides["A"], sides["B"]
        fan_in, fan_out = shapes[module]
        rank = a.shape[0]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            problems.append(
                f"{where}: expected lora_A [r, {fan_in}] and lora_B [{fan_out}, r], got "
                f"{list(a.shape)} and {list(b.shape)} (an adapter for another base model?)"
            )
            continue
        pairs[(layer, module)] = (a, b)
    if not problems and not pairs:
        problems.append("no lora_A/lora_B tensors")
    if problems:
        listed = "; ".join(problems[:_LISTED]) + (" ..." if len(problems) > _LISTED else "")
        raise AdapterError(
            f"{file} does not fit the model ({config.architecture}, {config.num_layers} "
            f"layers, hidden {config.hidden_size}, q {config.q_size} / kv {config.kv_size}, "
            f"intermediate {config.intermediate_size}): {len(problems)} problem(s): {listed}"
        )
    return pairs


def _modules() -> str:
    return ", ".join(MODULE_PRODUCTS)


def _product_lora(
    layer: int,
    modules: list[tuple[str, tuple[torch.Tensor, torch.Tensor]]],
    config: ModelConfig,
    settings: _Settings,
) -> ProductLora:
    """The float32 pair of one fused product from the modules that land in it (see the
    layout)."""
    columns = _column_starts(config)
    a_parts, b_parts, segments = [], [], []
    rank_start = 0
    for module, (a, b) in modules:
        rank = a.shape[0]
        part = "self_attn" if MODULE_PRODUCTS[module] in ("qkv", "o_proj") else "mlp"
        scale = settings.scale(f"model.layers.{layer}.{part}.{module}", rank)
        a_parts.append(a.float())
        b_parts.append((b.float() * scale).t().contiguous().flatten())
        segments.append((rank_start, rank, columns[module], b.shape[0]))
        rank_start += rank
    return ProductLora(
        torch.cat(a_parts).contiguous(),
        torch.cat(b_parts),
        torch.tensor(segments, dtype=torch.int64),
        torch.empty(0, dtype=torch.float32),
    )


def _as_dtype(pair: ProductLora, dtype: torch.dtype) -> ProductLora:
    return ProductLora(pair.a.to(dtype), pair.b.to(dtype), pair.segments, pair.scales)


def int8_pair(pair: ProductLora) -> ProductLora:
    """A float32 pair with A and B in int8, a scale per rank (see the layout)."""
    a, a_scales = _int8_rows(pair.a)
    b = torch.empty(pair.b.shape, dtype=torch.int8)
    b_scales = torch.zeros(pair.rank)
    start = 0
    for rank_start, ranks, _, columns in pair.segments.tolist():
        block = slice(start, start + ranks * columns)
        rows, scales = _int8_rows(pair.b[block].view(ranks, columns))
        b[block] = rows.flatten()
        b_scales[rank_start : rank_start + ranks] = scales
        start += ranks * columns
    return ProductLora(a, b, pair.segments, (a_scales * b_scales).contiguous())


def _int8_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [n, m] as int8 rows and each row's scale (an all-zero row: scale 0)."""
    scales = values.abs().amax(dim=1) / 127
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(values / divisor[:, None]).to(torch.int8).contiguous(), scales


def _column_starts(config: ModelConfig) -> dict[str, int]:
    """Where each module's outputs start in its fused product's output."""
    q, kv, i = config.q_size, config.kv_size, config.intermediate_size
    return {
        "q_proj": 0,
        "k_proj": q,
        "v_proj": q + kv,
        "o_proj": 0,
        "gate_proj": 0,
        "up_proj": i,
        "down_proj": 0,
    }
