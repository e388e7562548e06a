"""The kernels as an AVX2 CPU runs them, on whatever CPU the suite runs on: the kernel tests
again, in a process with torch, oneDNN and MKL capped at AVX2 and the kernels built for that
capability (benchmarks/cpu_kinds.py's caps and build). On an AVX512 machine this is the
only run of the 8-lane vector code, the AVX2 quantised paths (the int8-input products by
VPMADDUBSW among them, held to the portable loop bit for bit), and the `auto` choices an
AVX2 CPU gets. The cases that run the pure-torch ops (ops choice `torch`, their first
parameter) stay out: they run no cellbatch kernel code, so capping the CPU changes nothing
of cellbatch's in them; each has its `compiled` twin here, which does run the AVX2 code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cpu_kinds import CHECKOUT, build_kernels, copy_tree, kind_environment

TESTS = (
    "tests/model/test_kernels.py",
    "tests/model/test_quantized.py",
    "tests/model/test_quantized_a8.py",
    "tests/model/test_kquants.py",
    "tests/model/test_attention.py",
    # lora_add's own tests (the file's others load models: no kernel code of their own)
    "tests/model/test_lora.py::test_lora_add_adds_each_groups_low_rank_product_to_its_rows",
    "tests/model/test_lora.py::test_a_rows_low_rank_product_does_not_depend_on_the_other_rows",
    "tests/model/test_lora.py::test_a_lone_rows_product_spread_over_threads_gives_one_threads_bits",
)
ONLY = ("-k", "not [torch")  # the cases of the compiled ops (see above)
PROBE = (
    "import torch\n"
    "from cellbatch.model import cpu, kernels\n"
    "from cellbatch.model.transformer import resolve_dtype\n"
    "from cellbatch.model.quantized import resolve_activations\n"
    "print(kernels.load(), torch.backends.cpu.get_cpu_capability(), cpu.cpu_has_fast_bf16(),\n"
    "      resolve_dtype('auto'), resolve_activations('auto', 'compiled', torch.float32),\n"
    "      kernels.LIBRARY)\n"
)


@pytest.mark.slow
def test_the_kernel_tests_pass_as_an_avx2_cpu_runs_them(tmp_path: Path) -> None:
    tree = tmp_path / "avx2"
    copy_tree(None, tree)
    build_kernels(tree, "avx2")
    env = {**kind_environment("avx2"), "PYTHONPATH": str(tree / "src")}
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    library = tree / "src/cellbatch/model/kernels/_C.so"
    assert probe.stdout.split() == [
        "True",
        "AVX2",
        "False",
        "torch.float32",
        "int8",
        str(library),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS, *ONLY],
        cwd=CHECKOUT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
