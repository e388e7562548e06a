"""The results of one `Engine.generate_async` call, and the batch that collects them.

Owns: `GenerationResult` (what one prompt produced) and `GenerationBatch` (the handles of
one call's prompts, in prompt order).
Promises: `results()` returns one result per prompt, in prompt order, after every
generation has settled and the engine has taken back their sessions' cells; a prompt that
failed its checks keeps the error it came with.
Never: submits anything; the Engine does, and hands the batch each handle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter

from cellbatch.metrics import GenerationMetrics
from cellbatch.runner import GenerationHandle
from cellbatch.types import FinishReason, Token

Prompt = str | Sequence[Token]


@dataclass
class GenerationResult:
    """What one prompt produced."""

    prompt: Prompt
    prompt_tokens: list[Token]
    tokens: list[Token] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason = FinishReason.FAILED
    error: str = ""
    metrics: GenerationMetrics | None = None  # the turn's: it fed what the shared prefix did not
    shared_prefix_tokens: int = 0  # leading prompt tokens fed once for all prompts of the call

    @property
    def ok(self) -> bool:
        return self.finish_reason in (
            FinishReason.STOP_TOKEN,
            FinishReason.STOP_STRING,
            FinishReason.TOKEN_LIMIT,
        )


class GenerationBatch:
    """The generations of one `Engine.generate_async` call, in prompt order."""

    def __init__(
        self,
        results: list[GenerationResult],
        decode: Callable[[Sequence[Token]], str] | None,
        released: Callable[[float | None], bool],
    ) -> None:
        self._results = results
        self._decode = decode  # for a model without a tokenizer: ids as text
        # Waits until the engine has released what settled generations held.
        self._released = released
        self._handles: list[tuple[GenerationResult, GenerationHandle]] = []

    def track(self, result: GenerationResult, handle: GenerationHandle) -> None:
        self._handles.append((result, handle))

    def handles(self) -> list[GenerationHandle]:
        """The handles of the prompts that passed their checks, in prompt order (for
        streaming; failed prompts have none)."""
        return [handle for _, handle in self._handles]

    def cancel(self) -> None:
        """End every generation still running `cancelled`; finished ones keep their
        results."""
        for _, handle in self._handles:
            handle.cancel()

    def wait(self, timeout: float | None = None) -> bool:
        """True once every generation has settled and the engine has taken back their
        sessions' cells (so `Engine.kv_usage()` no longer counts them)."""
        deadline = None if timeout is None else perf_counter() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - perf_counter())

        if not all(handle.wait(left()) for _, handle in self._handles):
            return False
        return self._released(left())

    def results(self) -> list[GenerationResult]:
        """Wait for every generation, then one result per prompt, in prompt order."""
        self.wait()
        for result, handle in self._handles:
            summary = handle.result()
            result.tokens = list(summary.tokens)
            result.text = summary.text if self._decode is None else self._decode(summary.tokens)
            result.finish_reason = summary.finish_reason or FinishReason.FAILED
            result.error = summary.error
            result.metrics = handle.metrics()
        return self._results
