"""How many drafted tokens each decode verifies: speculation only where it pays
(docs/design.md#speculative-decoding).

Owns: per generation, how often its drafts are accepted (decayed counts: a
generation's copying phases come and go); the engine's step time by its width in
tokens, learnt from the steps it runs (`observe`), for each width of a step before its
drafts (its base): a draft row shares its session's weights and KV reads, so what a
row costs depends on what the step already holds (one stream's drafts are nearly
free, a 32-session step's are not), and a base never observed reads every step's.
Promises: `grant` gives each decoding generation of a step 0 to
`num_speculative_tokens` drafts, never more than its token budget can use, within the
step's spare tokens and cells, and only while the expected tokens the drafts add
(acceptance a per draft: a + a^2 + ..., the first most likely kept) raise the step's
expected tokens per second: none at a width where a step's rows are no longer
nearly free (many decoding sessions, a compute-bound step) unless acceptance is near
certain, and none for a generation whose drafts are mostly rejected. A generation
that stops being granted drafts drifts back towards the prior and is tried again;
so does a width: every `_EXPLORE_EVERY`-th step that stopped short of a draft only
for the time its width was taken to cost grants that draft, so that one slow step
never keeps a width's estimate wrong for good.
Never: sees tokens, drafts or the executor; the step planner asks it and applies
what it says.
"""

from __future__ import annotations

import bisect
import heapq
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from cellbatch.runner.generation import Generation
from cellbatch.speculative import SpeculativeConfig

# Acceptance before any evidence: one accepted and one rejected draft.
_PRIOR_ACCEPTED = 1.0
_PRIOR_REJECTED = 1.0
# Each verification's counts weigh this much less at the next (about the last ten).
_DECAY = 0.9
# A step without drafts pulls a generation's counts this much towards the prior, so
# that a generation backed off is tried again after some tens of steps.
_IDLE_DECAY = 0.97
# Step time by width: each observation moves its width's estimate this far.
_TIME_WEIGHT = 0.2
# Before a width is observed, a step of n tokens is taken to cost as much as one of m
# tokens plus (n - m) / _PRIOR_FIXED_ROWS times it: rows are cheap next to reading the
# weights until a step holds some tens of them (a memory-bound forward).
_PRIOR_FIXED_ROWS = 24.0
# One in this many steps that the step-time model alone kept from another draft grants
# it anyway, to measure that width again.
_EXPLORE_EVERY = 16


@dataclass
class _Acceptance:
    accepted: float = _PRIOR_ACCEPTED
    rejected: float = _PRIOR_REJECTED

    @property
    def rate(self) -> float:
        """The chance that a draft is kept, given the one before it was."""
        return self.accepted / (self.accepted + self.rejected)


class _StepTimes:
    """Step time by width in tokens, learnt from the steps observed."""

    def __init__(self) -> None:
        self._widths: list[int] = []  # observed, ascending
        self._times: dict[int, float] = {}  # width -> seconds

    def __bool__(self) -> bool:
        return bool(self._widths)

    def observe(self, width: int, seconds: float) -> None:
        known = self._times.get(width)
        if known is None:
            bisect.insort(self._widths, width)
            self._times[width] = seconds
        else:
            self._times[width] = known + _TIME_WEIGHT * (seconds - known)

    def time(self, width: int, wider: _StepTimes | None = None) -> float:
        """What the widths observed around `width` took (interpolated), or the prior
        alone, in units of a one-token step, before any. Beyond them: the prior's slope,
        or, given the times of `wider` steps than these (every step's, for the steps of
        one base), their slope from here: the slope of the widths observed here where
        there are two or more, else how `wider`'s times grow."""
        widths = self._widths
        if not widths:
            return _prior(width)
        at = bisect.bisect_left(widths, width)
        if at < len(widths) and widths[at] == width:
            return self._times[width]
        if at == 0:  # below every width observed
            high = widths[0]
            return self._times[high] * _prior(width) / _prior(high)
        low = widths[at - 1]
        if at == len(widths):  # above every width observed
            if wider is not None and len(widths) > 1:
                first = widths[0]
                slope = max(self._times[low] - self._times[first], 0.0) / (low - first)
                return self._times[low] + slope * (width - low)
            if wider is not None:
                return self._times[low] * wider.time(width) / wider.time(low)
            return self._times[low] * _prior(width) / _prior(low)
        high = widths[at]
        low_time, high_time = self._times[low], self._times[high]
        return low_time + max(high_time - low_time, 0.0) * (width - low) / (high - low)


