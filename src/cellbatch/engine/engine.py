"""Engine: a model backend (a torch module or an exported program), its tokenizer, an
executor, a scheduler and a Runner in one.

Owns: the backend and tokenizer, and the Runner driving them.
Promises: `generate` / `chat` take many prompts at once and return one result per
prompt, in order; a bad prompt (empty, a token outside the vocabulary, too long for
the session) fails alone with a message naming the numbers, and the others run.
Every prompt is submitted to the Runner, which queues what does not fit yet (the
Runner owns every queue). Seeds are derived per prompt, so a seeded result does not
depend on what else shares the batch. A prefix common to all the prompts of a call
(a chat template's system prompt, say) is fed once and its cells shared; results are
the same tokens as without the sharing. Sessions and submissions default to the
model's stop tokens. After `close()`, every call says the engine is closed.
Never: touches the engine thread's state directly (everything goes through the
Runner's faces), or asks which kind of backend it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cellbatch.cache import kv_bytes_per_cell
from cellbatch.engine.backend import ModelBackend, ModuleBackend, ProgramBackend
from cellbatch.engine.batch import GenerationBatch, GenerationResult, Prompt
from cellbatch.executor.cell_executor import ExecutorShape
from cellbatch.export import is_program
from cellbatch.metrics import EngineMetrics
from cellbatch.model.default import default_model_path
from cellbatch.model.loading import LoadProgress, PhaseClock
from cellbatch.model.ops import resolve as resolve_ops
from cellbatch.model.quantized import WeightsSummary, resolve_quantize
from cellbatch.model.tokenizer import Tokenizer, load_tokenizer
from cellbatch.model.transformer import resolve_dtype
from cellbatch.runner import AdmissionPolicy, Runner, Session
from cellbatch.runner.snapshots import common_prefix_length
from cellbatch.scheduler import DecodeFirstScheduler
from cellbatch.types import (
    MAX_POSITION,
    FinishReason,
    GenConfig,
    GenerationUpdate,
    InvalidArgumentError,
    KVUsage,
    ModelGeometry,
    SamplingParams,
    Token,
)

Message = Mapping[str, str]

# Bounds the KV pool by default: cells past this many bytes are never allocated.
DEFAULT_KV_BUDGET_BYTES = 4 * 2**30
DEFAULT_MAX_SESSIONS = 64
DEFAULT_MAX_BATCH_TOKENS = 544
DEFAULT_MAX_SESSION_TOKENS = 8192
# Shorter common prefixes are fed by every prompt: the extra turn would cost more than
# it saves.
MIN_SHARED_PREFIX = 16


@dataclass(frozen=True)
class EngineShape:
    """The engine's limits; None means "derive from the model and the others"."""

    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_session_tokens: int | None = None
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_decode_sequences: int | None = None
    max_prefill_chunk: int | None = None
    max_cells: int | None = None


@dataclass(frozen=True)
class EngineLimits:
    """An EngineShape with every limit derived: what the engine runs with."""

    max_sessions: int
    max_session_tokens: int
    max_batch_tokens: int
    max_decode_sequences: int
    max_prefill_chunk: int
    max_cells: int


