"""Programs compiled for real (torch.export + AOTInductor) and run
(docs/design.md#programs-and-export).

One tiny random Llama, wide enough that its weights (~150 MB in fp32) outweigh its
compiled code, is exported once per module with a prefill bound of 9 and decode widths
1, 2, 4 and 8 (about a minute of compiling on 2 cores). Against it: the executors give the
same tokens (every kind of step, greedy and seeded; through the Engine too), a fresh
process runs it without cellbatch.model, the weights are stored once (a program with 1
decode width and one with 4 differ by less than 5% of the weights), and damaged, newer or
inconsistent programs and limits it cannot hold are refused. The default model's own
export runs in the slow test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from cellbatch.cli import main
from cellbatch.engine import Engine
from cellbatch.executor.module_executor import ModuleExecutor
from cellbatch.executor.program_executor import ProgramExecutor
from cellbatch.export.archive import MANIFEST, METHODS_DIR, WEIGHTS
from cellbatch.export.exporter import ExportOptions, export_program
from cellbatch.export.manifest import ProgramFormatError
from cellbatch.export.program import load_program
from cellbatch.generation_config import GenConfig
from cellbatch.model.loading import load_model
from cellbatch.types import InvalidArgumentError
from program_steps import (
    DECODE_WIDTHS,
    GREEDY,
    MAX_STEP,
    MIN_PREFILL,
    PROMPT_LENGTHS,
    SCENARIO_SHAPE,
    SEEDED,
    prompts,
    run_scenario,
)
from tiny_models import make_tiny_checkpoint

VOCAB = 32768
ENGINE_SHAPE = dict(max_sessions=8, max_session_tokens=128, max_batch_tokens=MAX_STEP)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wide-llama")
    make_tiny_checkpoint(
        "llama",
        folder,
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return folder


@pytest.fixture(scope="module")
def program(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("program") / "wide.pt2"
    options = ExportOptions(
        dtype="float32",
        max_step_tokens=MAX_STEP,
        decode_widths=DECODE_WIDTHS,
        min_prefill_tokens=MIN_PREFILL,
    )
    export_program(checkpoint, path, options)
    return path


@pytest.fixture(scope="module")
def module_tokens(checkpoint: Path) -> dict[str, list[list[int]]]:
    """ModuleExecutor's tokens for the scenario, greedy and seeded."""
    config, model = load_model(checkpoint, "float32", "compiled")
    results = {}
    for name, sampling in (("greedy", GREEDY), ("seeded", SEEDED)):
        executor = ModuleExecutor(model, config, SCENARIO_SHAPE)
        executor.initialize()
        results[name] = run_scenario(executor, VOCAB, sampling)
    return results


def counting(program_path: Path) -> tuple[ProgramExecutor, list[str]]:
    loaded = load_program(program_path)
    calls: list[str] = []

    def count(name: str, method: Callable) -> Callable:
        def call(inputs):
            calls.append(name)
            return method(inputs)

        return call

    loaded.methods = {name: count(name, method) for name, method in loaded.methods.items()}
    executor = ProgramExecutor(loaded, SCENARIO_SHAPE)
    executor.initialize()
    return executor, calls


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_every_kind_of_step_gives_the_module_executors_tokens(
    program: Path, module_tokens: dict, sampling: str
) -> None:
    executor, calls = counting(program)
    tokens = run_scenario(executor, VOCAB, GREEDY if sampling == "greedy" else SEEDED)
    assert tokens == module_tokens[sampling]
    assert set(calls) == {"prefill", "decode_1", "decode_2", "decode_4", "decode_8"}