class DraftBudget:
    """Grants drafts per step (engine thread only)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._k = config.num_speculative_tokens
        self._all = _StepTimes()  # every step, by its width
        self._by_base: dict[int, _StepTimes] = {}  # steps by their width before drafts
        self._held_back = 0  # steps the step-time model alone kept from another draft
        self._acceptance: weakref.WeakKeyDictionary[Generation, _Acceptance] = (
            weakref.WeakKeyDictionary()
        )

    def grant(self, decodes: Sequence[Generation], step_tokens: int, spare: int) -> list[int]:
        """Drafts for each of the step's decoding generations, in order, given the step's
        `step_tokens` without drafts and `spare` tokens (budget and cells) for them."""
        grants = [0] * len(decodes)
        limit = self.config.disable_by_batch_size
        if not decodes or spare <= 0 or (limit is not None and len(decodes) >= limit):
            self._idle(decodes)
            return grants
        rates = [self._of(generation).rate for generation in decodes]
        room = [
            min(self._k, g.config.max_new_tokens - g.metrics.generated_tokens - 1) for g in decodes
        ]
        # Best next draft first: the i-th draft of a generation adds rate^i tokens.
        candidates = [(-rate, index, 1) for index, rate in enumerate(rates) if room[index] > 0]
        heapq.heapify(candidates)
        tokens = float(step_tokens)  # every token the step computes is work it does
        width = step_tokens
        while candidates and spare > 0:
            gain, index, nth = candidates[0]
            if (tokens - gain) * self.time(width, step_tokens) <= tokens * self.time(
                width + 1, step_tokens
            ):
                self._held_back += 1
                if self._held_back % _EXPLORE_EVERY:
                    break  # the best draft left would lower the tokens a second
            heapq.heappop(candidates)
            grants[index] = nth
            tokens -= gain
            width += 1
            spare -= 1
            if nth < room[index]:
                heapq.heappush(candidates, (gain * rates[index], index, nth + 1))
        self._idle([g for g, granted in zip(decodes, grants, strict=True) if not granted])
        return grants

    def verified(self, generation: Generation, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts kept the first `accepted`."""
        if not drafted:
            return
        counts = self._of(generation)
        counts.accepted = counts.accepted * _DECAY + accepted
        counts.rejected = counts.rejected * _DECAY + (accepted < drafted)

    def observe(self, width: int, seconds: float, base: int | None = None) -> None:
        """A step of `width` tokens, `base` of them before its drafts (None: all of
        them), took `seconds`."""
        if width < 1:
            return
        self._all.observe(width, seconds)
        base = width if base is None else base
        self._by_base.setdefault(base, _StepTimes()).observe(width, seconds)

    def time(self, width: int, base: int | None = None) -> float:
        """A step of `width` tokens' expected time, `base` of them before drafts: from
        the steps of that base (every step's, before one of that base ran), or the
        prior alone, in units of a one-token step, before any step ran."""
        times = self._by_base.get(width if base is None else base)
        return times.time(width, self._all) if times else self._all.time(width)

    def _of(self, generation: Generation) -> _Acceptance:
        counts = self._acceptance.get(generation)
        if counts is None:
            counts = self._acceptance[generation] = _Acceptance()
        return counts

    def _idle(self, generations: Sequence[Generation]) -> None:
        for generation in generations:
            counts = self._acceptance.get(generation)
            if counts is not None:
                counts.accepted += (_PRIOR_ACCEPTED - counts.accepted) * (1 - _IDLE_DECAY)
                counts.rejected += (_PRIOR_REJECTED - counts.rejected) * (1 - _IDLE_DECAY)


def _prior(width: int) -> float:
    """A step of `width` tokens' time before any is observed, in one-token steps."""
    return 1.0 + (width - 1) / _PRIOR_FIXED_ROWS
