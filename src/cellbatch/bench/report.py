"""The throughput benchmark's figures: token agreement, each peer's timed run, the engine's
counters over a stretch of work, and the JSON and text of one benchmark run.

Owns: comparing a peer's greedy tokens with the reference's (and the parity rule),
`PeerRun`, `EngineWindow`, `ConcurrencyPoint`, `BenchReport`, its JSON file (with the
published tables and headline figures, `cellbatch.bench.results`) and its printed table.
Promises: tokens/s is generated tokens (stop tokens included) over the wall time of the
timed call; ratios are cellbatch's tokens/s over each other peer's that ran in the same
run; the JSON keeps every figure, each peer's tokens and the options.
Never: times, loads or runs anything; judges the figures against targets.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellbatch.bench.results import Headline, Results, ResultTable, machine, results_fields
from cellbatch.bench.workload import CELLBATCH, CHAT_PROMPTS, CONTINUOUS, REFERENCES, VLLM
from cellbatch.metrics import EngineMetrics
from cellbatch.types import Token

if TYPE_CHECKING:
    from cellbatch.bench.workload import BenchOptions

# The parity rule of the default-model test: a divergence is excused only when the
# reference's two best logits there are closer than this and our token is one of them.
NEAR_TIE_LOGIT_GAP = 0.01


def first_divergence(ours: Sequence[Token], reference: Sequence[Token]) -> int | None:
    """The first index where the two differ (the shorter one's length when one is a prefix
    of the other); None when they are identical."""
    for index, (a, b) in enumerate(zip(ours, reference, strict=False)):
        if a != b:
            return index
    return None if len(ours) == len(reference) else min(len(ours), len(reference))


@dataclass
class Divergence:
    """Where one prompt's tokens first leave the reference's."""

    prompt: int
    index: int
    ours: Token | None  # None: our tokens ended here
    reference: Token | None  # None: the reference's tokens ended here
    top2_gap: float | None = None  # the reference model's best minus second-best logit here
    ours_in_top2: bool | None = None

    @property
    def near_tie(self) -> bool:
        return (
            self.top2_gap is not None
            and self.top2_gap < NEAR_TIE_LOGIT_GAP
            and bool(self.ours_in_top2)
        )


@dataclass
class Agreement:
    """How many prompts gave exactly the reference's tokens, and where the others left it."""

    total: int
    divergences: list[Divergence]

    @property
    def identical(self) -> int:
        return self.total - len(self.divergences)

    @property
    def meets_parity_rule(self) -> bool:
        """Identical everywhere, or one prompt off, at a near-tie (the default model's parity
        rule: bf16 and MKL rounding may flip a near-tie, nothing else may)."""
        return not self.divergences or (len(self.divergences) == 1 and self.divergences[0].near_tie)


def compare(outputs: Sequence[Sequence[Token]], reference: Sequence[Sequence[Token]]) -> Agreement:
    if len(outputs) != len(reference):
        raise ValueError(
            f"{len(outputs)} outputs against {len(reference)} reference outputs: "
            "compare runs over the same prompts"
        )
    divergences = []
    for prompt, (ours, theirs) in enumerate(zip(outputs, reference, strict=True)):
        index = first_divergence(ours, theirs)
        if index is not None:
            divergences.append(
                Divergence(
                    prompt,
                    index,
                    ours[index] if index < len(ours) else None,
                    theirs[index] if index < len(theirs) else None,
                )
            )
    return Agreement(len(outputs), divergences)


