"""(slow) The default model through `cellbatch export` and back: its program gives the
eager model's tokens for 4 concurrent chat prompts in float32, with the tokenizer and
chat template the program carries."""

from __future__ import annotations

from pathlib import Path

import pytest

from cellbatch.cli import main
from cellbatch.engine import Engine
from cellbatch.export.program import load_program
from cellbatch.model.default import default_model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "Why is the sky blue? Answer in one sentence.",
]


@pytest.mark.slow
def test_the_default_model_exported_gives_the_module_executors_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    program = tmp_path / "smollm2.pt2"
    options = ["--dtype", "float32", "--quantize", "none", "--max-step-tokens", "64"]
    status = main(["export", "-o", str(program), *options])
    progress = capsys.readouterr().err
    assert status == 0, progress
    assert "[1/2] prefill" in progress and "decode_1: done in" in progress
    manifest = load_program(program).manifest
    assert manifest.min_prefill_tokens == 2 and manifest.source["kind"] == "gguf"
    assert manifest.stop_tokens and "chat_template.jinja" in manifest.tokenizer_files
    shape = dict(max_sessions=4, max_batch_tokens=64)
    results = {}
    for name, source, options in (
        ("program", program, {}),
        ("module", default_model_path(), {"dtype": "float32", "quantize": "none"}),
    ):
        with Engine.from_pretrained(source, **options, **shape) as engine:
            assert engine.executor_kind == name
            results[name] = [r.tokens for r in engine.chat(PROMPTS, max_new_tokens=12)]
    assert results["program"] == results["module"]
