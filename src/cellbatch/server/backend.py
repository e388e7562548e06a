"""Where the server's generations run in this process: one Engine.

Owns: `start_generations` (a plan's prompts onto one Engine, n choices of a prompt
sharing its prefill), `pooled_summaries` (embedding prompts onto one Engine) and
`LocalBackend`, the `cellbatch.server.api.Backend` of one Engine in this process.
Replicas on Ray implement the same interface in `cellbatch.distributed.backend`.
Promises: `start` returns the choices in plan order (prompt-major, then choice);
every choice's stream ends with exactly one update that carries a finish reason;
`close` is idempotent.
Never: plans requests or builds responses (the service and responses do).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cellbatch.engine import Engine
from cellbatch.generation_config import Constraint, GenConfig
from cellbatch.model.adapters import AdapterInfo
from cellbatch.runner import GenerationHandle
from cellbatch.server.api import Choice, Plan
from cellbatch.server.observability import EngineFiguresCollector, engine_figures
from cellbatch.types import GenerationUpdate, Token

if TYPE_CHECKING:
    from prometheus_client.registry import Collector


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


async def pooled_summaries(
    engine: Engine, prompts: Sequence[Sequence[Token]], pooling: str, priority: int
) -> list[GenerationUpdate]:
    """Each prompt's pooling generation on `engine`, awaited; all are cancelled if the
    caller goes away first."""
    handles = engine.embed_async(list(prompts), pooling=pooling, priority=priority)
    try:
        return [await handle.result_async() for handle in handles]
    finally:
        for handle in handles:
            handle.cancel()  # a no-op for settled ones


class LocalBackend:
    """One Engine in the server's process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.geometry.vocab_size
        self.shape = engine.shape

    def decode(self, tokens: Sequence[Token]) -> str:
        return self.engine.decode(tokens)

    def check_constraint(self, constraint: Constraint) -> None:
        self.engine.check_constraint(constraint)

    async def start(self, plan: Plan) -> list[Choice]:
        handles = await asyncio.to_thread(
            start_generations, self.engine, plan.prompts, plan.configs, plan.n
        )
        return [Choice(index, index // plan.n, handle) for index, handle in enumerate(handles)]

    def embedding_size(self, dimensions: int | None) -> int:
        return self.engine.embedding_size(dimensions)

    def embedding_sizes(self) -> tuple[int, tuple[int, ...] | None]:
        return self.engine.geometry.hidden_size, self.engine.backend.matryoshka_dimensions

    async def embed(
        self, prompts: Sequence[Sequence[Token]], pooling: str, priority: int
    ) -> list[GenerationUpdate]:
        return await pooled_summaries(self.engine, prompts, pooling, priority)

    async def health(self) -> tuple[bool, dict[str, object]]:
        if self.engine.runner.stopping():
            return False, {"status": "stopping"}
        return True, {"status": "ok"}

    def adapters(self) -> list[AdapterInfo]:
        return self.engine.adapters()

    async def load_adapter(self, name: str, path: str) -> None:
        await asyncio.to_thread(self.engine.load_adapter, name, path)

    async def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def collector(self) -> Collector:
        engine = self.engine
        speculative = engine.speculative
        return EngineFiguresCollector(
            lambda: {"": engine_figures(engine)},
            speculative.method if speculative is not None else None,
            lambda: (len(engine.adapters()), engine.adapter_usage()),
        )

    def stopping(self) -> bool:
        return self.engine.runner.stopping()

    def close(self) -> None:
        self.engine.close()