@dataclass
class PeerRun:
    """One peer's timed generation over the prompt set."""

    name: str
    label: str
    concurrency: int  # generations in flight at once
    dtype: str
    seconds: float = 0.0
    outputs: list[list[Token]] = field(default_factory=list)
    error: str = ""
    agreement: Agreement | None = None
    idle_fraction: float | None = None  # cellbatch only: engine time outside its steps

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def generated_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        agreement = self.agreement
        return {
            "label": self.label,
            "concurrency": self.concurrency,
            "dtype": self.dtype,
            "seconds": self.seconds,
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": self.tokens_per_s,
            "error": self.error,
            "idle_fraction": self.idle_fraction,
            "agreement": None
            if agreement is None
            else {
                "identical": agreement.identical,
                "total": agreement.total,
                "meets_parity_rule": agreement.meets_parity_rule,
                "divergences": [
                    {**dataclasses.asdict(d), "near_tie": d.near_tie} for d in agreement.divergences
                ],
            },
            "outputs": self.outputs,
        }


@dataclass(frozen=True)
class EngineWindow:
    """The engine's counters over one stretch of work, from two metrics snapshots."""

    steps: int
    step_seconds: float
    wall_seconds: float  # from the caller's start to the end of the last step
    decode_only_steps: int
    decode_only_tokens: int
    decode_only_seconds: float

    @classmethod
    def between(cls, before: EngineMetrics, after: EngineMetrics, started: float) -> EngineWindow:
        """`started` is the perf_counter() reading taken just before the work was submitted,
        so submission and scheduling overhead count as idle time."""
        last = after.last_step_end
        return cls(
            steps=after.steps - before.steps,
            step_seconds=after.step_time_sum - before.step_time_sum,
            wall_seconds=max(0.0, last - started) if last is not None else 0.0,
            decode_only_steps=after.decode_only_steps - before.decode_only_steps,
            decode_only_tokens=after.decode_only_tokens - before.decode_only_tokens,
            decode_only_seconds=after.decode_only_time - before.decode_only_time,
        )

    @property
    def idle_fraction(self) -> float:
        if self.wall_seconds <= 0:
            return 0.0
        return max(0.0, 1.0 - self.step_seconds / self.wall_seconds)

    @property
    def decode_only_tokens_per_s(self) -> float:
        if self.decode_only_seconds <= 0:
            return 0.0
        return self.decode_only_tokens / self.decode_only_seconds

    @property
    def sessions_per_decode_step(self) -> float:
        return self.decode_only_tokens / self.decode_only_steps if self.decode_only_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "idle_fraction": self.idle_fraction,
            "decode_only_tokens_per_s": self.decode_only_tokens_per_s,
            "sessions_per_decode_step": self.sessions_per_decode_step,
        }


@dataclass(frozen=True)
class ConcurrencyPoint:
    """cellbatch decoding with `sessions` generations in lockstep."""

    sessions: int
    window: EngineWindow