def test_engine_runs_a_program_like_a_model(checkpoint: Path, program: Path) -> None:
    texts = prompts(VOCAB, seed=11)
    config = GenConfig(max_new_tokens=10, seed=3, sampling=SEEDED)
    results = {}
    for name, source, options in (
        ("program", program, {}),
        ("module", checkpoint, {"dtype": "float32"}),
    ):
        with Engine.from_pretrained(source, **options, **ENGINE_SHAPE) as engine:
            assert engine.executor_kind == name
            greedy = engine.generate(texts, max_new_tokens=10)
            seeded = engine.generate(texts, config)
            results[name] = [r.tokens for r in greedy + seeded]
            assert all(r.ok for r in greedy + seeded)
    assert results["program"] == results["module"]
    assert [len(t) for t in results["program"]] == [10] * 2 * len(PROMPT_LENGTHS)


def test_a_fresh_process_runs_it_without_model_code(program: Path, module_tokens: dict) -> None:
    code = f"""
import json, sys
from cellbatch.executor.program_executor import ProgramExecutor
from cellbatch.export.program import load_program
from program_steps import GREEDY, SCENARIO_SHAPE, run_scenario
executor = ProgramExecutor(load_program({str(program)!r}), SCENARIO_SHAPE)
executor.initialize()
tokens = run_scenario(executor, {VOCAB}, GREEDY)
print(json.dumps({{"tokens": tokens,
    "model": sorted(m for m in sys.modules if m.startswith("cellbatch.model"))}}))
"""
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["model"] == []
    assert result["tokens"] == module_tokens["greedy"]


