"""Engine: a model (or an exported program), its tokenizer, an executor, a scheduler and a
Runner in one.

Owns: the loaded model and tokenizer, and the Runner driving them.
Promises: `generate` / `chat` take many prompts at once and return one result per
prompt, in order; a bad prompt (empty, a token outside the vocabulary, too long for
the session) fails alone with a message naming the numbers, and the others run.
Every prompt is submitted to the Runner, which queues what does not fit yet (the
Runner owns every queue). Seeds are derived per prompt, so a seeded result does not
depend on what else shares the batch. A prefix common to all the prompts of a call
(a chat template's system prompt, say) is fed once and its cells shared; results are
the same tokens as without the sharing. Sessions and submissions default to the
model's stop tokens. After `close()`, every call says the engine is closed.
Never: touches the engine thread's state directly; everything goes through the
Runner's faces.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import torch

from cellbatch.cache import kv_bytes_per_cell
from cellbatch.executor.module_executor import ExecutorShape, ModuleExecutor
from cellbatch.executor.program_executor import ProgramExecutor
from cellbatch.export import is_program
from cellbatch.export.program import Program, load_program, read_tokenizer
from cellbatch.metrics import EngineMetrics, GenerationMetrics
from cellbatch.model.default import default_model_path
from cellbatch.model.loading import LoadProgress, PhaseClock, load_model
from cellbatch.model.ops import resolve as resolve_ops
from cellbatch.model.quantized import WeightsSummary, resolve_quantize
from cellbatch.model.quantized import describe as describe_weights
from cellbatch.model.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_files
from cellbatch.model.transformer import DTYPES, resolve_dtype
from cellbatch.runner import AdmissionPolicy, GenerationHandle, Runner, Session
from cellbatch.runner.snapshots import common_prefix_length
from cellbatch.scheduler import DecodeFirstScheduler
from cellbatch.threads import in_short_lived_thread
from cellbatch.types import (
    MAX_POSITION,
    FinishReason,
    GenConfig,
    GenerationUpdate,
    InvalidArgumentError,
    KVUsage,
    SamplingParams,
    Token,
)

Prompt = str | Sequence[Token]
Message = Mapping[str, str]

# Bounds the KV pool by default: cells past this many bytes are never allocated.
DEFAULT_KV_BUDGET_BYTES = 4 * 2**30
DEFAULT_MAX_SESSIONS = 64
DEFAULT_MAX_BATCH_TOKENS = 544
DEFAULT_MAX_SESSION_TOKENS = 8192
# Shorter common prefixes are fed by every prompt: the extra turn would cost more than
# it saves.
MIN_SHARED_PREFIX = 16


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


@dataclass(frozen=True)
class EngineShape:
    """The engine's limits; None means "derive from the model and the others"."""

    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_session_tokens: int | None = None
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_decode_sequences: int | None = None
    max_prefill_chunk: int | None = None
    max_cells: int | None = None


