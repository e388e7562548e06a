"""Compiled CPU kernels: built on this machine on first use, then loaded from torch's cache.

Owns: building and loading `cell_attention.cpp` (the op `torch.ops.cellbatch.cell_attention`)
with torch's C++ extension tools, for this CPU's vector width.
Promises: `cell_attention_op()` returns the op, or None (with the reason in
`unavailable_reason()`, and one warning in the log) when it cannot be built here: no
compiler, no ninja, a non-CPU build of torch, or `CELLBATCH_KERNELS=0`. The first build
takes about 15 s; later processes load the cached library in well under a second.
Never: raises for a missing toolchain (the model then uses the pure-torch path), or builds
twice in one process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cell_attention.cpp")
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


def _build() -> Callable[..., None]:
    from torch.utils.cpp_extension import load

    capability = _cpu_capability()
    source = _SOURCE.read_bytes()
    # The name keys torch's build cache: a new source, torch or vector width builds anew.
    digest = hashlib.sha256(source + torch.__version__.encode() + capability.encode())
    name = f"cellbatch_kernels_{capability.lower()}_{digest.hexdigest()[:12]}"
    load(
        name=name,
        sources=[str(_SOURCE)],
        extra_cflags=["-O3", "-fopenmp", *_CAPABILITY_FLAGS.get(capability, [])],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.cellbatch.cell_attention


def _summary(error: Exception) -> str:
    """The compiler's first error line if there is one, else the exception's own line."""
    lines = str(error).splitlines()
    errors = [line for line in lines if "error" in line.lower() and ": " in line]
    return (errors[1:2] or errors[:1] or lines[:1] or [type(error).__name__])[0][-300:]


def cell_attention_op() -> Callable[..., None] | None:
    """torch.ops.cellbatch.cell_attention, built on first call; None if it cannot be."""
    with _lock:
        if "op" not in _state:
            op, reason = None, ""
            if os.environ.get("CELLBATCH_KERNELS", "1") == "0":
                reason = "disabled by CELLBATCH_KERNELS=0"
            else:
                try:
                    op = _build()
                except Exception as error:  # any toolchain failure means "not here"
                    reason = _summary(error)
                    log.warning(
                        "cellbatch: compiled attention unavailable (%s); using the slower "
                        "pure-torch attention. Install a C++ compiler and ninja to enable it.",
                        reason,
                    )
            _state["op"], _state["reason"] = op, reason
        return _state["op"]  # type: ignore[return-value]


def unavailable_reason() -> str:
    """Why cell_attention_op() returned None ("" when it did not, or was not yet asked)."""
    return str(_state.get("reason", ""))
