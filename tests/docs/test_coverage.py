"""The documentation covers what a user can reach: every command-line flag appears on the
page of its command, every HTTP route on the serving page, and every `docs/PAGE.md#anchor`
that the code cites names a heading that exists.

A failure names what is missing and the page to add it to. A new subcommand's flags are
looked for on every page until COMMAND_PAGES names its page.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from cellbatch.bench.publish import _parser as report_parser
from cellbatch.bench.workload import _parser as bench_parser
from cellbatch.cli import _parser as cli_parser
from cellbatch.cli.options import add_engine_options

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Each command's page; its flags must appear there. The engine options that `run`,
# `serve` and `run-batch` share are documented once, on the running page.
COMMAND_PAGES = {
    "run": "running.md",
    "serve": "serving.md",
    "run-batch": "batches.md",
    "export": "programs.md",
    "bench": "benchmarks.md",
}
ENGINE_OPTIONS_PAGE = "running.md"
ENGINE_COMMANDS = ("run", "serve", "run-batch")
SERVING_PAGE = "serving.md"
# Methods every route answers as a side effect of another (HEAD of GET), not documented.
IMPLIED_METHODS = {"HEAD", "OPTIONS"}


def long_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The parser's long options a user can type (hidden ones and --help left out)."""
    flags = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        flags += [option for option in action.option_strings if option.startswith("--")]
    return flags


def _engine_flags() -> set[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_options(parser)
    return set(long_flags(parser))


def command_parsers() -> dict[str, list[argparse.ArgumentParser]]:
    """Each `cellbatch` subcommand's parsers (`bench` hands its arguments to its own)."""
    subparsers = next(
        action for action in cli_parser()._actions if isinstance(action, argparse._SubParsersAction)
    )
    parsers: dict[str, list[argparse.ArgumentParser]] = {
        name: [parser] for name, parser in subparsers.choices.items()
    }
    parsers["bench"] = [bench_parser(), report_parser()]
    return parsers


def flag_cases() -> list[tuple[str, str]]:
    engine = _engine_flags()
    cases = []
    for command, parsers in command_parsers().items():
        for parser in parsers:
            for flag in long_flags(parser):
                if (command, flag) not in cases:
                    cases.append((command, flag))
    # The engine options are shared with `run`: they are checked once, as run's.
    shared = [cmd for cmd in ENGINE_COMMANDS if cmd != "run"]
    return [(cmd, flag) for cmd, flag in cases if not (cmd in shared and flag in engine)]


def page_text(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def mentions(text: str, flag: str) -> bool:
    return re.search(re.escape(flag) + r"(?![\w-])", text) is not None


@pytest.mark.parametrize(("command", "flag"), flag_cases(), ids=lambda value: value)
def test_every_flag_is_documented_on_its_commands_page(command: str, flag: str) -> None:
    engine = flag in _engine_flags() and command in ENGINE_COMMANDS
    page = ENGINE_OPTIONS_PAGE if engine else COMMAND_PAGES.get(command)
    if page is None:
        pages = sorted(DOCS.glob("*.md"))
        assert any(mentions(path.read_text(encoding="utf-8"), flag) for path in pages), (
            f"`cellbatch {command} {flag}` appears on no page of docs/: document it on the "
            f"page of its task (and add {command!r} to COMMAND_PAGES in {__file__})"
        )
        return
    assert mentions(page_text(page), flag), (
        f"`cellbatch {command} {flag}` is not documented: add it to docs/{page}"
        + (" (the engine options' table)" if engine else "")
    )


def app_routes(app) -> list[str]:  # app: fastapi.FastAPI
    """'METHOD /path' for every route the app answers."""
    routes = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method not in IMPLIED_METHODS:
                routes.append(f"{method} {route.path}")
    return routes


def test_every_http_route_is_on_the_serving_page(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from cellbatch.engine import Engine
    from cellbatch.server.app import ServerSettings, create_app
    from tiny_models import make_tiny_checkpoint

    _, model = make_tiny_checkpoint("llama", tmp_path / "llama")
    with Engine.from_pretrained(model, dtype="float32", kernels="torch", max_sessions=1) as engine:
        routes = app_routes(create_app(engine, ServerSettings(served_model_name="tiny")))
    assert "POST /v1/chat/completions" in routes  # the app's routes were read at all
    text = page_text(SERVING_PAGE)
    missing = [route for route in routes if f"`{route}`" not in text]
    assert not missing, (
        f"routes not documented in docs/{SERVING_PAGE}: {', '.join(missing)}: add each, "
        "written as `METHOD /path`, to its Routes table"
    )


def heading_ids(page: Path) -> set[str]:
    """The anchors a page's headings get on the site (toc's slugs, and {#id} given)."""
    markdown = pytest.importorskip("markdown")
    html = markdown.markdown(
        page.read_text(encoding="utf-8"), extensions=["toc", "attr_list", "tables"]
    )
    return set(re.findall(r'<h\d id="([^"]+)"', html))


CITATION = re.compile(r"docs/([a-z][a-z0-9_-]*\.md)#([a-z0-9][a-z0-9_-]*)")


def citations() -> list[tuple[str, str, str]]:
    """(file, page, anchor) for every `docs/PAGE.md#anchor` in the code, tests, benchmarks."""
    found = []
    for folder in ("src", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for page, anchor in CITATION.findall(path.read_text(encoding="utf-8")):
                found.append((str(path.relative_to(ROOT)), page, anchor))
    return found


def test_cited_docs_anchors_exist() -> None:
    cited = citations()
    assert cited, "no citations found: the pattern no longer matches the code's"
    ids = {page.name: heading_ids(page) for page in DOCS.glob("*.md")}
    broken = [
        f"{where} cites docs/{page}#{anchor}"
        for where, page, anchor in cited
        if anchor not in ids.get(page, set())
    ]
    assert not broken, (
        "citations of headings that do not exist (a heading renamed or moved: update "
        "the citation, or keep the old anchor with {#id}): " + "; ".join(broken)
    )
