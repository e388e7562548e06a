"""Where the server's generations run: the `Backend` interface and its one-engine form.

Owns: the interface the app and `EngineService` use to run planned requests
(`Backend`: the tokenizer and limits to plan with, `start` to launch a plan's
generations as streaming choices, health, the engine figures for `/metrics`, close),
the handle a choice streams from (`ChoiceHandle`), `start_generations` (a plan's
prompts onto one Engine, n choices of a prompt sharing its prefill), and
`LocalBackend`, one Engine in this process. Replicas on Ray implement the same
interface in `cellbatch.distributed.backend`.
Promises: `start` returns the choices in plan order (prompt-major, then choice);
every choice's stream ends with exactly one update that carries a finish reason;
`close` is idempotent.
Never: plans requests or builds responses (the service and responses do).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol

from cellbatch.engine import Engine, EngineShape
from cellbatch.metrics import GenerationMetrics
from cellbatch.runner import GenerationHandle
from cellbatch.server.observability import EngineFiguresCollector, engine_figures
from cellbatch.server.service import Choice, Plan
from cellbatch.types import GenConfig, GenerationUpdate, Token

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from cellbatch.model.tokenizer import Tokenizer


class ChoiceHandle(Protocol):
    """One choice's generation as the service follows it (a GenerationHandle is one)."""

    def stream(self) -> AsyncIterator[GenerationUpdate]: ...

    def cancel(self) -> None: ...

    def metrics(self) -> GenerationMetrics: ...


class Backend(Protocol):
    tokenizer: Tokenizer | None
    vocab_size: int
    shape: EngineShape  # resolved: max_sessions and max_session_tokens are set

    def decode(self, tokens: Sequence[Token]) -> str: ...

    async def start(self, plan: Plan) -> list[Choice]:
        """Launch every generation of the plan; the choices stream as they run."""
        ...

    async def health(self) -> tuple[bool, dict[str, object]]:
        """(serving, what /health shows)."""
        ...

    def collector(self) -> Collector:
        """The engine figures (and the backend's own) for /metrics, read at scrape
        time, from any thread."""
        ...

    def stopping(self) -> bool: ...

    def close(self) -> None: ...


def start_generations(
    engine: Engine, prompts: Sequence[Sequence[Token]], configs: Sequence[GenConfig], n: int
) -> list[GenerationHandle]:
    """The generations of a plan on `engine` (blocking while shared prefixes are fed),
    prompt-major: n choices of one prompt share its prefill."""
    handles: list[GenerationHandle] = []
    for prompt, config in zip(prompts, configs, strict=True):
        # Prompt logprobs score every prompt token: nothing may be shared then.
        scoring = config.sampling.prompt_logprobs is not None
        batch = engine.generate_async([list(prompt)] * n, config, share_prefix=not scoring)
        handles.extend(batch.handles())
    return handles


class LocalBackend:
    """One Engine in the server's process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.vocab_size = int(engine.config.vocab_size)
        self.shape = engine.shape

    def decode(self, tokens: Sequence[Token]) -> str:
        return self.engine.decode(tokens)

    async def start(self, plan: Plan) -> list[Choice]:
        handles = await asyncio.to_thread(
            start_generations, self.engine, plan.prompts, plan.configs, plan.n
        )
        return [Choice(index, index // plan.n, handle) for index, handle in enumerate(handles)]

    async def health(self) -> tuple[bool, dict[str, object]]:
        if self.engine.runner.stopping():
            return False, {"status": "stopping"}
        return True, {"status": "ok"}

    def collector(self) -> Collector:
        return EngineFiguresCollector(lambda: {"": engine_figures(self.engine)})

    def stopping(self) -> bool:
        return self.engine.runner.stopping()

    def close(self) -> None:
        self.engine.close()
