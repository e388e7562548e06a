"""`cellbatch run` with LoRA adapters: --lora-modules, --adapter and @NAME lines, against
the Engine's own answers; bad adapter options refused before the model loads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from cellbatch.cli import main
from cellbatch.engine import Engine
from cellbatch.generation_config import GenConfig
from lora_adapters import make_adapter
from tiny_models import make_tiny_chat_checkpoint

NEW_TOKENS = 8
PROMPTS = ("Name a colour.", "Write a poem about the sea.", "Hi")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """The tiny chat model and two adapters of it."""
    import transformers

    root = tmp_path_factory.mktemp("cli-lora")
    folder = make_tiny_chat_checkpoint(root / "llama", 256)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    adapters = {
        name: make_adapter(base, root / name, rank=8, seed=seed, std=0.3)
        for seed, name in enumerate(("sql", "poet"))
    }
    return folder, adapters


@pytest.fixture
def cli(tiny, tmp_path: Path, capsys) -> Callable[..., tuple[int, dict[str, Any] | None, str]]:
    """cli(*args) -> (exit code, report, stderr) of `cellbatch run` in-process."""
    folder, _ = tiny

    def run(*args: str) -> tuple[int, dict[str, Any] | None, str]:
        report = tmp_path / "report.json"
        report.unlink(missing_ok=True)
        code = main(
            ["run", "--model", str(folder), "--max-new-tokens", str(NEW_TOKENS), "--quiet",
             "--dtype", "float32", *args, "--report-json", str(report)]
        )  # fmt: skip
        err = capsys.readouterr().err
        return code, json.loads(report.read_text()) if report.exists() else None, err

    return run


def expected_tokens(tiny, adapter: str | None) -> list[list[int]]:
    folder, adapters = tiny
    with Engine.from_pretrained(
        folder, dtype="float32", lora_adapters={k: str(v) for k, v in adapters.items()}
    ) as engine:
        config = GenConfig(max_new_tokens=NEW_TOKENS, adapter=adapter)
        results = engine.generate([engine.chat_tokens(p) for p in PROMPTS], config)
    return [result.tokens for result in results]


def test_adapter_runs_every_prompt_and_at_name_lines_pick_their_own(
    cli, tiny, tmp_path: Path
) -> None:
    _, adapters = tiny
    modules = ["--lora-modules", f"sql={adapters['sql']}", f"poet={adapters['poet']}"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPTS[0]}\n@poet {PROMPTS[1]}\n@nobody {PROMPTS[2]}\n")
    code, report, err = cli("--prompts-file", str(prompts), *modules, "--adapter", "sql")
    assert code == 0, err
    assert report is not None
    entries = report["generations"]
    assert [entry["adapter"] for entry in entries] == ["sql", "poet", "sql"]
    sql, poet = expected_tokens(tiny, "sql"), expected_tokens(tiny, "poet")
    assert entries[0]["tokens"] == sql[0]
    assert entries[1]["tokens"] == poet[1]
    assert entries[2]["prompt"] == f"@nobody {PROMPTS[2]}"  # no such adapter: a prompt
    base = expected_tokens(tiny, None)
    assert sql != base and poet != base


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--adapter", "sql"], "no such adapter"),
        (["--lora-modules", "sql=/does/not/exist"], "is not a folder"),
        (["--lora-modules", "a=.", "a=.", "--max-loras", "4"], "names 'a' twice"),
        (["--lora-modules", "a=.", "b=.", "--max-loras", "1"], "above --max-loras 1"),
    ],
)
def test_bad_adapter_options_are_refused_before_the_model_loads(
    cli, monkeypatch, args, message
) -> None:
    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    code, _, err = cli("Hi", *args)
    assert code == 2 and message in err


def test_a_lora_module_without_a_path_is_a_usage_error(cli) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli("Hi", "--lora-modules", "sql")
    assert exit_.value.code == 2
