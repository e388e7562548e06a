"""Loading what an Engine runs from files: the work of `Engine.from_pretrained` and
`Engine.from_program` before the engine exists (docs/design.md#engine).

Owns: `LoadOptions` (the load's options, as `from_pretrained` takes them), their checks,
the placement of the threads (`place_threads`), the loading of the backend, tokenizer,
LoRA adapters and draft model into a `LoadedModel`, and `machine_kv_memory`, what the
machine leaves the KV pool.
Promises: every option is checked before anything loads (a bad value is an
InvalidArgumentError naming it and the fix); the threads are placed before the weights
load, so that the loading and engine threads inherit their count and CPUs; a program
file loads through `load_program` (its dtypes and kernels fixed at export) and runs on
the CPU only; every phase of a load is reported to the `progress` callback as it ends.
Never: builds the executor, scheduler or runner (the Engine does), or runs a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cellbatch.engine.adapter_options import check_lora_options
from cellbatch.engine.backend import ModelBackend, ModuleBackend, ProgramBackend
from cellbatch.engine.drafters import load_draft
from cellbatch.engine.limits import DEFAULT_MAX_BATCH_TOKENS, EngineShape, KVMemory
from cellbatch.executor.cuda_executor import CudaOptions
from cellbatch.export import is_program
from cellbatch.kv_format import KV_INT8
from cellbatch.machine import (
    Placement,
    apply_placement,
    plan_placement,
    preset_thread_count,
    read_memory,
    read_topology,
)
from cellbatch.model.default import default_model_path
from cellbatch.model.device import device_quantize, resolve_device
from cellbatch.model.loading import LoadProgress, PhaseClock
from cellbatch.model.ops import resolve as resolve_ops
from cellbatch.model.quantized import check_activations, resolve_quantize
from cellbatch.model.tokenizer import Tokenizer, load_tokenizer
from cellbatch.model.transformer import resolve_dtype, resolve_kv_dtype
from cellbatch.model.weights_cache import cache_directory
from cellbatch.speculative import SpeculativeConfig, parse_speculative_config
from cellbatch.threads import in_short_lived_thread
from cellbatch.types import DEFAULT_MAX_LORAS, InvalidArgumentError


@dataclass(frozen=True)
class LoadOptions:
    """How `Engine.from_pretrained` loads a model: its keyword options.

    Attributes:
        dtype: the weights' and activations' float type: "auto" (bf16 on CPUs with native
            bf16 matrix units, AVX512-BF16 or AMX, and on GPUs; else float32), or
            "float32", "bfloat16", "float16" or a torch dtype.
        kv_dtype: the KV cache's type; default the weights' dtype. "int8" quantises K/V
            per cell and head, about half bf16's bytes (cellbatch.kv_format).
        threads: torch's thread count; default one per physical core (a count the
            process set already is kept).
        kernels: "auto" (the compiled CPU kernels where they build, else pure torch),
            "compiled" or "torch".
        quantize: "auto" (a GGUF file keeps its precision class: Q4_0, Q4_1 and K-quant
            blocks as they are, Q8_0 as int8; other models stay float), "none", "int8"
            or "int4" (cellbatch.model.quantized).
        activations: what the int4 products do with their inputs: "auto" (int8 for some
            products where the kernels have a vector int8 path, AVX512-VNNI or AVX2, and
            the model runs in the dtype `auto` picks, else float), "float" (the model's
            dtype) or "int8" (quantised per group of 32: quantized.resolve_activations).
        progress: hears of each phase of the load as it ends (what it did, its seconds).
        device: "auto" (a CUDA GPU when torch sees one, else the CPU), "cpu", "cuda" or
            "cuda:N". On a GPU the weights are float (bf16 by default: `quantize` "auto"
            means float there) and a CudaExecutor runs them.
        cuda_graph: on a GPU, one captured graph per decode width, replayed (off: eager,
            vLLM's --enforce-eager).
        weight_sharing: on a GPU, one copy of the weights for every method and graph.
        numa: "auto" binds the threads to one NUMA node where the machine has several,
            "off" never, or a node number (cellbatch.machine).
        weights_cache: where weights converted at load (a GGUF file's blocks, `quantize`)
            are kept for the next start to map instead of converting ("auto":
            CELLBATCH_CACHE_DIR or ~/.cache/cellbatch; a folder; None: no cache; the CPU
            only; cellbatch.model.weights_cache).
        speculative: a `SpeculativeConfig`, or vLLM's JSON object or text for one, turns
            on speculative decoding: prompt lookup, or a draft model loaded with the same
            options. The tokens stay the same (a generation's LoRA adapter runs in the
            verifying rows; the draft model drafts without it).
        lora_adapters: names mapped to PEFT LoRA adapter folders, served from the start
            (`Engine.load_adapter`; the CPU only).
        max_loras: the most adapters loaded at once.
    """

    dtype: str | torch.dtype = "auto"
    kv_dtype: str | torch.dtype | None = None
    threads: int | None = None
    kernels: str = "auto"
    quantize: str = "auto"
    activations: str = "auto"
    progress: LoadProgress | None = None
    device: str | torch.device = "auto"
    cuda_graph: bool = True
    weight_sharing: bool = True
    numa: str | int = "auto"
    weights_cache: str | Path | None = "auto"
    speculative: SpeculativeConfig | str | Mapping[str, object] | None = None
    lora_adapters: Mapping[str, str | Path] | None = None
    max_loras: int = DEFAULT_MAX_LORAS


@dataclass(frozen=True)
class LoadedModel:
    """What an Engine is built from (its constructor's arguments), and where its threads
    were placed."""

    backend: ModelBackend
    tokenizer: Tokenizer | None
    shape: EngineShape
    kv_dtype: torch.dtype
    model_path: Path
    speculative: SpeculativeConfig | None
    draft: ModelBackend | None
    placement: Placement


def load_model(
    model: str | Path | None, options: LoadOptions, shape: dict[str, Any]
) -> LoadedModel:
    """A Hugging Face folder, a GGUF file (None: the embedded default model) or a program
    file, loaded as `options` say; `shape` holds EngineShape's fields."""
    resolve_quantize(options.quantize)  # a bad value fails before anything loads
    check_activations(options.activations)
    cache_directory(options.weights_cache)
    speculative = parse_speculative_config(options.speculative)
    for name in ("cuda_graph", "weight_sharing"):
        if not isinstance(getattr(options, name), bool):
            raise InvalidArgumentError(
                f"{name} must be True or False, got {getattr(options, name)!r}"
            )
    is_program_file = model is not None and is_program(model)
    device = options.device
    target = resolve_device("cpu" if is_program_file and device == "auto" else device)
    if is_program_file and target.type != "cpu":
        raise InvalidArgumentError(
            f"program {model} runs on the CPU (its methods are compiled for it); load "
            "the model folder or GGUF file to run on a GPU, or pass device 'cpu'"
        )
    quantize = device_quantize(options.quantize, target)
    adapters = check_lora_options(options.lora_adapters, options.max_loras, is_program_file, target)
    if model is not None and is_program_file:
        return load_program(Path(model), options, shape, quantize=quantize)
    progress = options.progress
    clock = PhaseClock(progress)
    placement = place_threads(options.threads, options.numa)
    clock.done(f"placed the threads: {placement.reason}")
    path = Path(model) if model is not None else default_model_path()
    weight_dtype = resolve_dtype(options.dtype, target)
    kv_dtype = resolve_kv_dtype(options.kv_dtype, weight_dtype, target)
    if kv_dtype == KV_INT8 and target.type != "cpu":
        raise InvalidArgumentError(
            f"the int8 KV cache runs on the CPU only (its attention is the CPU's); on "
            f"{target} leave kv_dtype out or give a float dtype"
        )
    resolve_ops(options.kernels, target)  # refuses "compiled" where the kernels are missing
    backend = ModuleBackend.load(
        path,
        weight_dtype,
        options.kernels,
        quantize,
        progress,
        options.activations,
        target,
        CudaOptions(cuda_graph=options.cuda_graph, weight_sharing=options.weight_sharing),
        options.weights_cache,
        options.max_loras,
    )
    clock = PhaseClock(progress)
    bank = backend.adapters
    for name, folder in adapters.items():
        assert bank is not None  # a bank on the CPU; check_lora_options refused the rest
        in_short_lived_thread(lambda: bank.load(name, folder))  # noqa: B023
    if adapters:
        clock.done(f"loaded {len(adapters)} LoRA adapter(s)")
    try:
        tokenizer = load_tokenizer(path)
    except FileNotFoundError:
        tokenizer = None  # token-id prompts still work; text prompts say why not
    clock.done("read the tokenizer" if tokenizer is not None else "found no tokenizer")
    draft = load_draft(
        speculative,
        backend,
        options.kernels,
        quantize,
        options.activations,
        progress,
        options.weights_cache,
    )
    return LoadedModel(
        backend, tokenizer, EngineShape(**shape), kv_dtype, path, speculative, draft, placement
    )


def load_program(
    path: Path, options: LoadOptions, shape: dict[str, Any], quantize: str | None = None
) -> LoadedModel:
    """A program file (`cellbatch export`), run by a ProgramExecutor: no model code runs,
    the tokenizer comes from the program's own files, dtypes and kernels asked for must
    be the ones it was exported with, and the step width defaults to its widest method."""
    placement = place_threads(options.threads, options.numa)
    backend, tokenizer = ProgramBackend.load(
        path,
        dtype=options.dtype,
        kv_dtype=options.kv_dtype,
        kernels=options.kernels,
        quantize=options.quantize if quantize is None else quantize,
        progress=options.progress,
        activations=options.activations,
    )
    widest = backend.max_step_tokens or DEFAULT_MAX_BATCH_TOKENS
    shape = {"max_batch_tokens": min(DEFAULT_MAX_BATCH_TOKENS, widest), **shape}
    speculative = parse_speculative_config(options.speculative)
    draft = load_draft(speculative, backend, "auto", "auto", "auto", options.progress)
    return LoadedModel(
        backend,
        tokenizer,
        EngineShape(**shape),
        backend.program.kv_dtype,
        backend.program.path,
        speculative,
        draft,
        placement,
    )


def place_threads(threads: int | None, numa: str | int) -> Placement:
    """Sets the threads' count and CPUs (cellbatch.machine) before anything loads, so that
    the loading and engine threads inherit them."""
    topology = read_topology()
    preset = preset_thread_count(len(topology.cpus), torch.get_num_threads())
    placement = plan_placement(topology, threads, numa, preset)
    apply_placement(placement)
    return placement


def machine_kv_memory(backend: ModelBackend, draft: ModelBackend | None = None) -> KVMemory:
    """What the KV pool may take on this machine now: the memory available, less the
    weights a file mapping holds, the model's and a draft model's (counted as available,
    but needed); on a GPU, its free memory with the weights on it (the pool lives there)."""
    if backend.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(backend.device)
        return KVMemory(free, total)
    memory = read_memory()
    mapped = backend.mapped_weights_bytes + (0 if draft is None else draft.mapped_weights_bytes)
    return KVMemory(memory.available_bytes - mapped, memory.total_bytes)
