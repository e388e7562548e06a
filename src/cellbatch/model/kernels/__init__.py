"""The compiled CPU kernels: the library `setup.py` builds when the package is installed,
found and loaded here, never built here.

Owns: `_C.so` beside this file (CPU kernels for the ops of `cellbatch.model.ops`:
`cell_attention.cpp`: cell_attention; `fused_ops.cpp`: rms_norm, rope_store, silu_mul;
`quantized_matmul.cpp`: int4_matmul, int8_matmul, with their bf16 path for CPUs with
AVX512-BF16 in `quantized_bf16.cpp`; `quantized_a8.cpp`: int4_matmul_a8 and
int8_matmul_a8, int4 and int8 weights with activations quantised to int8, by VPDPBUSD on
CPUs with AVX512-VNNI and by VPMADDUBSW on AVX2 ones in `quantized_a8_avx2.cpp`;
`lora.cpp` with `lora_rows.h`: lora_add, LoRA adapters' products added to a product's
rows; `decoder_layer.cpp`: decoder_layer, a whole layer over those ops;
and `aoti_shims.cpp`: their C entry points, which exported programs call directly; the
callers of registered ops share `op_handles.h`) and
`_C.json` beside it (the torch CPU capability, torch version and sources it was compiled
from); deciding whether this process may use it, and loading it into torch.
Promises: `load()` loads the library at most once per process and says whether it is
loaded. It refuses a library built for another CPU capability (another vector width: it
could hold instructions this CPU lacks) or another torch, or, in a checkout, from other
sources than the `*.cpp`/`*.h` beside it (edited since: `make` rebuilds it); these checks
come before the library is opened. When the kernels are not loaded,
`unavailable_reason()` says why, and one warning in the log says it and how to build them
(none when the user switched them off with CELLBATCH_KERNELS=0).
Never: compiles, waits on a lock or a build, or raises for a missing or unusable library.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

LIBRARY = Path(__file__).with_name("_C.so")
BUILD_INFO = Path(__file__).with_name("_C.json")
REBUILD = (
    "reinstall cellbatch (`make` in a checkout, or `pip install --no-build-isolation .`) "
    "to build them for this machine"
)

_lock = threading.Lock()
_state: dict[str, object] = {}


def disabled() -> bool:
    """True when the user switched the compiled kernels off (CELLBATCH_KERNELS=0)."""
    return os.environ.get("CELLBATCH_KERNELS", "1") == "0"


def _refusal(library: Path, build_info: Path) -> str:
    """Why the library must not be loaded here; "" when it may."""
    if not library.is_file():
        return "they were not built when cellbatch was installed (no C++ compiler then?)"
    try:
        built = json.loads(build_info.read_text(encoding="utf-8"))
        capability, version, sources = built["capability"], built["torch"], built["sources"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{build_info.name} does not say what {library.name} was built for"
    here = torch.backends.cpu.get_cpu_capability()
    if capability != here:
        return f"they were built for {capability} but torch runs {here} on this CPU"
    if version != torch.__version__:
        return f"they were built against torch {version} but torch {torch.__version__} runs"
    files = [*library.parent.glob("*.cpp"), *library.parent.glob("*.h")]
    if files and _digest(files) != sources:
        return "their sources changed since they were built"
    return ""


def _digest(files: list[Path]) -> str:
    """setup.py's `sources_digest`: sha256 over the files in name order."""
    digest = hashlib.sha256()
    for file in sorted(files, key=lambda path: path.name):
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def load() -> bool:
    """Loads the compiled kernels into torch (first call only); False if they are not
    usable here, with the reason in unavailable_reason()."""
    with _lock:
        if "loaded" not in _state:
            reason = "disabled by CELLBATCH_KERNELS=0" if disabled() else ""
            if not reason:
                reason = _refusal(LIBRARY, BUILD_INFO)
                if not reason:
                    try:
                        # torch leaves load_library unannotated.
                        torch.ops.load_library(str(LIBRARY))  # type: ignore[no-untyped-call]
                    except OSError as error:
                        reason = f"{LIBRARY.name} does not load: {str(error)[-200:]}"
                if reason:
                    log.warning(
                        "cellbatch: compiled kernels unavailable: %s; using the slower "
                        "pure-torch ops; %s.",
                        reason,
                        REBUILD,
                    )
            _state["loaded"], _state["reason"] = not reason, reason
        return bool(_state["loaded"])


def unavailable_reason() -> str:
    """Why load() returned False ("" when it did not, or was not yet asked)."""
    return str(_state.get("reason", ""))
