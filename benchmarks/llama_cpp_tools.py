"""llama.cpp's own tools (converter, quantiser, benchmarks, server), built once into a
shared place from the `llama-cpp-python` sdist's vendored sources, for the scale
benchmarks and their models.

    python benchmarks/llama_cpp_tools.py [--root /work/peers]   (builds what is missing)

Layout under ROOT (default /work/peers, or $CELLBATCH_PEERS):
    llama.cpp/            the vendored llama.cpp sources of llama-cpp-python==VERSION
    llama.cpp/build/bin/  llama-quantize, llama-batched-bench, llama-server, llama-cli,
                          llama-bench, llama-perplexity (native CPU flags: what a llama.cpp
                          user building on this machine gets)
    llama-venv/           a virtualenv with the converter's Python deps (torch, transformers,
                          sentencepiece, and the vendored gguf-py)
    README.txt            what is there and how it was made

Owns: fetching the sdist (pip download), building, and naming the binaries. Never: runs a
model, or rebuilds what is already there (delete a folder to rebuild it). The build is
CPU-heavy: run it under the machine's CPU lock where one exists.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, whose vendored llama.cpp every peer figure uses
TOOLS = (
    "llama-quantize",
    "llama-batched-bench",
    "llama-server",
    "llama-cli",
    "llama-bench",
    "llama-perplexity",
)
# The converter's imports; torch is the CPU build pip finds on disk (cellbatch's own pin).
CONVERTER_DEPS = ("torch==2.13.0", "transformers", "sentencepiece", "safetensors", "numpy")
# No network at build or run time: no HTTPS client, no prebuilt web UI download. Native
# flags less AMX: this llama.cpp's AMX matrix products (ggml-cpu/amx, which -march=native
# turns on where the CPU has AMX) crash with SIGSEGV in ggml_backend_amx_mul_mat on the
# development machine (a Xeon with AMX, Q4_K_M and Q4_0 files alike); explicit -mno-*
# flags win over -march=native's in GCC, and change nothing on CPUs without AMX.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)


def root() -> Path:
    return Path(os.environ.get("CELLBATCH_PEERS", "/work/peers"))


def source_dir(base: Path | None = None) -> Path:
    return (base or root()) / "llama.cpp"


def binary(name: str, base: Path | None = None) -> Path:
    """The path of one of TOOLS."""
    return source_dir(base) / "build" / "bin" / name


def venv_python(base: Path | None = None) -> Path:
    return (base or root()) / "llama-venv" / "bin" / "python"


def converter(base: Path | None = None) -> Path:
    return source_dir(base) / "convert_hf_to_gguf.py"


def _run(command: list[str], cwd: Path | None = None) -> None:
    print("llama.cpp tools:", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, cwd=cwd, check=True)


def fetch_sources(base: Path) -> Path:
    """The sdist's vendored llama.cpp, unpacked into base/llama.cpp (once)."""
    target = source_dir(base)
    if converter(base).is_file():
        return target
    download = base / "sdist"
    download.mkdir(parents=True, exist_ok=True)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            f"llama-cpp-python=={VERSION}",
            "-d",
            str(download),
        ]
    )
    archive = download / f"llama_cpp_python-{VERSION}.tar.gz"
    with tarfile.open(archive) as tar:
        tar.extractall(download, filter="data")
    shutil.move(download / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp", target)
    shutil.rmtree(download)
    return target


def build_tools(base: Path) -> None:
    """cmake + build of TOOLS, when any is missing."""
    if all(binary(name, base).is_file() for name in TOOLS):
        return
    sources = fetch_sources(base)
    build = sources / "build"
    _run(["cmake", "-S", str(sources), "-B", str(build), *CMAKE_FLAGS])
    jobs = str(os.cpu_count() or 2)
    _run(["cmake", "--build", str(build), "-j", jobs, "--target", *TOOLS])


def build_venv(base: Path) -> None:
    """The converter's virtualenv, with the vendored gguf-py (the converter's own)."""
    python = venv_python(base)
    marker = python.parent.parent / ".installed"
    if marker.is_file():
        return
    sources = fetch_sources(base)
    if not python.is_file():
        _run([sys.executable, "-m", "venv", str(python.parent.parent)])
    _run([str(python), "-m", "pip", "install", "--quiet", *CONVERTER_DEPS])
    _run([str(python), "-m", "pip", "install", "--quiet", str(sources / "gguf-py")])
    marker.touch()


README = """llama.cpp tools for the benchmarks
(written by cellbatch's benchmarks/llama_cpp_tools.py)

llama.cpp/            the llama.cpp sources vendored in the llama-cpp-python=={version} sdist
                      (pip download --no-binary :all: --no-deps llama-cpp-python=={version})
llama.cpp/build/bin/  {tools}
                      built with cmake {flags}
                      (GGML_NATIVE: -march=native, this machine's instructions, less AMX,
                      whose llama.cpp path crashed here: see llama_cpp_tools.py)
llama-venv/           Python for llama.cpp/convert_hf_to_gguf.py: {deps} and the vendored gguf-py

Rebuild: delete llama.cpp/build (or llama-venv) and run
    python benchmarks/llama_cpp_tools.py --root {root}
from a cellbatch checkout (under the CPU lock on a shared machine).
"""


def ensure(base: Path | None = None) -> Path:
    """Everything built (what is missing only) and the README written; returns the root."""
    base = base or root()
    base.mkdir(parents=True, exist_ok=True)
    build_tools(base)
    build_venv(base)
    (base / "README.txt").write_text(
        README.format(
            version=VERSION,
            tools=", ".join(TOOLS),
            flags=" ".join(CMAKE_FLAGS),
            deps=", ".join(CONVERTER_DEPS),
            root=base,
        ),
        encoding="utf-8",
    )
    return base


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args()
    ensure(args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