@dataclass
class BenchReport:
    """Everything one benchmark run measured."""

    options: BenchOptions
    environment: dict[str, Any]
    prompt_lengths: list[int]
    runs: list[PeerRun]
    sweep: list[ConcurrencyPoint] = field(default_factory=list)
    sweep_error: str = ""
    command: str = "cellbatch bench"  # as the user typed it, for the published figures

    def run(self, name: str) -> PeerRun | None:
        return next((run for run in self.runs if run.name == name), None)

    def reference(self) -> PeerRun | None:
        """The run whose tokens the others are compared with (None: none of REFERENCES ran)."""
        runs = (self.run(name) for name in REFERENCES)
        return next((run for run in runs if run is not None and run.ok), None)

    def ratios(self) -> dict[str, float]:
        """cellbatch's tokens/s over each other peer's that ran."""
        ours = self.run(CELLBATCH)
        if ours is None or not ours.ok:
            return {}
        return {
            f"{CELLBATCH}/{run.name}": ours.tokens_per_s / run.tokens_per_s
            for run in self.runs
            if run.name != CELLBATCH and run.ok and run.tokens_per_s > 0
        }

    def as_dict(self) -> dict[str, Any]:
        options = dataclasses.asdict(self.options)
        options.update(
            model=str(self.options.model) if self.options.model else None,
            output_json=str(self.options.output_json),
            plot=str(self.options.plot) if self.options.plot else None,
            skip=sorted(self.options.skip),
            peers=sorted(self.options.peers),
            vllm_python=str(self.options.vllm_python),
            peer_cache=str(self.options.peer_cache),
        )
        return {
            "options": options,
            "environment": self.environment,
            "prompts": [
                {"text": text, "tokens": length}
                for text, length in zip(CHAT_PROMPTS, self.prompt_lengths, strict=False)
            ],
            "peers": {run.name: run.as_dict() for run in self.runs},
            "ratios": self.ratios(),
            "concurrency": [
                {"sessions": point.sessions, **point.window.as_dict()} for point in self.sweep
            ],
            "concurrency_error": self.sweep_error,
        }

    def published(self) -> Results:
        """The tables and headline figures the docs show of this run."""
        options = self.options
        lengths = self.prompt_lengths
        reference = self.reference()
        ratios = self.ratios()
        ok_runs = [run for run in self.runs if run.ok]
        budget = (
            f"exactly {options.max_new_tokens} new tokens each"
            if options.ignore_eos
            else f"at most {options.max_new_tokens} new tokens each"
        )
        tables = [
            ResultTable(
                caption=f"{len(lengths)} chat prompts ({min(lengths)}-{max(lengths)} tokens), "
                f"greedy, {budget}: generated tokens/s",
                columns=("peer", "dtype", "tokens/s", "cellbatch x", "same tokens"),
                rows=[
                    (
                        run.label,
                        run.dtype,
                        run.tokens_per_s,
                        f"{ratios[f'{CELLBATCH}/{run.name}']:.2f}x"
                        if f"{CELLBATCH}/{run.name}" in ratios
                        else "",
                        _agreement_cell(run, reference),
                    )
                    for run in ok_runs
                ],
            )
        ]
        if self.sweep:
            tables.append(
                ResultTable(
                    caption="cellbatch decode-only tokens/s, sessions decoding in lockstep",
                    columns=("sessions", "tokens/s", "sessions per step"),
                    rows=[
                        (
                            point.sessions,
                            point.window.decode_only_tokens_per_s,
                            point.window.sessions_per_decode_step,
                        )
                        for point in self.sweep
                    ],
                )
            )
        ours = self.run(CELLBATCH)
        headline = []
        for name, what in ((VLLM, "vLLM's CPU build"), (CONTINUOUS, "transformers")):
            theirs = self.run(name)
            if ours is not None and ours.ok and theirs is not None and theirs.ok:
                headline.append(
                    Headline(
                        what=f"{len(lengths)} chat prompts at once ({budget}), "
                        f"{_weights(ours.label)}",
                        cellbatch=ours.tokens_per_s,
                        peer=f"{what} ({theirs.label}, {theirs.dtype})",
                        peer_value=theirs.tokens_per_s,
                    )
                )
        plot = options.plot
        beside = plot is not None and plot.parent == options.output_json.parent
        return Results(
            benchmark=options.output_json.stem,
            title="cellbatch bench: cellbatch against transformers"
            + (" and vLLM" if self.run(VLLM) is not None else "")
            + f" ({options.dtype})",
            command=self.command,
            tables=tables,
            headline=headline,
            plot=plot.name if beside and plot is not None else None,
            machine=self.environment.get("machine") or machine(self.options.threads),
        )


def _weights(label: str) -> str:
    """What a cellbatch peer's label says of its weights, for the headline's words."""
    return label.removeprefix("cellbatch").strip(" ,") or "cellbatch"


def _agreement_cell(run: PeerRun, reference: PeerRun | None) -> str:
    if run is reference:
        return "(reference)"
    if run.agreement is None:
        return ""
    return f"{run.agreement.identical}/{run.agreement.total}"


def write_json(report: BenchReport, path: Path) -> None:
    dump_json({**results_fields(report.published()), **report.as_dict()}, path)


