"""What the runner counts, as events, and the one owner of the engine's live counters
(docs/design.md#metrics).

Owns: the events the runner's books record (`MetricsEvent`: small frozen dataclasses of
numbers, one per thing counted; `StepDone.of` reads a step's tasks and outputs into
one), the one place each changes the counters (`_apply`), and
`MetricsLedger`, the owner of a live `EngineMetrics`, which adds events up under its lock.
Promises: `MetricsLedger.record` applies each event whole, so that `snapshot()`, from any
thread, is a consistent copy.
Never: reads clocks; locks anything outside the ledger; hands out the live
`EngineMetrics` (callers get copies).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn, TypeAlias

from cellbatch.metrics import EngineMetrics
from cellbatch.types import FinishReason, Output, SessionId, Task

# -- events: what the runner counts, as plain values ---------------------------------
# Per engine step the runner records one `StepDone` or `StepFailed`; the others come
# per generation or per session, never per token.


@dataclass(frozen=True, slots=True)
class StepDone:
    """One successful step (see `EngineMetrics.record_step`), and the tokens it
    delivered to callers."""

    start: float
    end: float
    decode_sessions: int
    prefill_sessions: int
    prefill_tokens: int
    context: int
    generated_tokens: int
    # Per verification of drafts in the step: (drafts verified, drafts kept).
    verified: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(
        cls,
        tasks: Sequence[Task],
        outputs: Sequence[Output | None],
        start: float,
        end: float,
        generated: int,
    ) -> StepDone:
        """The step's figures: decodes, distinct prefilling sessions and their tokens, the
        context (each session's length after the step, once per session) and the drafts
        verified (how many, and how many were kept, by position)."""
        decodes = prefill_tokens = 0
        prefill_sids: set[SessionId] = set()
        context: dict[SessionId, int] = {}
        verified: list[tuple[int, int]] = []
        for task, output in zip(tasks, outputs, strict=True):
            inp = task.input
            context[inp.sid] = inp.start + inp.size
            if task.is_decode:
                decodes += 1
            else:
                prefill_tokens += inp.size
                prefill_sids.add(inp.sid)
            if output is not None and output.drafted:
                verified.append((output.drafted, len(output.tokens) - 1))
        return cls(
            start,
            end,
            decodes,
            len(prefill_sids),
            prefill_tokens,
            sum(context.values()),
            generated,
            tuple(verified),
        )


@dataclass(frozen=True, slots=True)
class StepFailed:
    """A step the executor failed (or answered malformed): it credits no tokens."""

    start: float
    end: float


@dataclass(frozen=True, slots=True)
class GenerationStarted:
    """The engine took a generation that delivers tokens (a turn or a submission)."""


@dataclass(frozen=True, slots=True)
class PrefillTurnStarted:
    """The engine took a prefill turn (it feeds its delta and generates nothing)."""


@dataclass(frozen=True, slots=True)
class PromptFed:
    """A generation was admitted for the first time, with `tokens` to feed."""

    tokens: int


@dataclass(frozen=True, slots=True)
class Admitted:
    """A generation began (or resumed) running: `running` generations run now, and
    `recomputed` tokens of its context are fed again after their cells were dropped."""

    running: int
    recomputed: int


@dataclass(frozen=True, slots=True)
class GenerationFinished:
    """A generation (not a prefill turn) settled with `reason`; `ttft` if it had a
    first token."""

    reason: FinishReason
    ttft: float | None


@dataclass(frozen=True, slots=True)
class SessionOpened:
    """A session was opened or cloned for a caller, or opened for a submission."""


@dataclass(frozen=True, slots=True)
class SessionRefused:
    """A caller's open or clone was refused (no capacity, or the runner stopped)."""


@dataclass(frozen=True, slots=True)
class PrefixCacheHit:
    """A submission started from a kept snapshot's cells, `tokens` of its prompt unfed."""

    tokens: int


@dataclass(frozen=True, slots=True)
class DeferredForCells:
    """A generation had to wait for KV cells before starting (counted once each)."""


@dataclass(frozen=True, slots=True)
class Preempted:
    """A running generation went back to wait, its cells dropped."""


@dataclass(frozen=True, slots=True)
class SessionReclaimed:
    """An idle session's (or a snapshot's) cells were dropped for other work."""


@dataclass(frozen=True, slots=True)
class Initialized:
    """The executor initialised in `seconds`."""

    seconds: float


MetricsEvent: TypeAlias = (
    StepDone
    | StepFailed
    | GenerationStarted
    | PrefillTurnStarted
    | PromptFed
    | Admitted
    | GenerationFinished
    | SessionOpened
    | SessionRefused
    | PrefixCacheHit
    | DeferredForCells
    | Preempted
    | SessionReclaimed
    | Initialized
)


def _apply(metrics: EngineMetrics, event: MetricsEvent) -> None:
    """The one place an event changes the counters (the most frequent cases first)."""
    match event:
        case StepDone():
            metrics.record_step(
                event.start,
                event.end,
                event.decode_sessions,
                event.prefill_sessions,
                event.prefill_tokens,
                event.context,
            )
            metrics.generated_tokens += event.generated_tokens
            for drafted, accepted in event.verified:
                metrics.record_verified(drafted, accepted)
        case GenerationFinished():
            metrics.record_finish(event.reason)
            if event.ttft is not None:
                metrics.record_ttft(event.ttft)
        case Admitted():
            metrics.recomputed_tokens += event.recomputed
            metrics.peak_concurrent_generations = max(
                metrics.peak_concurrent_generations, event.running
            )
        case PromptFed():
            metrics.prompt_tokens += event.tokens
        case GenerationStarted():
            metrics.generations_started += 1
        case PrefillTurnStarted():
            metrics.prefill_turns += 1
        case StepFailed():
            metrics.record_failed_step(event.start, event.end)
        case SessionOpened():
            metrics.sessions_opened += 1
        case SessionRefused():
            metrics.sessions_refused += 1
        case PrefixCacheHit():
            metrics.prefix_cache_hits += 1
            metrics.prefix_cache_tokens += event.tokens
        case DeferredForCells():
            metrics.deferred_for_cells += 1
        case Preempted():
            metrics.preemptions += 1
        case SessionReclaimed():
            metrics.sessions_reclaimed += 1
        case Initialized():
            metrics.init_time = event.seconds
        case _:
            _unknown(event)


def _unknown(event: NoReturn) -> NoReturn:
    # mypy reports a missing case above: `event` is then not of type NoReturn here.
    raise TypeError(f"not a metrics event: {event!r}")


class MetricsLedger:
    """The engine's counters and the one lock over them: the runner's books record
    events from the engine thread (a refused open also from the caller's thread), and
    any thread reads a snapshot."""

    def __init__(self) -> None:
        self._metrics = EngineMetrics()
        self._lock = threading.Lock()

    def record(self, event: MetricsEvent) -> None:
        with self._lock:
            _apply(self._metrics, event)

    def snapshot(self) -> EngineMetrics:
        """A consistent copy of the counters."""
        with self._lock:
            return self._metrics.copy()