class Engine:
    """Batched generation with one model: `Engine.from_pretrained(path).generate(prompts)`."""

    def __init__(
        self,
        model: torch.nn.Module | Program,
        config: Any,
        tokenizer: Tokenizer | None,
        *,
        shape: EngineShape = EngineShape(),
        kv_dtype: torch.dtype = torch.float32,
        model_path: Path | None = None,
        admission: str | AdmissionPolicy = AdmissionPolicy.OPTIMISTIC,
        prefix_cache_entries: int = 0,
    ) -> None:
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.model_path = model_path
        # The activations' dtype: quantised weights have integer parameters.
        self.dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
        self.kv_dtype = kv_dtype
        # A program runs the compiled kernels it carries.
        self.kernels = "compiled" if isinstance(model, Program) else model.ops.kind
        self.stop_tokens = frozenset(
            tokenizer.stop_tokens if tokenizer is not None else config.eos_token_ids
        )
        self.shape = _resolve_shape(shape, config, kv_dtype)
        executor_shape = ExecutorShape(
            max_sessions=self.shape.max_sessions,
            max_session_tokens=self.shape.max_session_tokens,
            max_cells=self.shape.max_cells,
            max_batch_tokens=self.shape.max_batch_tokens,
            kv_dtype=kv_dtype,
        )
        # "program": an exported program's methods; "module": the torch module itself.
        self.executor_kind = "program" if isinstance(model, Program) else "module"
        self.executor = (
            ProgramExecutor(model, executor_shape)
            if isinstance(model, Program)
            else ModuleExecutor(model, config, executor_shape)
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
        if threads is not None:
            if threads < 1:
                raise InvalidArgumentError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        path = Path(model) if model is not None else default_model_path()
        weight_dtype = resolve_dtype(dtype)
        resolved_kv = weight_dtype if kv_dtype is None else resolve_dtype(kv_dtype)
        resolve_ops(kernels, "cpu")  # refuses "compiled" where the kernels are missing
        config, module = in_short_lived_thread(
            lambda: load_model(path, weight_dtype, kernels, quantize, progress)
        )
        clock = PhaseClock(progress)
        try:
            tokenizer = load_tokenizer(path)
        except FileNotFoundError:
            tokenizer = None  # token-id prompts still work; text prompts say why not
        clock.done("read the tokenizer" if tokenizer is not None else "found no tokenizer")
        engine = cls(
            module,
            config,
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
        if threads is not None:
            if threads < 1:
                raise InvalidArgumentError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        asked = {
            name: None if value in (None, "auto") else resolve_dtype(value)
            for name, value in (("dtype", dtype), ("kv_dtype", kv_dtype))
        }
        if kernels == "torch":
            raise InvalidArgumentError(
                f"program {path} runs its own compiled kernels; kernels apply to models, "
                "not programs"
            )
        clock = PhaseClock(progress)
        # The tokenizer (transformers' import, mostly) is built while the methods load.
        files, stop_tokens = read_tokenizer(path)
        with ThreadPoolExecutor(1, thread_name_prefix="cellbatch-tokenizer") as pool:
            pending = pool.submit(tokenizer_from_files, files, stop_tokens) if files else None
            program = in_short_lived_thread(lambda: load_program(path))
            clock.done(f"loaded the program ({len(program.methods)} methods)")
            tokenizer = pending.result() if pending is not None else None
        clock.done("read the tokenizer" if tokenizer is not None else "found no tokenizer")
        manifest = program.manifest
        exported_as = program_weights(program).formats["projections"]
        if quantize != "auto" and quantize != ("none" if exported_as in DTYPES else exported_as):
            raise InvalidArgumentError(
                f"program {path} holds {exported_as} weights (quantize is fixed at export); "
                "drop quantize or export the model again with `cellbatch export --quantize`"
            )
        for name, has in (("dtype", program.dtype), ("kv_dtype", program.kv_dtype)):
            if asked[name] is not None and asked[name] != has:
                raise InvalidArgumentError(
                    f"program {path} runs in {str(has).removeprefix('torch.')} ({name} is fixed "
                    f"at export); drop {name} or export the model again with the one you want"
                )
        shape.setdefault(
            "max_batch_tokens", min(DEFAULT_MAX_BATCH_TOKENS, manifest.max_step_tokens)
        )
        engine = cls(
            program,
            manifest.model,
            tokenizer,
            shape=EngineShape(**shape),
            admission=admission,
            prefix_cache_entries=prefix_cache_entries,
            kv_dtype=program.kv_dtype,
            model_path=program.path,
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
    def weights_bytes(self) -> int:
        if isinstance(self.model, Program):
            return self.model.weights_bytes
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def weights(self) -> WeightsSummary:
        """Which weight format ran: in words, per role, the quantised products' kernel,
        and bytes per format."""
        if isinstance(self.model, Program):
            return program_weights(self.model)
        return describe_weights(self.model)

    @property
    def weight_format(self) -> str:
        """The weight format in words, e.g. "int4, embedding int8, lm_head int8"."""
        return self.weights.format

    def kv_usage(self) -> dict[str, int]:
        """Cells in use, the cell limit, pool rows, allocated bytes, growth count and
        bytes per cell, as of the engine's last step."""
        usage = self.runner.kv_usage() or KVUsage(0, self.shape.max_cells, self.shape.max_cells)
        return {
            "cells_in_use": usage.cells_in_use,
            "max_cells": usage.max_cells,
            "pool_rows": usage.pool_rows,
            "allocated_bytes": usage.allocated_bytes,
            "growth_count": usage.growth_count,
            "bytes_per_cell": usage.bytes_per_cell,
        }

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

    def _require_tokenizer(self, why: str):
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
        vocab = self.config.vocab_size
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


def program_weights(program: Program) -> WeightsSummary:
    """What a program's weights are, from its manifest (one written before the manifest
    said holds float weights of its dtype)."""
    manifest = program.manifest
    if manifest.weight_formats:
        return WeightsSummary(
            manifest.weights_format,
            dict(manifest.weight_formats),
            manifest.weight_kernel,
            dict(manifest.weight_bytes_by_format),
        )
    dtype = manifest.dtype
    roles = dict.fromkeys(("projections", "embedding", "lm_head"), dtype)
    return WeightsSummary(dtype, roles, "none", {dtype: program.weights_bytes})


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


def _resolve_shape(shape: EngineShape, config: Any, kv_dtype: torch.dtype) -> EngineShape:
    if shape.max_sessions < 1:
        raise InvalidArgumentError(f"max_sessions must be >= 1, got {shape.max_sessions}")
    if shape.max_batch_tokens < 2:
        raise InvalidArgumentError(
            f"max_batch_tokens must be >= 2 (a decode beside a prompt token), "
            f"got {shape.max_batch_tokens}"
        )
    context = min(config.max_position_embeddings, MAX_POSITION + 1)
    session_tokens = shape.max_session_tokens or min(context, DEFAULT_MAX_SESSION_TOKENS)
    if session_tokens > context:
        raise InvalidArgumentError(
            f"max_session_tokens={session_tokens} is above the model's context of {context}"
        )
    decodes = shape.max_decode_sequences or min(shape.max_sessions, shape.max_batch_tokens // 2)
    chunk = shape.max_prefill_chunk or shape.max_batch_tokens - decodes
    bytes_per_cell = kv_bytes_per_cell(
        config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype
    )
    cells = shape.max_cells or min(
        shape.max_sessions * session_tokens, DEFAULT_KV_BUDGET_BYTES // bytes_per_cell
    )
    return replace(
        shape,
        max_session_tokens=session_tokens,
        max_decode_sequences=decodes,
        max_prefill_chunk=chunk,
        max_cells=cells,
    )
