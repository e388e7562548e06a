"""Engine-side state of sessions and generations, and how a generation stops.

Owns: `SessionRecord` (a session's whole context and how much of it the executor
holds), `ContextSource` (where a submission's context comes from) and `Generation`
(one turn: its kind, its status, settings, callbacks, handle, counters, text stream
and stopping rules), plus the checks on a turn's input.
Lifecycle: a generation's `status` (`GenerationStatus`) moves only along `MOVES`, and
only through `Generation.move`:

    POSTED --> WAITING --> RUNNING <--> PREEMPTED
       |          |           |             |
       +----------+-----------+-------------+--> ENDED
Promises: written only by the engine thread (other threads read single attributes);
`Generation.deliver` applies stop tokens, the token budget and stop strings to each
new token, in that order per token, and never delivers a token past the one that
ended the generation (nor the logprobs of one); prompt logprobs are delivered once,
however often a preempted generation recomputes its prompt; every generation
settles once, its outcome published before `on_settled` runs.
Never: talks to the executor or the scheduler; the runner loop does.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import operator
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Protocol

from cellbatch.generation_config import GenConfig, SamplingParams
from cellbatch.metrics import GenerationMetrics
from cellbatch.runner.handle import GenerationHandle
from cellbatch.text_stream import Detokenizer, TextStream, check_stop_strings
from cellbatch.types import (
    MAX_POSITION,
    NO_ADAPTER,
    FinishReason,
    GenerationUpdate,
    InvalidArgumentError,
    SessionId,
    Token,
    TokenLogprob,
)

log = logging.getLogger(__name__)

UpdateCallback = Callable[[GenerationUpdate], None]
SettledCallback = Callable[[GenerationHandle], None]
# A session's adapter when turns under different LoRA adapters (or none) fed its cells:
# its cells then match no single adapter, and it is never kept in the prefix cache.
MIXED_ADAPTERS = -1


class AdapterLookup(Protocol):
    """The LoRA adapters a runner's generations may name (`cellbatch.model.adapters.
    AdapterBank` is one): a generation acquires its adapter's id when it is submitted
    and releases it once it has ended, so that an unloaded adapter's weights stay until
    the generations using them are done."""

    def acquire(self, name: str) -> int: ...

    def release(self, adapter_id: int, prompt_tokens: int, generated_tokens: int) -> None: ...


class SessionRecord:
    """Engine-side truth about one session.

    Invariant: `computed <= committed <= len(context)`. `context` is everything the
    session holds: what it held before each turn, each turn's delta and exactly the
    tokens delivered. `computed` is the one number that says how far the session has
    been computed: its first `computed` context tokens are in the executor's cells, and
    the next input the runner sends starts there (as vLLM's `num_computed_tokens`
    catches up to a request's tokens). It falls when the runner drops cells under KV
    pressure (those tokens are fed again) and rises when a step runs. `committed` of
    the context tokens have been fed at some time (the session's position, as its face
    reports it); the rest are fed by the next turn.
    """

    __slots__ = (
        "active",
        "adapter",
        "clone_waiters",
        "close_requested",
        "closed",
        "committed",
        "computed",
        "context",
        "last_used",
        "poisoned",
        "sid",
    )

    def __init__(self, sid: SessionId, context: Sequence[Token] = (), computed: int = 0) -> None:
        self.sid = sid
        self.context: list[Token] = list(context)
        self.committed = computed
        self.computed = computed
        self.active: Generation | None = None
        self.poisoned = ""  # why, once an executor failure hit this session
        self.close_requested = False  # by its face; done once no waiting submission needs it
        self.closed = False  # the executor session is gone
        self.clone_waiters = 0  # waiting submissions that start from this session
        self.last_used = 0  # engine step when its last turn ended: least recent drops first
        # The LoRA adapter id its computed cells were computed under (MIXED_ADAPTERS: more
        # than one); NO_ADAPTER for the base model.
        self.adapter = NO_ADAPTER

    def unfed(self) -> tuple[Token, ...]:
        """Context the model has never consumed: the last generated token, or the
        rest of a turn that ended early. The next turn feeds it first."""
        return tuple(self.context[self.committed :])

    def feed_with(self, adapter: int) -> None:
        """A turn under `adapter` starts feeding it after its computed cells."""
        if self.computed == 0 or self.adapter == adapter:
            self.adapter = adapter
        else:
            self.adapter = MIXED_ADAPTERS

    def advance(self, end: int) -> None:
        """The session is computed up to `end`: the executor holds positions [0, end)."""
        self.computed = end
        self.committed = max(self.committed, end)


@dataclasses.dataclass(frozen=True)
class ContextSource:
    """Where a submitted generation's context comes from: a new empty session, or
    `source`'s first `upto` context tokens (its cells shared where it holds them)."""

    source: SessionRecord | None = None
    upto: int = 0


class GenerationKind(enum.Enum):
    TURN = "turn"  # a turn on a caller's session
    PREFILL = "prefill"  # a prefill turn: feeds its delta, generates nothing
    SUBMISSION = "submission"  # runs on a session of its own, closed when it ends


class GenerationStatus(enum.IntEnum):
    """Where a generation is in its life, in the order it goes through them."""

    POSTED = 0  # handed to the inbox; the engine has not seen it yet
    WAITING = 1  # queued for a session or cells, never admitted
    RUNNING = 2  # admitted: its delta is in its session's context
    PREEMPTED = 3  # gave its cells up under pressure; queued again, at the head
    ENDED = 4  # settled, whatever the outcome


MOVES: dict[GenerationStatus, frozenset[GenerationStatus]] = {
    GenerationStatus.POSTED: frozenset({GenerationStatus.WAITING, GenerationStatus.ENDED}),
    GenerationStatus.WAITING: frozenset({GenerationStatus.RUNNING, GenerationStatus.ENDED}),
    GenerationStatus.RUNNING: frozenset({GenerationStatus.PREEMPTED, GenerationStatus.ENDED}),
    GenerationStatus.PREEMPTED: frozenset({GenerationStatus.RUNNING, GenerationStatus.ENDED}),
    GenerationStatus.ENDED: frozenset(),
}


_RUNNING = GenerationStatus.RUNNING
_ENDED = GenerationStatus.ENDED
_PREFILL = GenerationKind.PREFILL


class Generation:
    """One generation (engine thread only, except `cancel_requested`, which any
    thread may raise)."""

    # Six parameters: what a caller asked for (config, the two callbacks) and where the
    # generation runs (kind, session, context source); nothing here is derived.
    def __init__(
        self,
        config: GenConfig,
        on_update: UpdateCallback | None,
        on_settled: SettledCallback | None,
        *,
        kind: GenerationKind = GenerationKind.TURN,
        state: SessionRecord | None = None,
        start: ContextSource | None = None,
    ) -> None:
        if (kind is GenerationKind.SUBMISSION) != (start is not None):
            raise ValueError("a submission, and only a submission, has a ContextSource")
        self.kind = kind
        self.status = GenerationStatus.POSTED
        self.state = state
        self.start = start  # a submission's: where its session of its own comes from
        self.config = config
        self.priority = config.priority  # lower runs first: read per task and per admission
        self.on_update = on_update
        self.on_settled = on_settled
        self.handle = GenerationHandle()
        self.metrics = GenerationMetrics(submit_time=perf_counter())
        self.delta: tuple[Token, ...] = ()
        self.input_error = ""
        self.stop_tokens: frozenset[Token] = frozenset()
        self.text: TextStream | None = None
        self.cancel_requested = False
        self.admitted_order = 0  # larger: admitted later (preempted first)
        self.deferred = False  # it once had to wait for cells
        self.queued_on_source = False  # a waiting submission counted in its source's waiters
        self.last_step = -1  # the last engine step that ran one of its inputs
        self.prompt_scored = False  # its prompt logprobs were delivered (never twice)
        self.adapter_id = NO_ADAPTER  # its LoRA adapter's id, held from `prepare` to `settle`
        self._adapters: AdapterLookup | None = None  # where adapter_id is released

    def move(self, to: GenerationStatus) -> None:
        """The one place a generation's status changes."""
        if to not in MOVES[self.status]:
            raise AssertionError(f"a generation cannot go from {self.status.name} to {to.name}")
        self.status = to

    # These are read per generation per step: module constants and int comparisons,
    # because looking an enum member up on its class, or hashing one, costs several
    # times a plain attribute read.

    @property
    def admitted(self) -> bool:
        """Admitted at least once and not ended: its delta is in its session's context."""
        return _RUNNING <= self.status < _ENDED  # RUNNING or PREEMPTED

    @property
    def ended(self) -> bool:
        return self.status is _ENDED

    @property
    def feeds_only(self) -> bool:
        return self.kind is _PREFILL

    def prepare(
        self,
        delta: Sequence[Token],
        default_stop_tokens: frozenset[Token],
        tokenizer: Detokenizer | None,
        adapters: AdapterLookup | None = None,
    ) -> None:
        """Check the input, acquire the LoRA adapter the config names from `adapters`
        and settle the stopping rules; a problem is kept in `input_error` and fails the
        generation on the engine thread."""
        self.delta, self.input_error = read_delta(delta, self.config)
        config = self.config
        if not self.input_error and config.adapter is not None:
            self._acquire(config.adapter, adapters)
        stop_tokens = default_stop_tokens if config.stop_tokens is None else config.stop_tokens
        self.stop_tokens = stop_tokens | config.extra_stop_tokens
        if self.input_error or self.feeds_only:
            return
        try:
            stop_strings = check_stop_strings(config.stop_strings)
        except InvalidArgumentError as error:
            self.input_error = str(error)
            return
        if tokenizer is not None:
            self.text = TextStream(tokenizer, stop_strings, config.include_stop_string)
        elif stop_strings:
            self.input_error = (
                "stop strings need a runner with a tokenizer (Runner(..., tokenizer=...)); "
                "use stop tokens instead"
            )

    def _acquire(self, name: str, adapters: AdapterLookup | None) -> None:
        if adapters is None:
            self.input_error = (
                f"adapter {name!r}: this runner serves no LoRA adapters; load the model with "
                "an Engine to serve them"
            )
            return
        try:
            self.adapter_id = adapters.acquire(name)
        except InvalidArgumentError as error:
            self.input_error = str(error)
            return
        self._adapters = adapters

    def executor_sampling(self) -> SamplingParams:
        """The policy the executor installs: the config's, with min_tokens holding back
        this generation's stop tokens (when it asks for min_tokens and names none)."""
        sampling = self.config.sampling
        if sampling.min_tokens and not sampling.min_tokens_held:
            return dataclasses.replace(sampling, min_tokens_held=self.stop_tokens)
        return sampling

    def refusal(self) -> str:
        """Why the generation cannot be queued, or ""."""
        state = self.state
        if state is None:
            return self._submission_refusal()
        if state.closed or state.close_requested:
            return "session is closed"
        if state.poisoned:
            return (
                f"session {state.sid} is poisoned by an earlier executor failure "
                f"({state.poisoned}); close it and open a new session"
            )
        if state.active is not None:
            return "the session already has an active generation; wait for it or cancel it"
        if not self.delta and not state.context:
            return "delta is empty: a turn must feed at least one new token"
        if self.feeds_only and not self.delta and not state.unfed():
            return "delta is empty: a prefill turn must feed at least one new token"
        feed = len(state.unfed()) + len(self.delta)
        if state.committed + feed + self.config.max_new_tokens - 2 > MAX_POSITION:
            return overflow_message(state.committed, feed, self.config.max_new_tokens)
        return ""

    def _submission_refusal(self) -> str:
        assert self.start is not None
        source, upto = self.start.source, self.start.upto
        if source is None:
            if not self.delta:
                return "the prompt is empty: a generation must feed at least one token"
            return ""
        if source.closed or source.close_requested:
            return "the source session is closed; submit before closing it"
        if source.poisoned:
            return f"the source session is poisoned ({source.poisoned})"
        if upto > len(source.context) or (upto == 0 and not self.delta):
            return (
                f"cannot start from {upto} tokens of a session holding "
                f"{len(source.context)}, with {len(self.delta)} more to feed; "
                "upto must be within the source's context and something must be fed"
            )
        return ""

    def count_step(self, decode: bool, tokens: int, start: float, step: int) -> None:
        """One of its inputs ran in engine step `step`, which started at `start`."""
        metrics = self.metrics
        if metrics.first_step_time is None:
            metrics.first_step_time = start
        if not decode:
            metrics.prefilled_tokens += tokens
        if self.last_step != step:
            self.last_step = step
            if decode:
                metrics.decode_steps += 1
            else:
                metrics.prefill_steps += 1

    def deliver(
        self,
        tokens: Sequence[Token],
        logprobs: Sequence[TokenLogprob] = (),
        prompt_logprobs: Sequence[TokenLogprob | None] = (),
    ) -> GenerationUpdate:
        """Of an executor's `tokens` (and their `logprobs`, when asked), the update the
        generation delivers: the tokens it keeps with their logprobs, the text they add,
        the finish reason if one of them ends it, and the prompt logprobs unless an
        earlier update carried them."""
        room = self.config.max_new_tokens - self.metrics.generated_tokens
        kept: list[Token] = []
        texts: list[str] = []
        reason: FinishReason | None = None
        for token in tokens[:room]:
            kept.append(token)
            if token in self.stop_tokens:  # the stop token beats the budget and is delivered
                reason = FinishReason.STOP_TOKEN
            elif self.text is not None:
                step = self.text.push(token)
                texts.append(step.text)
                if step.stopped:
                    reason = FinishReason.STOP_STRING
            if reason is not None:
                break
        if reason is None and len(kept) == room:
            reason = FinishReason.TOKEN_LIMIT
        if reason not in (None, FinishReason.STOP_STRING) and self.text is not None:
            texts.append(self.text.finish())
        prompt: tuple[TokenLogprob | None, ...] = ()
        if prompt_logprobs and not self.prompt_scored:
            prompt, self.prompt_scored = tuple(prompt_logprobs), True
        return GenerationUpdate(
            tuple(kept),
            reason,
            text="".join(texts),
            logprobs=tuple(logprobs[: len(kept)]),
            prompt_logprobs=prompt,
        )

    def closing_text(self) -> str:
        """Text still held back when the generation ends some other way."""
        return self.text.finish() if self.text is not None else ""

    def emit(self, update: GenerationUpdate) -> str:
        """Deliver a non-final update; returns why on_update failed, or ""."""
        failure = self._call_on_update(update)
        self.handle._publish(update)
        return failure

    def settle(
        self, reason: FinishReason, error: str, last: GenerationUpdate | None = None
    ) -> FinishReason:
        """Deliver the final update (`last`'s tokens, text and logprobs, where tokens
        ended it, then the reason and error), publish the outcome, then run on_settled
        once. A raising on_update turns the outcome into `failed`. Returns the outcome."""
        update = dataclasses.replace(
            last or GenerationUpdate(()), finish_reason=reason, error=error
        )
        failure = self._call_on_update(update)
        if failure:
            reason, error = FinishReason.FAILED, failure
            update = dataclasses.replace(update, finish_reason=reason, error=error)
        self.on_update = None
        self.metrics.end_time = perf_counter()
        adapters, self._adapters = self._adapters, None
        if adapters is not None:  # before waiters wake: an unload after this may drop it
            try:
                adapters.release(
                    self.adapter_id, self.metrics.prompt_tokens, self.metrics.generated_tokens
                )
            except Exception:
                log.exception("releasing the generation's adapter raised")
        self.handle._publish(update)
        # Dropped before the call so that its captures die with this frame.
        on_settled, self.on_settled = self.on_settled, None
        if on_settled is not None:
            try:
                on_settled(self.handle)
            except Exception:
                log.exception("on_settled raised after the generation had settled")
        return reason

    def _call_on_update(self, update: GenerationUpdate) -> str:
        if self.on_update is None:
            return ""
        try:
            self.on_update(update)
        except Exception as exc:
            self.on_update = None  # a callback that raised is never called again
            return f"on_update raised {exc!r}; the generation was stopped"
        return ""


def read_delta(delta: Sequence[Token], config: GenConfig) -> tuple[tuple[Token, ...], str]:
    """The delta as a tuple of token ids, or () and why it cannot run. Checks only
    what does not depend on the session; lengths first, so that a huge delta is
    refused without being copied."""
    max_new = config.max_new_tokens
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new <= 0:
        return (), f"max_new_tokens must be a positive integer, got {max_new!r}"
    try:
        size = len(delta)
    except TypeError:
        return (), f"delta must be a sequence of token ids, got {type(delta).__name__}"
    if size + max_new - 2 > MAX_POSITION:
        return (), overflow_message(0, size, max_new)
    try:
        tokens = tuple(map(operator.index, delta))
    except TypeError:
        return (), "delta must hold integer token ids"
    if tokens and (lowest := min(tokens)) < 0:
        return (), f"token ids must be >= 0; got {lowest} at index {tokens.index(lowest)}"
    return tokens, ""


def overflow_message(context: int, feed: int, max_new: int) -> str:
    return (
        f"the turn overflows the position range: {context} tokens of context + {feed} to feed "
        f"+ max_new_tokens {max_new} would need positions up to "
        f"{context + feed + max_new - 2}, above {MAX_POSITION}; shorten the delta or lower "
        "max_new_tokens"
    )
