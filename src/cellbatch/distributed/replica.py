"""One engine replica: the body of a Ray actor that holds an Engine of its own.

Owns: the replica's Engine (loaded in the actor's process with its own torch
threads) and the requests it streams, by the id the server gave them.
Promises: `stream` starts a planned request's generations (n choices of a prompt
sharing its prefill, as on a single server) and yields lists of `Delivery`s as soon as
any is ready: nothing is held back waiting for more, and what arrived while the
previous list was in flight goes together; each choice's last delivery carries its
finish reason and metrics. `cancel` ends a request's generations within a step, even
when it arrives before the request's stream has started. `generate` is
`Engine.generate` on a block of a larger call, seeded as that call's prompts at
`first` onwards would be; `embed` gives prompts' pooled hidden states.
`load_adapter` and `unload_adapter` are the engine's. The actor is async: many requests
stream at once.
Never: imports Ray (`ReplicaSet` makes the actor class), or routes requests.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from cellbatch.engine import Engine, EngineLimits, GenerationResult, Prompt
from cellbatch.generation_config import GenConfig, SamplingParams
from cellbatch.metrics import GenerationMetrics
from cellbatch.model.adapters import AdapterInfo
from cellbatch.model.tokenizer import Tokenizer
from cellbatch.runner import GenerationHandle
from cellbatch.types import GenerationUpdate, Token

# Cancels that came before their request's stream: kept this many, oldest forgotten.
_EARLY_CANCELS = 4096


@dataclass(frozen=True)
class ReplicaInfo:
    """What the server needs to know of a replica (the same for every replica but pid)."""

    index: int
    pid: int
    vocab_size: int
    shape: EngineLimits
    tokenizer: Tokenizer | None
    model: str
    threads: int
    speculative: str | None = None  # its speculative method, where it speculates
    adapters: tuple[AdapterInfo, ...] = ()  # the LoRA adapters it serves
    hidden_size: int = 0  # the embeddings' size
    matryoshka_dimensions: tuple[int, ...] | None = None  # sizes they may be shortened to


class Delivery(NamedTuple):
    choice: int  # the choice's index in the request (prompt-major)
    update: GenerationUpdate
    metrics: GenerationMetrics | None  # with the choice's last update only


class Replica:
    def __init__(
        self, index: int, model: str | None, threads: int, engine_options: dict[str, Any]
    ) -> None:
        self.index = index
        self.threads = threads
        # Ray places the replicas: binding each to the node `auto` picks would stack them.
        engine_options = {"numa": "off", **engine_options}
        self.engine = Engine.from_pretrained(model, threads=threads, **engine_options)
        self._streaming: dict[str, list[GenerationHandle]] = {}
        self._early_cancels: OrderedDict[str, None] = OrderedDict()

    def info(self) -> ReplicaInfo:
        engine = self.engine
        return ReplicaInfo(
            index=self.index,
            pid=os.getpid(),
            vocab_size=engine.geometry.vocab_size,
            shape=engine.shape,
            tokenizer=engine.tokenizer,
            model=str(engine.model_path),
            threads=self.threads,
            speculative=engine.speculative.method if engine.speculative is not None else None,
            adapters=tuple(engine.adapters()),
            hidden_size=engine.geometry.hidden_size,
            matryoshka_dimensions=engine.backend.matryoshka_dimensions,
        )

    def pid(self) -> int:
        return os.getpid()

    async def stream(
        self,
        request_id: str,
        prompts: Sequence[Sequence[Token]],
        configs: Sequence[GenConfig],
        n: int,
    ) -> AsyncIterator[list[Delivery]]:
        from cellbatch.server.backend import start_generations

        if len(prompts) * n == 1:  # nothing to share: submitting does not wait
            handles = start_generations(self.engine, prompts, configs, n)
        else:
            handles = await asyncio.to_thread(start_generations, self.engine, prompts, configs, n)
        self._streaming[request_id] = handles
        if request_id in self._early_cancels:
            del self._early_cancels[request_id]
            self.cancel(request_id)
        ready: asyncio.Queue[Delivery] = asyncio.Queue()

        async def pump(choice: int, handle: GenerationHandle) -> None:
            async for update in handle.stream():
                final = update.finish_reason is not None
                ready.put_nowait(Delivery(choice, update, handle.metrics() if final else None))

        pumps = [asyncio.create_task(pump(i, handle)) for i, handle in enumerate(handles)]
        try:
            running = len(handles)
            while running:
                deliveries = [await ready.get()]
                while not ready.empty():
                    deliveries.append(ready.get_nowait())
                running -= sum(d.update.finish_reason is not None for d in deliveries)
                yield deliveries
        finally:
            for handle in handles:
                handle.cancel()  # a no-op for finished ones
            for task in pumps:
                task.cancel()
            del self._streaming[request_id]

    async def embed(
        self, prompts: Sequence[Sequence[Token]], pooling: str, priority: int
    ) -> list[GenerationUpdate]:
        """The prompts' pooled hidden states (`LocalBackend.embed` on this replica)."""
        from cellbatch.server.backend import pooled_summaries

        return await pooled_summaries(self.engine, prompts, pooling, priority)

    def cancel(self, request_id: str) -> None:
        handles = self._streaming.get(request_id)
        if handles is None:
            self._early_cancels[request_id] = None
            while len(self._early_cancels) > _EARLY_CANCELS:
                self._early_cancels.popitem(last=False)
            return
        for handle in handles:
            handle.cancel()

    async def generate(
        self,
        prompts: Sequence[Prompt],
        params: GenConfig | SamplingParams | None,
        options: dict[str, Any],
        first: int,
    ) -> list[GenerationResult]:
        seed = options.get("seed")
        if seed is None and isinstance(params, GenConfig):
            seed = params.seed
        if seed is not None:
            # Prompt i of a call is seeded seed + i: this block starts at prompt `first`.
            options = {**options, "seed": (seed + first) % 2**63}
        return await asyncio.to_thread(self.engine.generate, prompts, params, **options)

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        return await asyncio.to_thread(self.engine.load_adapter, name, path)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def figures(self) -> dict[str, float]:
        from cellbatch.server.observability import engine_figures

        return engine_figures(self.engine)
