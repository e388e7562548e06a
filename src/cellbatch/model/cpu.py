"""What this CPU offers the model's products: the feature questions that the `auto` choices
(dtype, activations, oneDNN packing) ask, in one place.

Owns: `cpu_has_fast_bf16`, `cpu_dtype` (what `auto` computes in), `cpu_has_int8_products`,
`int8_products_path` (which instruction runs those) and `cpu_has_amx`, and the rule they
share: a feature counts only when the CPU has
it (detected, never assumed) and torch runs at a vector width that includes it
(`torch.backends.cpu.get_cpu_capability()`); and `amx_switch`, the checked CELLBATCH_AMX,
which the compiled int8-input products read too.
Promises: with torch's own switch `ATEN_CPU_CAPABILITY=avx2`, cellbatch chooses as on an
AVX2 CPU: no AVX512 feature counts, so "auto" gives float32 (with int8 inputs to gate_up
and the head, by the AVX2 products), and the compiled kernels' AVX512 paths (which ask
the same of torch, in C++) stay off. With
`ONEDNN_MAX_CPU_ISA=AVX2` and `MKL_ENABLE_INSTRUCTIONS=AVX2` beside it, a process on an
AVX512 CPU runs the instructions an AVX2 CPU would (`benchmarks/cpu_kinds.py` uses this to
measure the AVX2 paths here); the memory and caches stay this machine's.
Never: imports the compiled kernels, or caches an answer (torch reads its capability once
per process; so do these questions' callers).
"""

from __future__ import annotations

import os

import torch

from cellbatch.types import InvalidArgumentError

# CELLBATCH_AMX: "auto" (unset: the int8-input products take AMX tiles for calls of enough
# rows, kernels/quantized_amx.cpp), "0" (never: the AVX512-VNNI path, as on a CPU without
# AMX) or "always" (every call: for the tests).
AMX_SWITCHES = ("auto", "0", "always")


def torch_runs_avx512() -> bool:
    """True when torch's kernels run at the AVX512 width on this process (the CPU has
    AVX512-F/BW/VL/DQ and ATEN_CPU_CAPABILITY does not cap it lower)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def _cpu_has(check: str) -> bool:
    """torch.cpu's detection of one feature (False where this torch lacks the question)."""
    return bool(getattr(torch.cpu, check, lambda: False)())


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX) and torch
    runs at the AVX512 width."""
    native = _cpu_has("_is_avx512_bf16_supported") or _cpu_has("_is_amx_tile_supported")
    return native and torch_runs_avx512()


def cpu_dtype() -> torch.dtype:
    """The dtype `auto` computes in here (the speed mode): bf16 where the CPU's bf16
    products are native, else float32."""
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def cpu_has_int8_products() -> bool:
    """True when the compiled int8-activation products have a vector path here: VPDPBUSD
    (AVX512-VNNI at the AVX512 width) or VPMADDUBSW (AVX2, which AVX512 CPUs have too).
    torch runs at one of those widths only on a CPU that has them."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles and torch runs at the AVX512 width, so that
    oneDNN's bf16 products may take the tile kernels (unless ONEDNN_MAX_CPU_ISA caps them)."""
    return _cpu_has("_is_amx_tile_supported") and torch_runs_avx512()


def int8_products_path() -> str:
    """Which arithmetic the compiled int8-input products take here, in words, as
    kernels/quantized_a8_inputs.cpp's `products_path` picks it: VPDPBUSD on AVX512-VNNI at the
    AVX512 width, VPMADDUBSW on AVX2, else (or with CELLBATCH_A8_PORTABLE=1) the portable
    loop."""
    if os.environ.get("CELLBATCH_A8_PORTABLE") == "1" or not cpu_has_int8_products():
        return "portable loop"
    if _cpu_has("_is_vnni_supported") and torch_runs_avx512():
        return "VPDPBUSD, AVX512-VNNI"
    return "VPMADDUBSW, AVX2"


def amx_switch() -> str:
    """The checked CELLBATCH_AMX switch ("auto" when unset); a value the kernels would
    refuse fails here, when a model is set up, with the choices."""
    value = os.environ.get("CELLBATCH_AMX", "") or "auto"
    if value not in AMX_SWITCHES:
        raise InvalidArgumentError(
            f"CELLBATCH_AMX={value!r} is not a choice: use auto (AMX tiles for the int8-input "
            "products of many rows, the default), 0 (never) or always (every call)"
        )
    return value
