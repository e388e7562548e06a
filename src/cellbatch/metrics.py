"""Counters of one generation and of the whole engine (docs/design.md#metrics).

Owns: `GenerationMetrics` and `EngineMetrics`, plain dataclasses of raw counters
(times are `time.perf_counter()` seconds), the figures derived from them, and a
readable text report of each. The runner adds them up from events
(`cellbatch.runner.metrics_ledger`).
Promises: derived figures never divide by zero (they are None, or 0 where a
rate has no time to run over); `as_dict()` gives counters and derived figures
as JSON-ready values.
Never: reads clocks, or locks anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cellbatch.types import FinishReason


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass
class GenerationMetrics:
    """One generation: when things happened and how many tokens went each way."""

    submit_time: float = 0.0
    first_step_time: float | None = None  # start of the first step that ran one of its inputs
    first_token_time: float | None = None
    last_token_time: float | None = None
    end_time: float | None = None  # when the outcome was published
    prompt_tokens: int = 0  # tokens this turn feeds: the carried pending token(s) + the delta
    cached_tokens: int = 0  # prompt tokens found in the runner's prefix cache, not fed
    prefilled_tokens: int = 0  # of those, how many the model has consumed
    generated_tokens: int = 0  # tokens delivered
    prefill_steps: int = 0
    decode_steps: int = 0
    itl_count: int = 0
    itl_sum: float = 0.0
    itl_min: float = 0.0  # 0 while there is no inter-token latency yet
    itl_max: float = 0.0

    def record_tokens(self, count: int, now: float) -> None:
        """`count` tokens arrived together at `now`. The first of a burst is timed
        from the previous token; the rest of a speculative burst arrive 0 s later."""
        if count <= 0:
            return
        if self.last_token_time is None:
            self.first_token_time = now
        else:
            self._add_gap(now - self.last_token_time)
        for _ in range(count - 1):
            self._add_gap(0.0)
        self.last_token_time = now
        self.generated_tokens += count

    def _add_gap(self, gap: float) -> None:
        self.itl_min = gap if self.itl_count == 0 else min(self.itl_min, gap)
        self.itl_max = max(self.itl_max, gap)
        self.itl_sum += gap
        self.itl_count += 1

    @property
    def ttft(self) -> float | None:
        """Submission to first token."""
        return _span(self.submit_time, self.first_token_time)

    @property
    def queue_wait(self) -> float | None:
        """Submission to the first step that ran any of its inputs."""
        return _span(self.submit_time, self.first_step_time)

    @property
    def prefill_span(self) -> float | None:
        """First step to first token."""
        return _span(self.first_step_time, self.first_token_time)

    @property
    def decode_span(self) -> float | None:
        """First token to last token."""
        return _span(self.first_token_time, self.last_token_time)

    @property
    def e2e(self) -> float | None:
        """Submission to the published outcome."""
        return _span(self.submit_time, self.end_time)

    @property
    def itl_mean(self) -> float | None:
        return self.itl_sum / self.itl_count if self.itl_count else None

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, over the time they took; 0 without such time."""
        span = self.decode_span
        return (self.generated_tokens - 1) / span if span else 0.0

    def as_dict(self) -> dict[str, Any]:
        derived = ("ttft", "queue_wait", "prefill_span", "decode_span", "e2e", "itl_mean")
        out = dataclasses.asdict(self)
        out.update({name: getattr(self, name) for name in derived})
        out["decode_tokens_per_s"] = self.decode_tokens_per_s
        return out

    def report(self) -> str:
        return "\n".join(
            [
                f"tokens      prompt {self.prompt_tokens}, prefilled {self.prefilled_tokens}, "
                f"generated {self.generated_tokens}",
                f"steps       prefill {self.prefill_steps}, decode {self.decode_steps}",
                f"latency     ttft {_ms(self.ttft)}, queue wait {_ms(self.queue_wait)}, "
                f"prefill {_ms(self.prefill_span)}, decode {_ms(self.decode_span)}, "
                f"e2e {_ms(self.e2e)}",
                f"inter-token n={self.itl_count}, mean {_ms(self.itl_mean)}, "
                f"min {_ms(self.itl_min)}, max {_ms(self.itl_max)}",
                f"decode rate {self.decode_tokens_per_s:.1f} tokens/s",
            ]
        )


