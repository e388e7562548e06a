"""What a loaded model's weights are: their formats per role in words, the kernel of the
quantised products, bytes per format, and what runs the GGUF blocks kept as they are.

Owns: `WeightsSummary`, `describe` and `describe_kept`.
Promises: reads the modules only; shared tensors (a tied head and its embedding) count
once; the words name each kept GGUF kind with its products' count and size.
Never: changes a module or reads a file.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from cellbatch.model.cpu import amx_switch, cpu_has_amx, int8_products_path
from cellbatch.model.quantized import DecoderModel


@dataclass(frozen=True)
class WeightsSummary:
    """What a model's weights are: `format` in words ("int4, embedding int8, lm_head
    int8"; a float model says its dtype), `formats` per role, `kernel` of the quantised
    products ("none" without any), and `bytes_by_format`."""

    format: str
    formats: dict[str, str]
    kernel: str
    bytes_by_format: dict[str, int]


def describe(model: DecoderModel) -> WeightsSummary:
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
    # Every product that quantises its inputs (int4's chosen set, quantized.a8_products;
    # kept GGUF blocks' all), in the layer's order, then the head.
    products: list[tuple[str, nn.Module | None]] = []
    if first is not None:
        products += first.named_children()
    products.append(("lm_head", model.lm_head))
    with_a8 = [name for name, m in products if getattr(m, "activations", "") == "int8"]
    if with_a8:
        words += f" ({', '.join(with_a8)} with int8 activations)"
    kept = describe_kept(model)
    if kept:
        words += f"; {kept}"
    # Quantised products, and kept GGUF blocks (kquants.KQuantLinear, whose bytes count
    # per GGUF kind: `bytes_by_kind`).
    kernels = {str(m.kernel) for m in model.modules() if hasattr(m, "kernel")}
    counted: set[int] = set()
    by_format: dict[str, int] = {}
    for module in model.modules():
        kinds: dict[str, int] | None = getattr(module, "bytes_by_kind", None)
        for name, param in module.named_parameters(recurse=False):
            if id(param) in counted:
                continue
            counted.add(id(param))
            quantized = name != "bias" and hasattr(module, "format")
            if quantized and kinds is not None:
                if name == "codes":  # its codes and scales, counted once per kind
                    for kind, size in kinds.items():
                        by_format[kind] = by_format.get(kind, 0) + size
                continue
            # A quantised module's format is its weight's name for it, a str.
            fmt = str(module.format) if quantized else str(param.dtype).removeprefix("torch.")
            by_format[fmt] = by_format.get(fmt, 0) + param.numel() * param.element_size()
    return WeightsSummary(words, formats, "+".join(sorted(kernels)) or "none", by_format)


def describe_kept(model: DecoderModel) -> str:
    """What runs a model's GGUF blocks kept as they are (`kquants.KQuantLinear`: a
    `bytes_by_kind` per kind), per kind ("" when none): "Q4_K in 56 products (457.9 MiB),
    Q6_K in 17 products (317.1 MiB) kept as they are: kquant_matmul_a8, int8 inputs
    (VPDPBUSD, AVX512-VNNI; AMX tiles for Q4_K, Q5_K, Q6_K from 4 rows)"."""
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    compiled = False
    for module in model.modules():
        kinds: dict[str, int] | None = getattr(module, "bytes_by_kind", None)
        if kinds is None or not hasattr(module, "kernel"):  # the embedding shares its head's
            continue
        compiled = module.kernel == "compiled"
        for kind, size in kinds.items():
            counts[kind] = counts.get(kind, 0) + 1
            sizes[kind] = sizes.get(kind, 0) + size
    if not counts:
        return ""
    parts = [
        f"{kind} in {counts[kind]} products ({sizes[kind] / 2**20:.1f} MiB)"
        for kind in sorted(counts)
    ]
    how = int8_products_path() if compiled else "torch implementation"
    if compiled and how.endswith("AVX512-VNNI") and cpu_has_amx() and amx_switch() != "0":
        # as kernels/quantized_kq.cpp chooses
        how += "; AMX tiles for Q4_K, Q5_K, Q6_K from 4 rows"
    return f"{', '.join(parts)} kept as they are: kquant_matmul_a8, int8 inputs ({how})"
