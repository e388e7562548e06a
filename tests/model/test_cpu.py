"""The CPU feature questions: a feature counts only where the CPU has it and torch runs at
the AVX512 width, so torch's own ATEN_CPU_CAPABILITY=avx2 makes cellbatch choose as on an
AVX2 CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cellbatch.model import cpu


@pytest.mark.parametrize("capability", ["AVX512", "AVX2", "DEFAULT"])
@pytest.mark.parametrize("has_features", [True, False])
def test_a_feature_counts_only_where_the_cpu_has_it_and_torch_runs_avx512(
    monkeypatch: pytest.MonkeyPatch, capability: str, has_features: bool
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_vnni_supported"):
        monkeypatch.setattr(torch.cpu, check, lambda: has_features, raising=False)
    fast_bf16 = has_features and capability == "AVX512"
    assert cpu.torch_runs_avx512() is (capability == "AVX512")
    assert cpu.cpu_has_fast_bf16() is fast_bf16
    assert cpu.cpu_dtype() is (torch.bfloat16 if fast_bf16 else torch.float32)
    # VNNI at the AVX512 width or the AVX2 path: a vector int8 product at either width.
    assert cpu.cpu_has_int8_products() is (capability != "DEFAULT")


def test_amx_alone_counts_as_fast_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert cpu.cpu_has_fast_bf16()


def test_torch_capped_at_avx2_makes_auto_choose_as_on_an_avx2_cpu() -> None:
    """A real process under the switch, not a patched one: whatever this CPU has, "auto"
    gives float32 with int8 inputs to the products that float32 quantises (the AVX2 path),
    and a model asked for bf16 keeps float inputs."""
    script = (
        "import torch\n"
        "from cellbatch.model import cpu, quantized\n"
        "from cellbatch.model.transformer import resolve_dtype\n"
        "print(torch.backends.cpu.get_cpu_capability(), cpu.cpu_has_fast_bf16(),\n"
        "      cpu.cpu_has_int8_products(), resolve_dtype('auto'),\n"
        "      quantized.resolve_activations('auto', 'compiled', torch.float32),\n"
        "      quantized.resolve_activations('auto', 'compiled', torch.bfloat16))\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["AVX2", "False", "True", "torch.float32", "int8", "float"]