class Engine:
    """Batched generation with one model: `Engine.from_pretrained(path).generate(prompts)`.

    `Engine(backend, tokenizer)` runs a backend built by hand (`ModuleBackend(module,
    config)` over a PackedTransformer, or `ProgramBackend(program)`); `from_pretrained`
    loads one from a path."""

    def __init__(
        self,
        backend: ModelBackend,
        tokenizer: Tokenizer | None,
        *,
        shape: EngineShape = EngineShape(),
        kv_dtype: torch.dtype | None = None,
        model_path: Path | None = None,
        admission: str | AdmissionPolicy = AdmissionPolicy.OPTIMISTIC,
        prefix_cache_entries: int = 0,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.kv_dtype = backend.dtype if kv_dtype is None else kv_dtype
        self.stop_tokens = frozenset(
            tokenizer.stop_tokens if tokenizer is not None else backend.geometry.eos_token_ids
        )
        self.shape = _resolve_shape(shape, backend.geometry, self.kv_dtype)
        self.executor = backend.executor(
            ExecutorShape(
                max_sessions=self.shape.max_sessions,
                max_session_tokens=self.shape.max_session_tokens,
                max_cells=self.shape.max_cells,
                max_batch_tokens=self.shape.max_batch_tokens,
                kv_dtype=self.kv_dtype,
            )
        )
        self.scheduler = DecodeFirstScheduler.create(
            max_batch_tokens=self.shape.max_batch_tokens,
            max_decode_sequences=self.shape.max_decode_sequences,
            max_prefill_chunk=self.shape.max_prefill_chunk,
        )
        self.admission = AdmissionPolicy(admission)
        self.runner = Runner(
            self.executor,
            self.scheduler,
            tokenizer=tokenizer,
            stop_tokens=sorted(self.stop_tokens),
            admission=self.admission,
            prefix_cache_entries=prefix_cache_entries,
        )
        self._closed = False

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        kv_dtype: str | torch.dtype | None = None,
        threads: int | None = None,
        kernels: str = "auto",
        quantize: str = "auto",
        admission: str = "optimistic",
        prefix_cache_entries: int = 0,
        progress: LoadProgress | None = None,
        **shape: Any,
    ) -> Engine:
        """Load a Hugging Face folder, a GGUF file (default: the embedded
        SmolLM2-135M-Instruct) or a program file (`.pt2`, from `cellbatch export`: see
        `from_program`). `shape` takes EngineShape's fields. `kv_dtype`
        defaults to the weight dtype. `kernels`: "auto" (the compiled CPU kernels where
        they build, else pure torch), "compiled" or "torch". `quantize`: "auto" (a GGUF
        file keeps its precision class, e.g. Q4_1 -> int4; other models stay float),
        "none", "int8" or "int4" (see cellbatch.model.quantized). `progress` hears of each
        phase of the load as it ends (what it did, and its seconds). The options are
        checked before anything loads."""
        resolve_quantize(quantize)  # a bad value fails before anything loads
        if model is not None and is_program(model):
            return cls.from_program(
                model,
                dtype=dtype,
                kv_dtype=kv_dtype,
                threads=threads,
                kernels=kernels,
                quantize=quantize,
                admission=admission,
                prefix_cache_entries=prefix_cache_entries,
                progress=progress,
                **shape,
            )
        _set_threads(threads)
        path = Path(model) if model is not None else default_model_path()
        weight_dtype = resolve_dtype(dtype)
        resolved_kv = weight_dtype if kv_dtype is None else resolve_dtype(kv_dtype)
        resolve_ops(kernels, "cpu")  # refuses "compiled" where the kernels are missing
        backend = ModuleBackend.load(path, weight_dtype, kernels, quantize, progress)
        clock = PhaseClock(progress)
        try:
            tokenizer = load_tokenizer(path)
        except FileNotFoundError:
            tokenizer = None  # token-id prompts still work; text prompts say why not
        clock.done("read the tokenizer" if tokenizer is not None else "found no tokenizer")
        engine = cls(
            backend,
            tokenizer,
            shape=EngineShape(**shape),
            admission=admission,
            prefix_cache_entries=prefix_cache_entries,
            kv_dtype=resolved_kv,
            model_path=path,
        )
        clock.done("started the engine")
        return engine

    @classmethod
    def from_program(
        cls,
        path: str | Path,
        *,
        dtype: str | torch.dtype = "auto",
        kv_dtype: str | torch.dtype | None = None,
        threads: int | None = None,
        kernels: str = "auto",
        quantize: str = "auto",
        admission: str = "optimistic",
        prefix_cache_entries: int = 0,
        progress: LoadProgress | None = None,
        **shape: Any,
    ) -> Engine:
        """Load a program file (`cellbatch export`) and run it with a ProgramExecutor: no
        model code runs, and the tokenizer comes from the program's own files. Its dtypes
        and kernels were fixed at export: options asking for others are refused. The
        step width defaults to the program's widest method."""
        _set_threads(threads)
        backend, tokenizer = ProgramBackend.load(
            Path(path),
            dtype=dtype,
            kv_dtype=kv_dtype,
            kernels=kernels,
            quantize=quantize,
            progress=progress,
        )
        widest = backend.max_step_tokens or DEFAULT_MAX_BATCH_TOKENS
        shape.setdefault("max_batch_tokens", min(DEFAULT_MAX_BATCH_TOKENS, widest))
        clock = PhaseClock(progress)
        engine = cls(
            backend,
            tokenizer,
            shape=EngineShape(**shape),
            admission=admission,
            prefix_cache_entries=prefix_cache_entries,
            kv_dtype=backend.program.kv_dtype,
            model_path=backend.program.path,
        )
        clock.done("started the engine")
        return engine

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
    ) -> list[GenerationResult]:
        """Generate for every prompt at once; results in prompt order.

        Text prompts are tokenized as they are (no chat template: see `chat`);
        token lists are used verbatim. `stop` adds text stop strings (the text ends
        before the stop string). `on_tokens(n)` is called from the engine thread as
        tokens arrive (for progress bars). `share_prefix` feeds the prompts' common
        prefix (when at least MIN_SHARED_PREFIX tokens) once.
        """
        batch = self.generate_async(
            prompts,
            params,
            max_new_tokens=max_new_tokens,
            stop=stop,
            seed=seed,
            on_tokens=on_tokens,
            share_prefix=share_prefix,
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
    ) -> GenerationBatch:
        """`generate` without waiting: the batch can be waited on, cancelled (what
        finished stays finished) and collected."""
        self._require_open()
        base = _gen_config(params, max_new_tokens, seed, stop)
        results = [self._prepare(prompt, base) for prompt in prompts]
        jobs = [(index, result) for index, result in enumerate(results) if result.error == ""]
        root = self._feed_shared_prefix([result for _, result in jobs]) if share_prefix else None
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
                _seeded(base, index),
                progress if on_tokens is not None else None,
                source=root.session if root is not None else None,
                upto=reused,
            )
            batch.track(result, handle)
        if root is not None:
            root.session.close()  # submissions queued before the close still start from it
        return batch

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

    def _prepare(self, prompt: Prompt, config: GenConfig) -> GenerationResult:
        """Tokenizes and checks one prompt; a bad one comes back already failed."""
        if isinstance(prompt, str):
            tokens = self._require_tokenizer("encode text prompts").encode(prompt)
        else:
            tokens = [int(token) for token in prompt]
        result = GenerationResult(prompt=prompt, prompt_tokens=tokens)
        result.error = self._prompt_problem(tokens, config)
        return result

    def _prompt_problem(self, tokens: Sequence[Token], config: GenConfig) -> str:
        """Why the prompt cannot run, or "": emptiness, the vocabulary and the session
        limit (a bad max_new_tokens is the runner's to refuse)."""
        if not tokens:
            return "the prompt is empty: a generation must feed at least one token"
        vocab = self.geometry.vocab_size
        for index, token in enumerate(tokens):
            if not 0 <= token < vocab:
                return (
                    f"token id {token} at index {index} is outside the vocabulary "
                    f"[0, {vocab}); use ids of this model's tokenizer"
                )
        limit = self.shape.max_session_tokens
        needed = len(tokens) + config.max_new_tokens
        if needed > limit:
            return (
                f"the prompt has {len(tokens)} tokens and asks for {config.max_new_tokens} new "
                f"ones ({needed} in all), above the session limit of {limit} tokens; shorten "
                "the prompt, lower max_new_tokens or raise max_session_tokens"
            )
        return ""

    def _feed_shared_prefix(self, results: list[GenerationResult]) -> _SharedPrefix | None:
        """A session fed with the prompts' common prefix, or None when there is none
        worth sharing or the engine cannot spare the session. Each prompt keeps at
        least its last token to feed: its logits give the first new token."""
        if len(results) < 2 or self.shape.max_sessions < 2:
            return None  # with one session, the root would only delay the first prompt
        prompts = [np.asarray(result.prompt_tokens, dtype=np.int64) for result in results]
        common = min(common_prefix_length(prompts[0], prompt) for prompt in prompts[1:])
        length = min(common, min(map(len, prompts)) - 1)
        if length < MIN_SHARED_PREFIX:
            return None
        session = self.runner.open_session_async().result()
        if session is None:
            return None
        handle = session.prefill_async(results[0].prompt_tokens[:length])
        handle.wait()
        if handle.finish_reason() != FinishReason.TOKEN_LIMIT:
            session.close()
            return None
        return _SharedPrefix(session, length)