def rewrite(source: Path, target: Path, edit: Callable[[dict], None], drop: tuple = ()) -> None:
    """A copy of the program with its manifest edited and the methods `drop` left out."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        root = old.namelist()[0].split("/", 1)[0] + "/"
        for info in old.infolist():
            record = info.filename[len(root) :]
            if any(record.startswith(f"{METHODS_DIR}{name}/") for name in drop):
                continue
            data = old.read(info)
            if record == MANIFEST:
                manifest = json.loads(data)
                edit(manifest)
                data = json.dumps(manifest).encode()
            new.writestr(info.filename, data)


def test_weights_are_stored_once_for_every_method(
    program: Path, module_tokens: dict, tmp_path: Path
) -> None:
    one_width = tmp_path / "one.pt2"

    def keep_widest(manifest: dict) -> None:
        kept = ("prefill", "decode_8")
        manifest["methods"] = [m for m in manifest["methods"] if m["name"] in kept]

    rewrite(program, one_width, keep_widest, drop=("decode_1", "decode_2", "decode_4"))
    with zipfile.ZipFile(program) as archive:
        weights = [i for i in archive.infolist() if i.filename.endswith(WEIGHTS)]
        assert len(weights) == 1  # one record, whatever the number of methods
        weight_bytes = weights[0].file_size
    assert weight_bytes > 100 * 2**20
    grown = program.stat().st_size - one_width.stat().st_size
    assert 0 < grown < 0.05 * weight_bytes
    # The one-width program is a working program: decode rows pad to width 8.
    loaded = load_program(one_width)
    assert [m.name for m in loaded.manifest.decode_methods] == ["decode_8"]
    executor = ProgramExecutor(loaded, SCENARIO_SHAPE)
    executor.initialize()
    assert run_scenario(executor, VOCAB, GREEDY) == module_tokens["greedy"]


def test_damaged_programs_are_refused(program: Path, tmp_path: Path) -> None:
    data = program.read_bytes()
    truncated = tmp_path / "truncated.pt2"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ProgramFormatError, match=r"damaged \(truncated or corrupt\)"):
        load_program(truncated)
    corrupt = tmp_path / "corrupt.pt2"
    with zipfile.ZipFile(program) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(WEIGHTS))
    header = data[info.header_offset : info.header_offset + 30]  # the local file header
    name_length, extra_length = (int.from_bytes(header[i : i + 2], "little") for i in (26, 28))
    start = info.header_offset + 30 + name_length + extra_length
    flipped = bytearray(data)
    flipped[start + info.file_size // 2] ^= 0xFF
    corrupt.write_bytes(bytes(flipped))
    with pytest.raises(ProgramFormatError, match=r"weights\.safetensors is corrupt"):
        load_program(corrupt)
    stranger = tmp_path / "stranger.pt2"
    stranger.write_bytes(b"not a program at all")
    with pytest.raises(ProgramFormatError, match="not a zip archive"):
        load_program(stranger)


def test_a_newer_format_is_refused(program: Path, tmp_path: Path) -> None:
    newer = tmp_path / "newer.pt2"
    rewrite(program, newer, lambda manifest: manifest.update(format_version=99))
    with pytest.raises(ProgramFormatError, match="format 99, written by a newer cellbatch"):
        load_program(newer)


def test_a_program_calling_kernel_entry_points_missing_here_is_refused(
    program: Path, tmp_path: Path
) -> None:
    assert "aoti_torch_cpu_cell_attention" in load_program(program).manifest.c_shims
    newer = tmp_path / "newer-kernels.pt2"
    rewrite(program, newer, lambda m: m["c_shims"].append("aoti_torch_cpu_not_built_here"))
    with pytest.raises(ProgramFormatError, match=r"aoti_torch_cpu_not_built_here.*upgrade"):
        load_program(newer)


def test_a_manifest_that_does_not_match_the_methods_is_refused(
    program: Path, tmp_path: Path
) -> None:
    extra = tmp_path / "extra.pt2"

    def add_width(manifest: dict) -> None:
        manifest["methods"].append(
            {"name": "decode_16", "kind": "decode", "min_tokens": 16, "max_tokens": 16}
        )

    rewrite(program, extra, add_width)
    with pytest.raises(ProgramFormatError, match=r"lists methods .* but it holds"):
        load_program(extra)
    moved = tmp_path / "moved.pt2"

    def move_bound(manifest: dict) -> None:
        manifest["min_prefill_tokens"] = 12
        manifest["methods"][0]["min_tokens"] = 12

    rewrite(program, moved, move_bound)
    with pytest.raises(ProgramFormatError, match="its compiled code says"):
        load_program(moved)


def test_limits_the_program_cannot_hold_are_refused(program: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="max_session_tokens=300 is above the model's"):
        Engine.from_pretrained(program, max_session_tokens=300)
    with pytest.raises(InvalidArgumentError, match="max_batch_tokens=128 is above its widest"):
        Engine.from_pretrained(program, max_batch_tokens=128)
    with pytest.raises(InvalidArgumentError, match="runs in float32"):
        Engine.from_pretrained(program, dtype="bfloat16")


def test_from_program_runs_the_program_and_refuses_what_its_export_fixed(program: Path) -> None:
    with Engine.from_program(program, **ENGINE_SHAPE) as engine:
        assert engine.executor_kind == "program"
        (result,) = engine.generate([prompts(VOCAB)[0]], max_new_tokens=2)
        assert result.ok and len(result.tokens) == 2
    with pytest.raises(InvalidArgumentError, match="runs in float32"):
        Engine.from_program(program, dtype="bfloat16")


def test_cellbatch_run_reports_the_program_executor(
    program: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    tokens = tmp_path / "ids.txt"
    tokens.write_text("\n".join(" ".join(map(str, p)) for p in prompts(VOCAB)[:3]) + "\n")
    report = tmp_path / "report.json"
    status = main(
        ["run", "--model", str(program), "--prompt-tokens-file", str(tokens),
         "--max-new-tokens", "4", "--report-json", str(report), "--quiet"]
    )  # fmt: skip
    assert status == 0, capsys.readouterr().err
    written = json.loads(report.read_text())
    assert written["config"]["executor"] == "program"
    assert [len(g["tokens"]) for g in written["generations"]] == [4, 4, 4]


def test_export_options_are_checked_before_anything_loads(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "x.pt2")
    assert main(["export", "-o", out, "--decode-widths", "1,x"]) == 2
    assert "--decode-widths takes comma-separated integers" in capsys.readouterr().err
    assert main(["export", "-o", str(tmp_path / "x.bin")]) == 2
    assert "must end in .pt2" in capsys.readouterr().err
