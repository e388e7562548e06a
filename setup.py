"""Builds cellbatch's compiled CPU kernels when the package is installed.

pyproject.toml holds the package's metadata; this file adds one optional extension,
`cellbatch.model.kernels._C` (`_C.so`: the C++ kernels of the ops in
`cellbatch.model.ops`), compiled with torch's BuildExtension against the torch already
installed, for the vector width torch uses on this machine. Beside it goes `_C.json`, the
CPU capability, torch version and sources it was built from: a process whose CPU or torch
differs refuses the library (one warning) instead of running instructions its CPU may
lack, and so does a checkout whose kernel sources changed since.

Install with `pip install --no-build-isolation` (the Makefile does): an isolated build
environment has no torch to build against. Whatever stops the build (no torch there, no
C++ compiler, a compile error) is reported in one warning and the install goes on without
the kernels; the model then runs the ops' torch implementations. After editing the
kernels in a checkout, `python setup.py build_ext --inplace` rebuilds them (`make` does).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from setuptools import setup

KERNELS = Path("src/cellbatch/model/kernels")
PACKAGE = "cellbatch.model.kernels"
# Per torch CPU capability: the instruction sets to compile for, and the matching macro
# that selects ATen's vector types (at::vec) for that width.
CAPABILITY_FLAGS: dict[str, list[str]] = {
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


def _skip(reason: str) -> None:
    print(
        f"cellbatch: WARNING: compiled kernels not built ({reason}); cellbatch will run the "
        "slower pure-torch ops. Install a C++ compiler (g++) and reinstall with "
        "`pip install --no-build-isolation` (or `make` in a checkout) to build them.",
        file=sys.stderr,
    )


def _summary(error: Exception) -> str:
    """The compiler's first error line if there is one, else the exception's last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and ": " in line]
    return (errors[:1] or lines[-1:] or [type(error).__name__])[0][-300:]


def sources_digest(files: list[Path]) -> str:
    """What `cellbatch.model.kernels` compares with the sources it finds beside the library
    (a checkout), to refuse a library older than them: sha256 over the files in name order."""
    digest = hashlib.sha256()
    for file in sorted(files, key=lambda path: path.name):
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def kernel_build() -> dict:
    """setup() arguments that add the kernels, or none when torch is missing here."""
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as error:
        _skip(f"torch is not importable in the build environment: {error}")
        return {}
    if os.environ.get("CELLBATCH_KERNELS") == "0":
        _skip("CELLBATCH_KERNELS=0")
        return {}
    capability = torch.backends.cpu.get_cpu_capability()
    sources, headers = sorted(KERNELS.glob("*.cpp")), sorted(KERNELS.glob("*.h"))
    extension = CppExtension(
        f"{PACKAGE}._C",
        [str(path) for path in sources],
        depends=[str(path) for path in headers],
        # -g0 undoes the -g that Python's own CFLAGS put first: debug information for the
        # ATen headers' templates doubles the compile time, and profilers need only the
        # symbols, which stay. No contraction of a*b+c into one fused multiply-add behind
        # our back: the ops promise torch's roundings, and torch's elementwise kernels
        # round each step.
        extra_compile_args=[
            "-O3",
            "-g0",
            "-fopenmp",
            "-ffp-contract=off",
            *CAPABILITY_FLAGS.get(capability, []),
        ],
        extra_link_args=["-fopenmp"],
    )

    class OptionalKernels(BuildExtension):
        """BuildExtension that leaves the kernels out, with a warning, when they fail to
        build, and records what they were built for."""

        def run(self) -> None:
            try:
                super().run()
            except Exception as error:  # a missing compiler or a compile error alike
                _skip(f"{_summary(error)}; the compiler's messages are above")
                self.extensions = []  # nothing to install or copy into the source tree
                return
            info = json.dumps(
                {
                    "capability": capability,
                    "torch": torch.__version__,
                    "sources": sources_digest(sources + headers),
                }
            )
            folders = {os.path.dirname(self.get_ext_fullpath(extension.name))}
            if self.inplace or getattr(self, "editable_mode", False):
                folders.add(self.get_finalized_command("build_py").get_package_dir(PACKAGE))
            for folder in folders:
                with open(os.path.join(folder, "_C.json"), "w", encoding="utf-8") as file:
                    file.write(info + "\n")

    return {
        "ext_modules": [extension],
        # A plain library (_C.so, no Python ABI tag): torch.ops.load_library loads it.
        "cmdclass": {"build_ext": OptionalKernels.with_options(no_python_abi_suffix=True)},
    }


setup(**kernel_build())
