"""Compiled CPU kernels: built on this machine on first use, then loaded from torch's cache.

Owns: building and loading the library of CPU kernels for the ops of `cellbatch.model.ops`
(`cell_attention.cpp`: cell_attention; `fused_ops.cpp`: rms_norm, rope_store, silu_mul)
with torch's C++ extension tools, for this CPU's vector width.
Promises: `load()` says whether the kernels are loaded; when they cannot be built here (no
compiler, no ninja, or `CELLBATCH_KERNELS=0`) it returns False, with the reason in
`unavailable_reason()` and one warning in the log. The first build takes about 20 s; later
processes load the cached library in well under a second.
Never: raises for a missing toolchain (the model then runs the torch implementations), or
builds twice in one process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("cell_attention.cpp", "fused_ops.cpp")]
_HEADERS = [Path(__file__).with_name("common.h")]
# Per torch CPU capability: the instruction sets to compile for, and the matching macro
# that selects ATen's vector types (at::vec) for that width.
_CAPABILITY_FLAGS: dict[str, list[str]] = {
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-DCPU_CAPABILITY_AVX512",
        "-DCPU_CAPABILITY=AVX512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_capability() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in _CAPABILITY_FLAGS else "DEFAULT"


def _build() -> None:
    from torch.utils.cpp_extension import load

    capability = _cpu_capability()
    source = b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)
    # The name keys torch's build cache: a new source, torch or vector width builds anew.
    digest = hashlib.sha256(source + torch.__version__.encode() + capability.encode())
    name = f"cellbatch_kernels_{capability.lower()}_{digest.hexdigest()[:12]}"
    load(
        name=name,
        sources=[str(path) for path in _SOURCES],
        # No contraction of a*b+c into one fused multiply-add behind our back: the ops
        # promise torch's roundings, and torch's elementwise kernels round each step.
        extra_cflags=[
            "-O3",
            "-fopenmp",
            "-ffp-contract=off",
            *_CAPABILITY_FLAGS.get(capability, []),
        ],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def _summary(error: Exception) -> str:
    """The compiler's first error line if there is one, else the exception's own line."""
    lines = str(error).splitlines()
    errors = [line for line in lines if "error" in line.lower() and ": " in line]
    return (errors[1:2] or errors[:1] or lines[:1] or [type(error).__name__])[0][-300:]


def disabled() -> bool:
    """True when the user switched the compiled kernels off (CELLBATCH_KERNELS=0)."""
    return os.environ.get("CELLBATCH_KERNELS", "1") == "0"


def load() -> bool:
    """Builds (first call only) and loads the compiled kernels; False if they cannot be."""
    with _lock:
        if "loaded" not in _state:
            loaded, reason = False, ""
            if disabled():
                reason = "disabled by CELLBATCH_KERNELS=0"
            else:
                try:
                    _build()
                    loaded = True
                except Exception as error:  # any toolchain failure means "not here"
                    reason = _summary(error)
                    log.warning(
                        "cellbatch: compiled kernels unavailable (%s); using the slower "
                        "pure-torch path. Install a C++ compiler and ninja to enable them.",
                        reason,
                    )
            _state["loaded"], _state["reason"] = loaded, reason
        return bool(_state["loaded"])


def unavailable_reason() -> str:
    """Why load() returned False ("" when it did not, or was not yet asked)."""
    return str(_state.get("reason", ""))
