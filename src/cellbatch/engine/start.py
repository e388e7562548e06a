"""How an Engine starts: its parts built over a backend, or the backend loaded from
files first (docs/design.md#engine).

Owns: `EngineStart`, the construction the Engine inherits: the limits resolved against
the memory, then the constraint compiler, executor, scheduler and Runner built over a
backend and its tokenizer (`__init__`), and `from_pretrained` / `from_program`, which
hand their options to `cellbatch.engine.loader` and build the engine over what it
loaded, with the threads where it placed them.
Promises: every option is checked before anything loads (the loader's checks); the
limits are resolved once, before the KV pool exists; starting the engine is the last
phase reported to `progress`.
Never: runs a generation, or touches the engine thread's state (the calls on a started
engine are `Engine`'s, in `engine.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from typing_extensions import Self

from cellbatch.constraint import ConstraintCompiler
from cellbatch.engine.adapter_options import NoAdapters
from cellbatch.engine.backend import ModelBackend
from cellbatch.engine.drafters import draft_bytes_per_cell, load_draft, make_drafter
from cellbatch.engine.limits import EngineShape, KVMemory, resolve_limits
from cellbatch.engine.loader import (
    LoadedModel,
    LoadOptions,
    load_model,
    load_program,
    machine_kv_memory,
)
from cellbatch.executor.cell_executor import ExecutorShape
from cellbatch.machine import Placement
from cellbatch.model.loading import LoadProgress, PhaseClock
from cellbatch.model.tokenizer import Tokenizer
from cellbatch.runner import AdmissionPolicy, Runner
from cellbatch.scheduler import DecodeFirstScheduler
from cellbatch.speculative import SpeculativeConfig, parse_speculative_config
from cellbatch.types import DEFAULT_MAX_LORAS


class EngineStart:
    """The Engine's construction: `Engine(backend, tokenizer)`, `Engine.from_pretrained`
    and `Engine.from_program` (see `cellbatch.engine.Engine`)."""

    def __init__(
        self,
        backend: ModelBackend,
        tokenizer: Tokenizer | None,
        *,
        shape: EngineShape | None = None,
        kv_dtype: torch.dtype | None = None,
        model_path: Path | None = None,
        admission: str | AdmissionPolicy = AdmissionPolicy.OPTIMISTIC,
        prefix_cache_entries: int = 0,
        memory: KVMemory | None = None,
        speculative: SpeculativeConfig | str | Mapping[str, object] | None = None,
        draft: ModelBackend | None = None,
    ) -> None:
        """`memory`: what the KV pool may take (default: the machine's available memory
        now, see engine.limits)."""
        self.speculative = parse_speculative_config(speculative)
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.kv_dtype = backend.dtype if kv_dtype is None else kv_dtype
        self.stop_tokens = frozenset(
            tokenizer.stop_tokens if tokenizer is not None else backend.geometry.eos_token_ids
        )
        if draft is None:
            draft = load_draft(self.speculative, backend, "auto", "auto", "auto", None)
        self.shape = resolve_limits(
            shape or EngineShape(),
            backend.geometry,
            self.kv_dtype,
            memory if memory is not None else machine_kv_memory(backend, draft),
            draft_bytes_per_cell(draft),
        )
        # Where its threads run, when this engine placed them (from_pretrained does).
        self.placement: Placement | None = None
        # Constraints need the vocabulary's text: without a tokenizer they are refused.
        self.constraints = ConstraintCompiler.for_tokenizer(
            tokenizer, backend.geometry.vocab_size, self.stop_tokens
        )
        executor_shape = ExecutorShape(
            max_sessions=self.shape.max_sessions,
            max_session_tokens=self.shape.max_session_tokens,
            max_cells=self.shape.max_cells,
            max_batch_tokens=self.shape.max_batch_tokens,
            kv_dtype=self.kv_dtype,
            max_decode_sequences=self.shape.max_decode_sequences,
        )
        self.executor = backend.executor(
            executor_shape,
            self.constraints,
            make_drafter(self.speculative, backend, executor_shape, draft),
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
            speculative=self.speculative,
            adapters=(
                backend.adapters
                if backend.adapters is not None
                else NoAdapters(backend.adapters_refusal)
            ),
        )
        self._closed = False  # until `Engine.close`

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
        activations: str = "auto",
        admission: str = "optimistic",
        prefix_cache_entries: int = 0,
        progress: LoadProgress | None = None,
        device: str | torch.device = "auto",
        cuda_graph: bool = True,
        weight_sharing: bool = True,
        numa: str | int = "auto",
        weights_cache: str | Path | None = "auto",
        speculative: SpeculativeConfig | str | Mapping[str, object] | None = None,
        lora_adapters: Mapping[str, str | Path] | None = None,
        max_loras: int = DEFAULT_MAX_LORAS,
        **shape: Any,
    ) -> Self:
        """Load a Hugging Face folder, a GGUF file (default: the embedded
        SmolLM2-135M-Instruct) or a program file (`.pt2`, from `cellbatch export`: see
        `from_program`). The keyword options are `LoadOptions`' fields, each described
        there, plus `admission` and `prefix_cache_entries` (as the constructor takes them);
        `shape` takes EngineShape's fields. The options are checked before anything
        loads."""
        options = LoadOptions(
            dtype=dtype,
            kv_dtype=kv_dtype,
            threads=threads,
            kernels=kernels,
            quantize=quantize,
            activations=activations,
            progress=progress,
            device=device,
            cuda_graph=cuda_graph,
            weight_sharing=weight_sharing,
            numa=numa,
            weights_cache=weights_cache,
            speculative=speculative,
            lora_adapters=lora_adapters,
            max_loras=max_loras,
        )
        return cls._start(
            load_model(model, options, shape), admission, prefix_cache_entries, progress
        )

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
        activations: str = "auto",
        admission: str = "optimistic",
        prefix_cache_entries: int = 0,
        progress: LoadProgress | None = None,
        numa: str | int = "auto",
        speculative: SpeculativeConfig | str | Mapping[str, object] | None = None,
        **shape: Any,
    ) -> Self:
        """Load a program file (`cellbatch export`) and run it with a ProgramExecutor: no
        model code runs, and the tokenizer comes from the program's own files. Its dtypes
        and kernels were fixed at export: options asking for others are refused. The
        step width defaults to the program's widest method."""
        options = LoadOptions(
            dtype=dtype,
            kv_dtype=kv_dtype,
            threads=threads,
            kernels=kernels,
            quantize=quantize,
            activations=activations,
            progress=progress,
            numa=numa,
            speculative=speculative,
        )
        loaded = load_program(Path(path), options, shape)
        return cls._start(loaded, admission, prefix_cache_entries, progress)

    @classmethod
    def _start(
        cls,
        loaded: LoadedModel,
        admission: str,
        prefix_cache_entries: int,
        progress: LoadProgress | None,
    ) -> Self:
        clock = PhaseClock(progress)
        engine = cls(
            loaded.backend,
            loaded.tokenizer,
            shape=loaded.shape,
            admission=admission,
            prefix_cache_entries=prefix_cache_entries,
            kv_dtype=loaded.kv_dtype,
            model_path=loaded.model_path,
            speculative=loaded.speculative,
            draft=loaded.draft,
        )
        engine.placement = loaded.placement
        clock.done("started the engine")
        return engine