def dump_json(data: dict[str, Any], path: Path) -> None:
    """Indented JSON, with each list of numbers (token ids, mostly) kept on one line."""
    text = json.dumps(data, indent=2)
    text = _NUMBER_LIST.sub(lambda match: "[" + " ".join(match[1].split()) + "]", text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.e+-]+(?:,\s*-?[\d.e+-]+)*)\s*\]")


def format_report(report: BenchReport) -> str:
    options = report.options
    lengths = report.prompt_lengths
    reference = report.reference()
    lines = [
        f"model {report.environment['model']}",
        f"{options.dtype}, {options.threads} threads, {len(lengths)} chat prompts "
        f"({min(lengths)}-{max(lengths)} tokens), greedy, "
        + (
            f"exactly {options.max_new_tokens} new tokens (stop tokens ignored)"
            if options.ignore_eos
            else f"at most {options.max_new_tokens} new tokens, stop at the model's stop tokens"
        ),
        "",
        f"{'peer':<44} {'dtype':>8} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} "
        f"{'cellbatch x':>11}  same tokens as {reference.name if reference else 'n/a'}",
    ]
    ratios = report.ratios()
    for run in report.runs:
        if not run.ok:
            lines.append(f"{run.label:<44} failed: {run.error}")
            continue
        ratio = ratios.get(f"{CELLBATCH}/{run.name}")
        lines.append(
            f"{run.label:<44} {run.dtype:>8} {run.seconds:>8.2f} {run.generated_tokens:>7} "
            f"{run.tokens_per_s:>9.1f} {'' if ratio is None else f'{ratio:.2f}x':>11}  "
            f"{_agreement_text(run, reference)}"
        )
    ours = report.run(CELLBATCH)
    if ours is not None and ours.idle_fraction is not None:
        lines.append(f"cellbatch engine idle fraction over that run: {ours.idle_fraction:.1%}")
    for run in report.runs:
        for d in run.agreement.divergences if run.agreement else ():
            gap = "n/a" if d.top2_gap is None else f"{d.top2_gap:.4f}"
            lines.append(
                f"  {run.name}: prompt {d.prompt} first differs at token {d.index} "
                f"(ours {d.ours}, reference {d.reference}; reference top-2 gap {gap}"
                f"{', near-tie' if d.near_tie else ''})"
            )
    if report.sweep:
        lines += [
            "",
            f"cellbatch decode-only throughput ({options.max_new_tokens} tokens per session, "
            "sessions in lockstep)",
            f"{'sessions':>8} {'tokens/s':>9} {'steps':>6} {'sessions/step':>13} {'idle':>6}",
        ]
        for point in report.sweep:
            window = point.window
            lines.append(
                f"{point.sessions:>8} {window.decode_only_tokens_per_s:>9.1f} "
                f"{window.decode_only_steps:>6} {window.sessions_per_decode_step:>13.1f} "
                f"{window.idle_fraction:>6.1%}"
            )
    if report.sweep_error:
        lines.append(f"decode sweep failed: {report.sweep_error}")
    loads = [report.environment.get(f"load_average_1min_at_{when}") for when in ("start", "end")]
    cores = report.environment.get("cores")
    if cores and any(load is not None and load > cores for load in loads):
        start, end = ("n/a" if load is None else f"{load:.1f}" for load in loads)
        lines.append(
            f"warning: the machine was busy (1-minute load {start} at start, {end} at end, on "
            f"{cores} cores): every figure is lower than on an idle machine"
        )
    return "\n".join(lines)


def _agreement_text(run: PeerRun, reference: PeerRun | None) -> str:
    if run is reference:
        return "(reference)"
    if run.agreement is None:
        return "n/a"
    agreement = run.agreement
    verdict = "meets" if agreement.meets_parity_rule else "misses"
    return f"{agreement.identical}/{agreement.total} ({verdict} the parity rule)"
