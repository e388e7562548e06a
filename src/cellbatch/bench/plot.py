"""The throughput benchmark's chart, drawn with matplotlib (the `cellbatch[bench]` extra).

Owns: which figures of a `BenchReport` are plotted (`throughput_series`) and the PNG.
Promises: one PNG of generated tokens/s against concurrent generations: cellbatch's
decode-only sweep as a line, each peer that ran as one marker at its concurrency (end to
end); a log2 x axis ticked at the measured counts, a linear y axis from 0.
Never: touches pyplot's global state or needs a display (it draws on the Agg canvas).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from cellbatch.bench.report import BenchReport

# Inches at DPI dots per inch: a 900x500 pixel PNG.
FIGURE_SIZE = (9.0, 5.0)
DPI = 100
# Peers often share one concurrency (the prompt count): distinct shapes keep them apart.
PEER_MARKERS = ("s", "D", "^", "v", "P", "X", "h")


@dataclass(frozen=True)
class Series:
    label: str
    points: tuple[tuple[float, float], ...]  # (x, y), x > 0
    joined: bool  # a line through the points, else markers alone


def throughput_series(report: BenchReport) -> list[Series]:
    """cellbatch's decode-only tokens/s against sessions, then each peer's end-to-end
    generated tokens/s at its concurrency."""
    series = []
    if report.sweep:
        series.append(
            Series(
                "cellbatch decode-only (sessions in lockstep)",
                tuple((p.sessions, p.window.decode_only_tokens_per_s) for p in report.sweep),
                joined=True,
            )
        )
    series += [
        Series(f"{run.label} (end to end)", ((run.concurrency, run.tokens_per_s),), joined=False)
        for run in report.runs
        if run.ok
    ]
    return series


def render_chart(series: Sequence[Series], title: str) -> Figure:
    """A figure of `series`: x concurrent generations (log2), y generated tokens/s."""
    if not any(item.points for item in series):
        raise ValueError("nothing to plot: every series is empty")
    figure = Figure(figsize=FIGURE_SIZE, dpi=DPI, layout="constrained")
    axes = figure.add_subplot()
    markers = itertools.cycle(PEER_MARKERS)
    for item in series:
        xs, ys = zip(*item.points, strict=True) if item.points else ((), ())
        if item.joined:
            axes.plot(xs, ys, marker="o", linewidth=2, label=item.label)
        else:
            axes.plot(xs, ys, marker=next(markers), markersize=8, linestyle="", label=item.label)
    ticks = sorted({x for item in series for x, _ in item.points})
    axes.set_xscale("log", base=2)
    axes.set_xticks(ticks, labels=[f"{x:g}" for x in ticks])
    axes.minorticks_off()
    axes.set_ylim(bottom=0)
    axes.set_xlabel("concurrent generations")
    axes.set_ylabel("generated tokens/s")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper left", fontsize="small")
    return figure


def write_plot(report: BenchReport, path: Path) -> None:
    options = report.options
    figure = render_chart(
        throughput_series(report),
        f"generated tokens/s, {options.dtype}, {options.threads} threads",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
