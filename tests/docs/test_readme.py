"""The README's examples run as written, on the tiny chat model (the default model's
tokenizer and chat template over random weights) in place of the embedded one.

Its shell blocks: `make` lines are the set-up itself and are not run here; `cellbatch run`
lines run through the CLI; `cellbatch serve` lines are parsed by the CLI (so their flags
exist) and stand for the live server that the Python blocks talking to
127.0.0.1:8000 are pointed at. Python blocks run as they are, with `Engine.from_pretrained()`
loading the tiny model. A line or block of a kind this test does not know fails it, so
that a new example is run rather than skipped.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from cellbatch.cli import _parser as cli_parser
from cellbatch.cli import main as cli_main
from cellbatch.model.default import default_model_path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
# What the README's `serve` examples listen on; the test's server is elsewhere.
README_ADDRESS = "127.0.0.1:8000"
# The README's placeholder for "your own model".
OWN_MODEL = "path/to/hf-folder-or.gguf"


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == language]


def shell_commands() -> list[str]:
    """The shell blocks' commands, comments and continuation lines joined."""
    commands = []
    for body in blocks("sh"):
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def test_the_readme_has_examples_of_each_kind() -> None:
    commands = shell_commands()
    assert any(command.startswith("cellbatch run ") for command in commands)
    assert any(command.startswith("cellbatch serve") for command in commands)
    assert len(blocks("python")) >= 2


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_chat_checkpoint

    return make_tiny_chat_checkpoint(tmp_path_factory.mktemp("readme") / "llama", 1024)


@pytest.fixture
def as_default(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny model stands in for the embedded one wherever no model is given."""
    import cellbatch.engine.loader

    monkeypatch.setattr(cellbatch.engine.loader, "default_model_path", lambda: tiny_model)
    return tiny_model


@pytest.fixture
def in_scratch_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The checkout's example files in a folder of their own, as the working directory, so
    that what the examples write lands there."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "command", [c for c in shell_commands() if c.startswith("cellbatch run")], ids=str
)
def test_readme_run_examples(
    command: str, as_default: Path, in_scratch_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [as_default.as_posix() if word == OWN_MODEL else word for word in shlex.split(command)]
    status = cli_main([argv[1], "--quiet", "--max-new-tokens", "16", *argv[2:]])
    assert status == 0, capsys.readouterr().err
    assert "=== [1]" in capsys.readouterr().out  # an answer was printed
    report = next(iter(arg for arg in argv if arg.endswith(".json")), None)
    if report is not None:
        assert (in_scratch_folder / report).is_file()


def test_readme_shell_lines_are_all_known() -> None:
    parser = cli_parser()
    for command in shell_commands():
        words = shlex.split(command)
        if words[0] == "make":
            assert words[1] in ("run", "test"), f"README runs an unknown make target: {command}"
        elif words[0] == "cellbatch":
            parser.parse_args(words[1:])  # every flag exists (argparse exits on one that does not)
        else:
            pytest.fail(f"tests/docs/test_readme.py does not know how to run `{command}`")


@pytest.fixture(scope="module")
def readme_server(tiny_model: Path) -> Iterator[str]:
    """`cellbatch serve` as the README starts it (no key, the default model's served name)
    on the tiny model; its address."""
    pytest.importorskip("fastapi")
    from cellbatch.engine import Engine
    from served import serve_in_thread

    engine = Engine.from_pretrained(tiny_model, dtype="float32", kernels="torch", max_sessions=4)
    base_url, server, thread = serve_in_thread(
        engine, api_key=None, served_model_name=default_model_path().name
    )
    yield base_url.removeprefix("http://")
    server.should_exit = True
    thread.join(30)


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_examples(
    index: int, as_default: Path, in_scratch_folder: Path, request: pytest.FixtureRequest
) -> None:
    code = blocks("python")[index]
    if README_ADDRESS in code:
        code = code.replace(README_ADDRESS, request.getfixturevalue("readme_server"))
    exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})
