"""Engine: a model backend (a torch module or an exported program), its tokenizer, an
executor, a scheduler and a Runner in one.

Owns: the calls on a started engine: generations, chat, embeddings, LoRA adapters,
reports and closing (building it over a backend, or loading one from files first, is
`EngineStart`'s, in `cellbatch.engine.start`, which `Engine` inherits).
Promises: `generate` / `chat` take many prompts at once and return one result per
prompt, in order; a bad prompt (empty, a token outside the vocabulary, too long for
the session) fails alone with a message naming the numbers, and the others run.
Every prompt is submitted to the Runner, which queues what does not fit yet (the
Runner owns every queue). Seeds are derived per prompt, so a seeded result does not
depend on what else shares the batch. A prefix common to all the prompts of a call
(a chat template's system prompt, say) is fed once and its cells shared; results are
the same tokens as without the sharing. Sessions and submissions default to the
model's stop tokens. `embed` gives each input's pooled last hidden states (last token
or mean, normalised), its prompts batched in the same steps as generations; a bad
input is refused before anything runs, naming it. LoRA adapters load and unload while the
engine runs (`load_adapter`, `unload_adapter`); a generation names one in its GenConfig
and runs beside the base model's in the same steps. After `close()`, every call says the
engine is closed.
Never: touches the engine thread's state directly (everything goes through the
Runner's faces), or asks which kind of backend it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from cellbatch.engine.batch import GenerationBatch, GenerationResult, Prompt
from cellbatch.engine.call_checks import call_config, prompt_problem, seeded
from cellbatch.engine.embedding import embedding_size, finish_embedding
from cellbatch.engine.prefix import feed_shared_prefix
from cellbatch.engine.start import EngineStart
from cellbatch.generation_config import Constraint, GenConfig, SamplingParams
from cellbatch.metrics import EngineMetrics
from cellbatch.model.adapters import AdapterBank, AdapterInfo, AdapterUsage
from cellbatch.model.tokenizer import Tokenizer
from cellbatch.model.weights_summary import WeightsSummary
from cellbatch.runner import GenerationHandle, Session
from cellbatch.threads import in_short_lived_thread
from cellbatch.types import (
    DEFAULT_PRIORITY,
    FinishReason,
    GenerationUpdate,
    InvalidArgumentError,
    KVUsage,
    ModelGeometry,
    Token,
)

Message = Mapping[str, str]


class Engine(EngineStart):
    """Batched generation with one model: `Engine.from_pretrained(path).generate(prompts)`.

    `Engine(backend, tokenizer)` runs a backend built by hand (`ModuleBackend(module,
    config)` over a PackedTransformer, or `ProgramBackend(program)`); `from_pretrained`
    loads one from a path."""

    # -- sessions ------------------------------------------------------------

    def open_session(self, timeout: float | None = None) -> Session:
        """A new Runner session (streaming, multi-turn, clone); its generations stop at
        the model's stop tokens unless their GenConfig names others. Raises when the
        engine is closed or every session is open."""
        self._require_open()
        session = self.runner.open_session_async().result(timeout)
        if session is None:
            self._require_open()
            raise RuntimeError(
                f"no session available: all {self.shape.max_sessions} are open; close one "
                "or raise max_sessions"
            )
        return session

    # -- batch generation ----------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: GenConfig | SamplingParams | None = None,
        *,
        max_new_tokens: int | None = None,
        stop: Sequence[str] = (),
        seed: int | None = None,
        on_tokens: Callable[[int], None] | None = None,
        share_prefix: bool = True,
        constraint: Constraint | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt at once; results in prompt order.

        Text prompts are tokenized as they are (no chat template: see `chat`);
        token lists are used verbatim. `stop` adds text stop strings (the text ends
        before the stop string). `on_tokens(n)` is called from the engine thread as
        tokens arrive (for progress bars). `share_prefix` feeds the prompts' common
        prefix (when at least MIN_SHARED_PREFIX tokens) once. `constraint` (a
        `Constraint`: JSON schema, any JSON object, regex, choice or grammar) limits every
        generation's text to it; one that does not compile fails each prompt with the
        library's message, before anything runs.
        """
        batch = self.generate_async(
            prompts,
            params,
            max_new_tokens=max_new_tokens,
            stop=stop,
            seed=seed,
            on_tokens=on_tokens,
            share_prefix=share_prefix,
            constraint=constraint,
        )
        return batch.results()

    def generate_async(
        self,
        prompts: Sequence[Prompt],
        params: GenConfig | SamplingParams | None = None,
        *,
        max_new_tokens: int | None = None,
        stop: Sequence[str] = (),
        seed: int | None = None,
        on_tokens: Callable[[int], None] | None = None,
        share_prefix: bool = True,
        constraint: Constraint | None = None,
    ) -> GenerationBatch:
        """`generate` without waiting: the batch can be waited on, cancelled (what
        finished stays finished) and collected."""
        self._require_open()
        base = call_config(params, max_new_tokens, seed, stop)
        if constraint is not None:
            base = replace(base, sampling=replace(base.sampling, constraint=constraint))
        unconstrainable = self._constraint_problem(base.sampling.constraint)
        results = [self._prepare(prompt, base, unconstrainable) for prompt in prompts]
        jobs = [(index, result) for index, result in enumerate(results) if result.error == ""]
        root = (
            feed_shared_prefix(
                self.runner,
                [result.prompt_tokens for _, result in jobs],
                self.shape.max_sessions,
                base.adapter,
            )
            if share_prefix
            else None
        )
        batch = GenerationBatch(
            results, self.decode if self.tokenizer is None else None, self.runner.sync
        )

        def progress(update: GenerationUpdate) -> None:
            if on_tokens is not None and update.tokens:
                on_tokens(len(update.tokens))

        for index, result in jobs:
            reused = root.length if root is not None else 0
            result.shared_prefix_tokens = reused
            handle = self.runner.submit(
                result.prompt_tokens[reused:],
                seeded(base, index),
                progress if on_tokens is not None else None,
                source=root.session if root is not None else None,
                upto=reused,
            )
            batch.track(result, handle)
        if root is not None:
            root.session.close()  # submissions queued before the close still start from it
        return batch

    def embed(
        self,
        inputs: Sequence[Prompt],
        *,
        pooling: str = "last",
        normalize: bool = True,
        dimensions: int | None = None,
        priority: int = DEFAULT_PRIORITY,
    ) -> list[list[float]]:
        """One embedding per input, in order: the model's last hidden states (after its
        final norm) of the input's tokens, pooled ("last": the last token's; "mean":
        their mean), shortened to `dimensions` where the model allows it, and normalised
        to unit length unless `normalize` is False. Text inputs are tokenized as they are
        (no chat template). A bad input raises InvalidArgumentError naming it, before
        anything runs; a failure while running raises RuntimeError."""
        size = self.embedding_size(dimensions)
        handles = self.embed_async(inputs, pooling=pooling, priority=priority)
        vectors = []
        for index, handle in enumerate(handles):
            result = handle.result()
            if result.finish_reason is not FinishReason.TOKEN_LIMIT or not result.embedding:
                raise RuntimeError(f"input {index}: {result.error or result.finish_reason}")
            vectors.append(finish_embedding(result.embedding, size, normalize).tolist())
        return vectors

    def embed_async(
        self,
        inputs: Sequence[Prompt],
        *,
        pooling: str = "last",
        priority: int = DEFAULT_PRIORITY,
    ) -> list[GenerationHandle]:
        """`embed` without waiting or finishing: each input's generation, whose result
        carries the raw pooled vector (`GenerationUpdate.embedding`, float32, not
        normalised; see `cellbatch.engine.embedding.finish_embedding`). Every input is
        checked before any is submitted."""
        self._require_open()
        if self.executor.pooled_forward() is None:
            raise InvalidArgumentError(
                f"this engine runs a {self.executor_kind}, which gives logits only: embeddings "
                "need the model itself (load its folder or GGUF file, not a program)"
            )
        config = GenConfig(
            max_new_tokens=1,  # sizes the position checks; a pooling generation samples none
            sampling=SamplingParams(pooling=pooling),
            stop_tokens=frozenset(),
            priority=priority,
        )
        prompts = []
        for index, prompt in enumerate(inputs):
            tokens = self._prepare(prompt, config, "").prompt_tokens
            problem = prompt_problem(
                tokens, config, "", self.geometry.vocab_size, self.shape.max_session_tokens
            )
            if problem:
                raise InvalidArgumentError(f"input {index}: {problem}")
            prompts.append(tokens)
        return [self.runner.submit(tokens, config) for tokens in prompts]

    def embedding_size(self, dimensions: int | None = None) -> int:
        """The size of the embeddings `embed(dimensions=...)` gives; InvalidArgumentError
        for a size the model does not allow (see cellbatch.engine.embedding)."""
        return embedding_size(
            self.geometry.hidden_size, self.backend.matryoshka_dimensions, dimensions
        )

    def chat(
        self,
        conversations: Sequence[str | Sequence[Message]],
        params: GenConfig | SamplingParams | None = None,
        **options: Any,
    ) -> list[GenerationResult]:
        """Like `generate`, with the model's chat template applied; a plain string is
        one user message."""
        return self.generate(
            [self.chat_tokens(conversation) for conversation in conversations], params, **options
        )

    def chat_tokens(self, conversation: str | Sequence[Message]) -> list[Token]:
        tokenizer = self._require_tokenizer("apply a chat template")
        messages = (
            [{"role": "user", "content": conversation}]
            if isinstance(conversation, str)
            else list(conversation)
        )
        return tokenizer.apply_chat_template(messages)

    def decode(self, tokens: Sequence[Token]) -> str:
        if self.tokenizer is None:
            return " ".join(str(token) for token in tokens)
        return self.tokenizer.decode(tokens)

    # -- LoRA adapters ---------------------------------------------------------

    def load_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        """Serve the PEFT LoRA adapter in folder `path` as `name` from now on, beside the
        others and the base model; generations name it in `GenConfig(adapter=name)`.
        Raises (loading nothing) for a folder that cannot run on this model (the file
        and the mismatch named), a name in use, or max_loras adapters loaded."""
        self._require_open()
        return in_short_lived_thread(lambda: self._adapter_bank().load(name, path))

    def unload_adapter(self, name: str) -> None:
        """Stop serving `name`: new generations cannot name it; those running finish
        with it, then its weights are freed. Raises for a name not loaded."""
        self._require_open()
        self._adapter_bank().unload(name)

    def adapters(self) -> list[AdapterInfo]:
        """The LoRA adapters served now, in load order."""
        bank = self.backend.adapters
        return [] if bank is None else bank.adapters()

    def adapter_usage(self) -> dict[str, AdapterUsage]:
        """Per adapter name loaded since the engine started: generations, prompt and
        generated tokens (kept after an unload)."""
        bank = self.backend.adapters
        return {} if bank is None else bank.usage()

    def _adapter_bank(self) -> AdapterBank:
        bank = self.backend.adapters
        if bank is None:
            raise InvalidArgumentError(
                f"this engine runs a {self.executor_kind}, which runs no LoRA adapters: "
                f"{self.backend.adapters_refusal}"
            )
        return bank

    # -- reports -------------------------------------------------------------

    def metrics(self) -> EngineMetrics:
        return self.runner.metrics()

    @property
    def geometry(self) -> ModelGeometry:
        return self.backend.geometry

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype."""
        return self.backend.dtype

    @property
    def kernels(self) -> str:
        return self.backend.kernels

    @property
    def device(self) -> torch.device:
        """Where the forwards run (the model, its KV pool and the cells' tensors)."""
        return self.backend.device

    @property
    def executor_kind(self) -> str:
        """ "module" (the torch module itself) or "program" (an exported program)."""
        return self.backend.kind

    @property
    def weights_bytes(self) -> int:
        return self.backend.weights_bytes

    @property
    def weights(self) -> WeightsSummary:
        """Which weight format ran: in words, per role, the quantised products' kernel,
        and bytes per format."""
        return self.backend.weights

    @property
    def weight_format(self) -> str:
        """The weight format in words, e.g. "int4, embedding int8, lm_head int8"."""
        return self.weights.format

    def kv_usage(self) -> KVUsage:
        """Cells in use, the cell limit, pool rows, allocated bytes, growth count and
        bytes per cell, as of the engine's last step (the Runner's figures)."""
        limit = self.shape.max_cells
        return self.runner.kv_usage() or KVUsage(0, limit, limit)

    # -- lifecycle -----------------------------------------------------------

    def close(self) -> None:
        """Cancel what still runs and stop the engine; idempotent."""
        self._closed = True
        self.runner.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------

    def _require_open(self) -> None:
        if self._closed or self.runner.stopping():
            raise RuntimeError("the engine is closed; create a new Engine to generate again")

    def _require_tokenizer(self, why: str) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidArgumentError(f"this model has no tokenizer, so it cannot {why}")
        return self.tokenizer

    def _prepare(self, prompt: Prompt, config: GenConfig, unconstrainable: str) -> GenerationResult:
        """Tokenizes and checks one prompt; a bad one comes back already failed
        (`unconstrainable`: why the call's constraint cannot run, or "")."""
        if isinstance(prompt, str):
            tokens = self._require_tokenizer("encode text prompts").encode(prompt)
        else:
            tokens = [int(token) for token in prompt]
        result = GenerationResult(prompt=prompt, prompt_tokens=tokens)
        result.error = prompt_problem(
            tokens, config, unconstrainable, self.geometry.vocab_size, self.shape.max_session_tokens
        )
        return result

    def check_constraint(self, constraint: Constraint) -> None:
        """Compiles `constraint` for this model's tokenizer (kept for its generations);
        InvalidArgumentError naming the problem when it does not compile."""
        if self.constraints is None:
            raise InvalidArgumentError(
                "this model has no tokenizer, so a constraint cannot be compiled for it; "
                "load a model with its tokenizer files"
            )
        self.constraints.check(constraint)

    def _constraint_problem(self, constraint: Constraint | None) -> str:
        """Why `constraint` cannot run, or "" (checked once per call, for every prompt)."""
        if constraint is None:
            return ""
        try:
            self.check_constraint(constraint)
        except InvalidArgumentError as error:
            return str(error)
        return ""
