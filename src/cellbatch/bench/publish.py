"""`cellbatch bench --report` (`make bench-report`): the figures in README.md and
docs/benchmarks.md, rendered from the results files the benchmarks wrote.

Each JSON file under the results folder (`docs/results/` in a checkout) that carries the
published keys (`cellbatch.bench.results`) becomes a section of the benchmarks page: its
title, the machine and the command that printed it, its tables and its plot; its
headline figures become rows of the README's headline table, each with the machine and a
link to its section. The rendered text replaces what stands between a file's markers
(`<!-- results:NAME -->` and `<!-- /results:NAME -->`), and nothing else.

Owns: rendering results files to Markdown, and rewriting the marked regions.
Promises: the same results files give the same text (sections in file-name order);
a results file without the published keys, or a target without its markers, is an error
naming the file and what to add; `--check` changes nothing and fails when a target is
not what the results give.
Never: runs a benchmark or edits text outside the markers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cellbatch.bench.results import RESULTS_KEYS

HEADLINE = "headline"
TABLES = "tables"


class ReportError(Exception):
    """A results file or a target that cannot be rendered; the message says what to fix."""


@dataclass(frozen=True)
class Published:
    """One results file, read."""

    path: Path
    data: dict[str, Any]

    @property
    def anchor(self) -> str:
        """The section's anchor on the benchmarks page."""
        return "results-" + self.path.stem.replace("_", "-")


def load_results(folder: Path) -> list[Published]:
    """Every results file in `folder`, in file-name order (none where it does not exist)."""
    published = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        missing = [key for key in RESULTS_KEYS if key not in data]
        if missing:
            raise ReportError(
                f"{path} lacks {', '.join(missing)}: only files written by a benchmark that "
                "records its machine and command (cellbatch.bench.results) can be published"
            )
        published.append(Published(path, data))
    return published


def machine_text(machine: dict[str, Any]) -> str:
    return (
        f"{machine['cpu']} ({machine['cpu_kind']}), {machine['cores']} cores, "
        f"{machine['threads']} threads, torch {machine['torch']}"
    )


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value).replace("|", "\\|")


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(_cell(value) for value in row) + " |" for row in rows),
    ]


def render_tables(results: Sequence[Published], page: Path) -> str:
    """The benchmarks page's figures: one section per results file."""
    lines: list[str] = []
    for one in results:
        data = one.data
        commit = data["machine"].get("cellbatch_commit")
        lines += [
            f"### {data['title']} {{#{one.anchor}}}",
            "",
            f"Measured {data['date']} on {machine_text(data['machine'])}"
            + (f", cellbatch {commit}" if commit else "")
            + ", by:",
            "",
            "```sh",
            data["command"],
            "```",
            "",
        ]
        for table in data["tables"]:
            lines += [f"**{table['caption']}**", "", *_table(table["columns"], table["rows"]), ""]
            if table.get("note"):
                lines += [table["note"], ""]
        if data.get("plot"):
            plot = Path(os.path.relpath(one.path.parent / data["plot"], page.parent))
            lines += [f"![{data['title']}]({plot.as_posix()})", ""]
        lines.append(f"Results file: `{one.path.as_posix()}`.")
        lines.append("")
    if not lines:
        return "No figures published yet: run a benchmark as above, then `make bench-report`.\n"
    return "\n".join(lines).rstrip() + "\n"


def render_headline(results: Sequence[Published], page_link: str) -> str:
    """The README's headline table: every headline figure, its ratio, where it ran."""
    rows: list[tuple[str, ...]] = []
    sources: list[str] = []
    for one in results:
        data = one.data
        if not data["headline"]:
            continue
        number = len(sources) + 1
        sources.append(
            f"{number}. {machine_text(data['machine'])}, {data['date']}: "
            f"`{data['command']}` ([{data['title']}]({page_link}#{one.anchor}))"
        )
        for line in data["headline"]:
            rows.append(
                (
                    line["what"],
                    f"{line['cellbatch']:.1f} {line['unit']}",
                    f"{line['peer']}: {line['peer_value']:.1f}",
                    f"**{line['ratio']:.2f}x**",
                    str(number),
                )
            )
    if not rows:
        return "No headline figures published yet: see the benchmarks page.\n"
    table = _table(("what", "cellbatch", "peer, same run", "ratio", "run"), rows)
    return "\n".join([*table, "", "Runs:", "", *sources]) + "\n"


def replace_region(text: str, name: str, body: str, where: Path) -> str:
    """`text` with what stands between `name`'s markers replaced by `body`."""
    pattern = re.compile(
        rf"(<!-- results:{name} -->\n).*?(<!-- /results:{name} -->)", flags=re.DOTALL
    )
    if not pattern.search(text):
        raise ReportError(
            f"{where} has no <!-- results:{name} --> ... <!-- /results:{name} --> markers: "
            "add them where the figures go"
        )
    return pattern.sub(lambda match: match[1] + body + match[2], text, count=1)


def targets(results_dir: Path, readme: Path, page: Path) -> dict[Path, str]:
    """Each target file's new text."""
    results = load_results(results_dir)
    page_link = Path(os.path.relpath(page, readme.parent)).as_posix()
    new: dict[Path, str] = {}
    for path, name, body in (
        (readme, HEADLINE, render_headline(results, page_link)),
        (page, TABLES, render_tables(results, page)),
    ):
        text = new.get(path, path.read_text(encoding="utf-8"))
        new[path] = replace_region(text, name, body, path)
    return new


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cellbatch bench --report",
        description="Render the published benchmark results into the README and the "
        "benchmarks page (run from the checkout's root).",
    )
    parser.add_argument("--report", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--results",
        type=Path,
        default=Path("docs/results"),
        help="the results files (default docs/results)",
    )
    parser.add_argument("--readme", type=Path, default=Path("README.md"))
    parser.add_argument("--page", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 1 when a target is not what the results give",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        for path in (args.readme, args.page):
            if not path.is_file():
                raise ReportError(f"{path} not found: run from the checkout's root")
        new = targets(args.results, args.readme, args.page)
    except ReportError as error:
        print(f"cellbatch bench --report: error: {error}", file=sys.stderr)
        return 2
    stale = [path for path, text in new.items() if path.read_text(encoding="utf-8") != text]
    if args.check:
        for path in stale:
            print(f"{path} is not what {args.results} gives: run `make bench-report`")
        return 1 if stale else 0
    for path in stale:
        path.write_text(new[path], encoding="utf-8")
        print(f"rewrote the figures in {path}")
    if not stale:
        print("the figures are up to date")
    return 0
