"""Where the model runs (docs/design.md#devices): `--device` and `device=`, refused with the
fix before anything loads where the machine cannot honour them; what `quantize` means off
the CPU; the run report's GPU memory figures; and a run through the CUDA executor on the
CPU (the same engine, with every forward eager there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cellbatch.cli import main
from cellbatch.cli.report import memory_snapshot, print_report
from cellbatch.engine import Engine
from cellbatch.engine.backend import ModuleBackend
from cellbatch.executor.cuda_executor import CudaExecutor, CudaOptions
from cellbatch.model.device import device_quantize, resolve_device
from cellbatch.model.loading import load_model
from cellbatch.types import InvalidArgumentError
from tiny_models import make_tiny_checkpoint

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


@no_gpu
def test_auto_is_the_cpu_without_a_gpu_and_cuda_is_refused_with_the_fix() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    for asked in ("cuda", "cuda:1"):
        with pytest.raises(InvalidArgumentError, match=f"'{asked}' was asked for, but") as error:
            resolve_device(asked)
        assert "device 'cpu'" in str(error.value)
        if torch.version.cuda is None:
            assert "CPU build" in str(error.value) and "CUDA build of torch" in str(error.value)


def test_unknown_devices_are_refused() -> None:
    for asked in ("tpu", "cuda-ish", "mps"):
        with pytest.raises(InvalidArgumentError, match="device"):
            resolve_device(asked)
    with pytest.raises(InvalidArgumentError, match="got int"):
        resolve_device(3)  # type: ignore[arg-type]


def test_off_the_cpu_quantize_auto_is_float_and_int4_is_refused() -> None:
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert device_quantize("auto", gpu) == "none"
    assert device_quantize("none", gpu) == "none"
    assert device_quantize("auto", cpu) == "auto"
    assert device_quantize("int4", cpu) == "int4"
    for asked in ("int4", "int8"):
        with pytest.raises(InvalidArgumentError, match=r"CPU kernels only.*'auto'"):
            device_quantize(asked, gpu)


@no_gpu
def test_run_with_device_cuda_fails_before_loading(capsys, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    missing.mkdir()  # exists, holds nothing: loading it would fail another way
    assert main(["run", "--device", "cuda", "--model", str(missing), "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cellbatch: error: --device cuda: device 'cuda' was asked for")
    assert "device 'cpu'" in err and "loading" not in err
    assert main(["run", "--device", "tpu", "Hi"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


@no_gpu
def test_the_python_api_refuses_cuda_at_construction(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="'cuda' was asked for"):
        Engine.from_pretrained(tmp_path / "never-read", device="cuda")
    with pytest.raises(InvalidArgumentError, match="cuda_graph must be True or False"):
        Engine.from_pretrained(tmp_path / "never-read", device="cpu", cuda_graph="yes")


def test_memory_snapshots_hold_gpu_allocated_and_reserved_bytes(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 8 * 2**20)
    snapshot = memory_snapshot()
    assert snapshot["cuda_allocated_bytes"] == 3 * 2**20
    assert snapshot["cuda_reserved_bytes"] == 8 * 2**20
    report = {
        "generations": [],
        "kv": dict.fromkeys(
            ("cells_in_use", "max_cells", "pool_rows", "allocated_bytes", "growth_count"), 0
        )
        | {"bytes_per_cell": 1},
        "memory": dict.fromkeys(("before_load", "after_load", "after_generate"), snapshot),
        "weights_bytes": 0,
        "config": {
            "weights_bytes_by_format": {},
            "weight_format": "bfloat16",
            "kv_dtype": "bfloat16",
        },
        "timing": {"generated_tokens": 0, "generate_seconds": 0.0, "tokens_per_second": 0.0}
        | {"load_seconds": 0.0},
    }
    print_report(report, "")
    out = capsys.readouterr().out
    assert out.count("CUDA allocated 3.0 MiB, reserved 8.0 MiB") == 3


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, folder = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama")
    return folder


def test_an_engine_runs_the_cuda_executor_and_reports_it(tiny_folder: Path) -> None:
    """The CUDA executor through the whole engine (eager on the CPU), its report section,
    and the same greedy tokens as the CPU engine's module executor."""
    prompts = [[1, 5, 9, 13, 2], [7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    with Engine.from_pretrained(tiny_folder, device="cpu", dtype="float32", kernels="torch") as cpu:
        expected = [r.tokens for r in cpu.generate(prompts, max_new_tokens=6)]
    config, module = load_model(tiny_folder, "float32", "torch", "none")
    backend = ModuleBackend(module, config, CudaOptions())
    with Engine(backend, None) as engine:
        assert isinstance(engine.executor, CudaExecutor)
        assert engine.device == torch.device("cpu")
        got = [r.tokens for r in engine.generate(prompts, max_new_tokens=6)]
        stats = engine.executor.stats()
    assert got == expected
    assert stats["graphs"]["eager_runs"] > 0 and stats["graphs"]["captures"] == 0
    json.dumps(stats)  # the report's "cuda" section is JSON as it is