@dataclass(frozen=True)
class _SharedPrefix:
    session: Session  # idle, holding exactly the first `length` tokens of every prompt
    length: int


def _gen_config(
    params: GenConfig | SamplingParams | None,
    max_new_tokens: int | None,
    seed: int | None,
    stop: Sequence[str],
) -> GenConfig:
    if isinstance(params, GenConfig):
        config = params
    elif isinstance(params, SamplingParams):
        config = GenConfig(sampling=params)
    elif params is None:
        config = GenConfig()
    else:
        raise InvalidArgumentError(
            f"params must be a GenConfig or SamplingParams, got {type(params).__name__}"
        )
    if max_new_tokens is not None:
        config = replace(config, max_new_tokens=max_new_tokens)
    if seed is not None:
        config = replace(config, seed=seed)
    if isinstance(stop, str):
        stop = (stop,)
    return replace(config, stop_strings=(*config.stop_strings, *stop))


def _seeded(config: GenConfig, index: int) -> GenConfig:
    """Prompt `index`'s own seed, so a seeded run does not depend on batching."""
    if config.seed is None:
        return config
    return replace(config, seed=(config.seed + index) % 2**63)


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise InvalidArgumentError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def _resolve_shape(
    shape: EngineShape, geometry: ModelGeometry, kv_dtype: torch.dtype
) -> EngineLimits:
    if shape.max_sessions < 1:
        raise InvalidArgumentError(f"max_sessions must be >= 1, got {shape.max_sessions}")
    if shape.max_batch_tokens < 2:
        raise InvalidArgumentError(
            f"max_batch_tokens must be >= 2 (a decode beside a prompt token), "
            f"got {shape.max_batch_tokens}"
        )
    context = min(geometry.max_positions, MAX_POSITION + 1)
    session_tokens = shape.max_session_tokens or min(context, DEFAULT_MAX_SESSION_TOKENS)
    if session_tokens > context:
        raise InvalidArgumentError(
            f"max_session_tokens={session_tokens} is above the model's context of {context}"
        )
    decodes = shape.max_decode_sequences or min(shape.max_sessions, shape.max_batch_tokens // 2)
    chunk = shape.max_prefill_chunk or shape.max_batch_tokens - decodes
    bytes_per_cell = kv_bytes_per_cell(
        geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, kv_dtype
    )
    cells = shape.max_cells or min(
        shape.max_sessions * session_tokens, DEFAULT_KV_BUDGET_BYTES // bytes_per_cell
    )
    return EngineLimits(
        max_sessions=shape.max_sessions,
        max_batch_tokens=shape.max_batch_tokens,
        max_session_tokens=session_tokens,
        max_decode_sequences=decodes,
        max_prefill_chunk=chunk,
        max_cells=cells,
    )