@dataclass
class EngineMetrics:
    """The engine over its life: steps, tokens, latencies, generations, sessions.

    Step counters cover successful steps only; a failed step is counted in
    `failed_steps` and credits no tokens. "Context" of a step is the sum, over
    the sessions in it, of each session's length after the step (a session with
    several prompt chunks in one step counts once).
    """

    steps: int = 0
    failed_steps: int = 0
    decode_sessions: int = 0  # summed over steps (one decode is one session)
    decode_tokens: int = 0
    prefill_sessions: int = 0  # summed over steps, distinct sessions per step
    prefill_tokens: int = 0
    step_time_sum: float = 0.0
    step_time_max: float = 0.0
    decode_only_steps: int = 0
    decode_only_time: float = 0.0
    decode_only_tokens: int = 0
    mixed_steps: int = 0
    mixed_time: float = 0.0
    prefill_only_steps: int = 0
    prefill_only_time: float = 0.0
    context_sum: int = 0
    context_max: int = 0  # the largest single step's context
    sessions_opened: int = 0  # opens and clones granted
    sessions_refused: int = 0  # opens and clones refused for capacity
    peak_concurrent_generations: int = 0
    generations_started: int = 0
    generations_completed: int = 0
    prefill_turns: int = 0  # Session.prefill_async turns: they feed a delta, generate nothing
    deferred_for_cells: int = 0  # generations that had to wait for KV cells before starting
    preemptions: int = 0  # running generations sent back to wait, their cells dropped
    sessions_reclaimed: int = 0  # idle or waiting sessions whose cells were dropped for others
    recomputed_tokens: int = 0  # context fed again after its cells had been dropped
    prefix_cache_hits: int = 0  # submissions that started from a kept snapshot's cells
    prefix_cache_tokens: int = 0  # prompt tokens those submissions did not feed
    finished: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in FinishReason})
    ttft_count: int = 0
    ttft_sum: float = 0.0
    ttft_min: float = 0.0
    ttft_max: float = 0.0
    prompt_tokens: int = 0  # fed by generations that started
    generated_tokens: int = 0  # delivered to callers
    # Speculative decoding (vLLM's spec_decode counters): verifications of drafts, the
    # drafted tokens they verified, the drafts kept, and the drafts kept at each position
    # (index i: the (i+1)-th draft of a verification).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    init_time: float = 0.0
    first_step_start: float | None = None
    last_step_end: float | None = None

    def copy(self) -> EngineMetrics:
        return dataclasses.replace(
            self,
            finished=dict(self.finished),
            spec_accepted_per_position=list(self.spec_accepted_per_position),
        )

    def record_verified(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts kept the first `accepted`."""
        self.spec_drafts += 1
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted
        per_position = self.spec_accepted_per_position
        if len(per_position) < drafted:
            per_position.extend([0] * (drafted - len(per_position)))
        for position in range(accepted):
            per_position[position] += 1

    def _mark_step(self, start: float, end: float) -> None:
        if self.first_step_start is None:
            self.first_step_start = start
        self.last_step_end = end

    def record_step(
        self,
        start: float,
        end: float,
        decode_sessions: int,
        prefill_sessions: int,
        prefill_tokens: int,
        context: int,
    ) -> None:
        """One successful step; each decode is one session feeding one token."""
        elapsed = end - start
        self._mark_step(start, end)
        self.steps += 1
        self.decode_sessions += decode_sessions
        self.decode_tokens += decode_sessions
        self.prefill_sessions += prefill_sessions
        self.prefill_tokens += prefill_tokens
        self.step_time_sum += elapsed
        self.step_time_max = max(self.step_time_max, elapsed)
        # The three buckets partition the steps, so their times sum to step_time_sum.
        if not prefill_tokens:
            self.decode_only_steps += 1
            self.decode_only_time += elapsed
            self.decode_only_tokens += decode_sessions
        elif decode_sessions:
            self.mixed_steps += 1
            self.mixed_time += elapsed
        else:
            self.prefill_only_steps += 1
            self.prefill_only_time += elapsed
        self.context_sum += context
        self.context_max = max(self.context_max, context)

    def record_failed_step(self, start: float, end: float) -> None:
        self._mark_step(start, end)
        self.failed_steps += 1

    def record_ttft(self, ttft: float) -> None:
        self.ttft_min = ttft if self.ttft_count == 0 else min(self.ttft_min, ttft)
        self.ttft_max = max(self.ttft_max, ttft)
        self.ttft_sum += ttft
        self.ttft_count += 1

    def record_finish(self, reason: FinishReason) -> None:
        self.generations_completed += 1
        self.finished[reason.value] = self.finished.get(reason.value, 0) + 1

    @property
    def wall_time(self) -> float:
        """Start of the first step to end of the last (initialisation excluded)."""
        span = _span(self.first_step_start, self.last_step_end)
        return span or 0.0

    @property
    def idle_fraction(self) -> float:
        """Share of the wall time spent outside successful steps."""
        wall = self.wall_time
        return max(0.0, 1.0 - self.step_time_sum / wall) if wall else 0.0

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_time if self.wall_time else 0.0

    @property
    def input_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.wall_time if self.wall_time else 0.0

    @property
    def decode_only_tokens_per_s(self) -> float:
        return self.decode_only_tokens / self.decode_only_time if self.decode_only_time else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        return (self.decode_tokens + self.prefill_tokens) / self.steps if self.steps else 0.0

    @property
    def mean_decode_sessions_per_step(self) -> float:
        return self.decode_sessions / self.steps if self.steps else 0.0

    @property
    def mean_prefill_tokens_per_step(self) -> float:
        return self.prefill_tokens / self.steps if self.steps else 0.0

    @property
    def mean_step_time(self) -> float | None:
        return self.step_time_sum / self.steps if self.steps else None

    @property
    def mean_context(self) -> float:
        return self.context_sum / self.steps if self.steps else 0.0

    @property
    def ttft_mean(self) -> float | None:
        return self.ttft_sum / self.ttft_count if self.ttft_count else None

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Drafted tokens kept, of those verified."""
        return (
            self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None
        )

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens a verification gave: the drafts it kept and its own next token."""
        return 1 + self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else None

    def as_dict(self) -> dict[str, Any]:
        derived = (
            "wall_time",
            "idle_fraction",
            "generated_tokens_per_s",
            "input_tokens_per_s",
            "decode_only_tokens_per_s",
            "mean_tokens_per_step",
            "mean_decode_sessions_per_step",
            "mean_prefill_tokens_per_step",
            "mean_step_time",
            "mean_context",
            "ttft_mean",
            "spec_acceptance_rate",
            "spec_mean_acceptance_length",
        )
        out = dataclasses.asdict(self)
        out.update({name: getattr(self, name) for name in derived})
        return out

    def _speculation_lines(self) -> list[str]:
        if not self.spec_drafts:
            return []
        rate = self.spec_acceptance_rate or 0.0
        return [
            f"speculation   {self.spec_drafts} verifications, {self.spec_draft_tokens} drafted, "
            f"{self.spec_accepted_tokens} accepted ({rate:.1%}); mean acceptance length "
            f"{self.spec_mean_acceptance_length:.2f}"
        ]

    def report(self) -> str:
        finished = ", ".join(f"{name} {count}" for name, count in self.finished.items() if count)
        return "\n".join(
            [
                f"steps         {self.steps} ok, {self.failed_steps} failed; "
                f"mean {self.mean_tokens_per_step:.1f} tokens/step "
                f"({self.mean_decode_sessions_per_step:.1f} decodes, "
                f"{self.mean_prefill_tokens_per_step:.1f} prefill tokens)",
                f"step latency  mean {_ms(self.mean_step_time)}, max {_ms(self.step_time_max)}; "
                f"decode-only {self.decode_only_steps} ({_ms(self.decode_only_time)}), "
                f"mixed {self.mixed_steps} ({_ms(self.mixed_time)}), "
                f"prefill-only {self.prefill_only_steps} ({_ms(self.prefill_only_time)})",
                f"context       mean {self.mean_context:.1f}, max {self.context_max} tokens/step",
                f"generations   {self.generations_started} started, "
                f"{self.generations_completed} completed ({finished or 'none'}); "
                f"peak {self.peak_concurrent_generations} at once, "
                f"{self.deferred_for_cells} waited for KV cells; "
                f"{self.prefill_turns} prefill turns",
                f"sessions      {self.sessions_opened} opened, {self.sessions_refused} refused",
                f"kv pressure   {self.preemptions} preemptions, {self.sessions_reclaimed} idle "
                f"sessions' cells dropped, {self.recomputed_tokens} tokens recomputed",
                f"prefix cache  {self.prefix_cache_hits} hits, {self.prefix_cache_tokens} "
                "prompt tokens reused",
                f"ttft          n={self.ttft_count}, mean {_ms(self.ttft_mean)}, "
                f"min {_ms(self.ttft_min)}, max {_ms(self.ttft_max)}",
                *self._speculation_lines(),
                f"tokens        {self.prompt_tokens} prompt, {self.generated_tokens} generated",
                f"throughput    {self.generated_tokens_per_s:.1f} generated/s, "
                f"{self.input_tokens_per_s:.1f} input/s, "
                f"{self.decode_only_tokens_per_s:.1f} decode-only/s",
                f"time          wall {self.wall_time:.4f} s, idle {self.idle_fraction:.1%}, "
                f"init {self.init_time:.3f} s",
            ]
        )
