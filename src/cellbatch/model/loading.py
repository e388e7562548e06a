"""Weight loading: a Hugging Face folder or a GGUF file -> (ModelConfig, PackedTransformer).

Owns: finding a checkpoint's files (`locate_model`), choosing each weight's format, and
filling the fused layout of `PackedTransformer` (q/k/v concatenated into `qkv`, gate/up
into `gate_up`) from the checkpoint (`cellbatch.model.checkpoints` reads it and maps the
names).
Promises: every parameter of the model comes from the checkpoint, converted to the
requested dtype, or loading fails with one error naming every missing, unexpected and
mis-shaped tensor (expected vs got); GGUF tensors are dequantised to float32 first. With
`quantize`, the projections, LM head and embedding take int8/int4 layouts
(`cellbatch.model.quantized`), converted one tensor at a time from the file's blocks or
floats, never via a float32 model. The files are memory-mapped and read one target at a
time: each is converted and put into the model (built on the meta device) before the next
is read, and the pages of the file it was converted from are handed back
(`machine.FileMappings.release`), so a load holds the model and one tensor's scratch, never
a second copy of the weights; a float tensor taken as it is stays the file's pages. Before
reading, the weights' least size is checked against the memory available (an error with the
numbers and the fix when it cannot fit). With a cache folder
(`cellbatch.model.weights_cache`), a model with quantised modules is written there once
converted and mapped from there on the next start. `load_model` tells a `LoadProgress` what
it did as each phase ends (reading the config, mapping the cache or reading and converting
the weights, writing the cache, preparing the model), with the seconds it took.
Never: downloads anything, initialises weights randomly (the model is built on the meta
device and the loaded tensors are assigned), or keeps the checkpoint open after loading.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cellbatch.machine import FileMappings, read_memory
from cellbatch.model import kquants, quantized, weights_cache, weights_summary
from cellbatch.model.checkpoints import (
    Checkpoint,
    CheckpointMismatchError,
    GGUFCheckpoint,
    HFCheckpoint,
    check_tensors,
)
from cellbatch.model.config import ModelConfig, UnsupportedModelError
from cellbatch.model.device import device_quantize, resolve_device
from cellbatch.model.ops import resolve as resolve_ops
from cellbatch.model.transformer import PackedTransformer, resolve_dtype
from cellbatch.types import InvalidArgumentError

log = logging.getLogger(__name__)


LoadProgress = Callable[[str, float], None]
"""Told, as each phase of a load ends, what it did ("read the weights ...") and its seconds."""


class PhaseClock:
    """Times consecutive phases: `done(what)` reports the seconds since the previous phase
    ended (or since the clock was made) to `progress`, if there is one."""

    def __init__(self, progress: LoadProgress | None) -> None:
        self._progress = progress
        self._since = time.perf_counter()

    def done(self, what: str) -> None:
        now = time.perf_counter()
        if self._progress is not None:
            self._progress(what, now - self._since)
        self._since = now


@dataclass(frozen=True)
class ModelFiles:
    """Where a model lives: kind "hf" (`path` is the folder) or "gguf" (`path` is the file)."""

    kind: str
    path: Path

    @property
    def folder(self) -> Path:
        return self.path if self.kind == "hf" else self.path.parent


def locate_model(path: str | Path) -> ModelFiles:
    """A Hugging Face folder (config.json + *.safetensors), a .gguf file, or a folder
    holding exactly one .gguf file and no config.json."""
    path = Path(path).expanduser()
    usage = "pass a Hugging Face folder (config.json + *.safetensors) or a .gguf file"
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist; {usage}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UnsupportedModelError(f"model file {path} is not a .gguf file; {usage}")
        return ModelFiles("gguf", path)
    if (path / "config.json").is_file():
        return ModelFiles("hf", path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelFiles("gguf", ggufs[0])
    found = f"{len(ggufs)} .gguf files" if ggufs else "neither config.json nor a .gguf file"
    raise FileNotFoundError(f"model folder {path} holds {found}; {usage}")


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    kernels: str = "auto",
    quantize: str = "auto",
    progress: LoadProgress | None = None,
    activations: str = "auto",
    device: str | torch.device = "cpu",
    cache: str | Path | None = None,
) -> tuple[ModelConfig, PackedTransformer]:
    """Loads the model at `path` with weights in `dtype` ("auto", "float32", ...),
    `kernels` ("auto", "compiled", "torch": see PackedTransformer), `quantize` ("auto":
    a GGUF file's precision class, else float; "none"; "int8"; "int4": see
    quantized.target_format) and `activations` for the int4 products ("auto", "float",
    "int8": see quantized.resolve_activations), onto `device` (a CUDA GPU: float weights,
    the torch ops; see cellbatch.model.device). `cache`: the repacked-weights cache's
    folder ("auto": the default one; None: no cache; see weights_cache; on the CPU only,
    whose layouts it holds). `progress` hears of each phase as it ends."""
    target = resolve_device(device)
    quantize = device_quantize(quantized.resolve_quantize(quantize), target)
    quantized.check_activations(activations)
    files = locate_model(path)
    torch_dtype = resolve_dtype(dtype, target)
    clock = PhaseClock(progress)
    if target.type != "cpu":
        resolve_ops(kernels, target)  # refuses "compiled" off the CPU, naming the fix
        kernels = "torch"
        cache = None  # an entry holds the CPU kernels' layouts; a device takes floats
    checkpoint = HFCheckpoint(files.path) if files.kind == "hf" else GGUFCheckpoint(files.path)
    config = checkpoint.config
    model = PackedTransformer(config, dtype=torch_dtype, device="meta", kernels=kernels)
    a8 = quantized.resolve_activations(activations, model.ops.kind, torch_dtype)
    options = {
        "dtype": str(torch_dtype),
        "quantize": quantize,
        "activations": a8,
        "kernels": model.ops.kind,
    }
    folder = weights_cache.cache_directory(cache)
    name = files.path.name
    key = weights_cache.CacheKey.make(name, checkpoint.files, options) if folder else None
    entry = key.entry(folder) if key and folder else None
    clock.done(f"read the config of {name} ({config.architecture}, {config.num_layers} layers)")
    mapped = weights_cache.restore(entry, key, model) if key and entry else None
    if mapped is not None:
        clock.done(f"mapped the repacked weights from {entry} ({_gib(mapped)})")
    else:
        done = _fill(checkpoint, model, quantize, activations, a8)
        clock.done(f"read and converted the weights of {name} ({done})")
        if key and entry and weights_cache.has_quantized_modules(model):
            written = weights_cache.store(entry, key, model)
            if written:
                clock.done(f"wrote the repacked weights to {entry} ({_gib(written)})")
    del checkpoint  # the GGUF reader's parsed metadata, the safetensors handles
    model.reset_rope("cpu")
    model.requires_grad_(False)
    if target.type == "cpu":
        _pack(model)
    else:
        model.to(target)
        model.reset_rope(target)
        clock.done(f"moved the weights to {target}")
    _return_freed_memory()
    kept = weights_summary.describe_kept(model)
    clock.done(f"prepared the model ({model.ops.kind} kernels{'; ' + kept if kept else ''})")
    return config, model.eval()


def _pack(model: PackedTransformer) -> None:
    """Packs and fuses the CPU model's products; the float weights oneDNN reordered into
    copies give their file pages back."""
    before = _spans(model)
    model.pack_linears()
    mappings, after = FileMappings(), _spans(model)
    for address, length in before.items():
        if address not in after:
            mappings.release(address, length)
    model.fuse_layers()


def _spans(model: torch.nn.Module) -> dict[int, int]:
    """Where the model's dense parameters' storages lie: address -> bytes."""
    return {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for p in model.parameters()
        if p.layout == torch.strided and not p.is_mkldnn
    }


def _gib(count: int) -> str:
    return f"{count / 2**30:.2f} GiB"


def _fill(
    checkpoint: Checkpoint,
    model: PackedTransformer,
    quantize: str,
    activations: str,
    a8: str,
) -> str:
    """Puts every checkpoint tensor into `model` (on the meta device), one target at a
    time: read, converted, installed, and the file's pages it came from handed back
    unless the model holds them as they are. `activations` as asked for chooses the
    formats (quantized.target_format), `a8` as resolved is what the products take.
    Returns what it did, in words."""
    config = checkpoint.config
    check_tensors(checkpoint, config)
    formats = _formats(checkpoint, quantize, activations, a8)
    _check_memory(checkpoint, formats, model.dtype)
    mappings = FileMappings()  # the checkpoint's files are mapped by now
    counts: dict[str, int] = {}
    read = 0
    for target, parts in checkpoint.sources.items():
        names = [name for name, _ in parts]
        fmt = formats.get(target)
        if fmt is not None:
            weight = quantized.cat([checkpoint.load_quantized(name, fmt) for name in names])
            if isinstance(weight, kquants.KQuantWeight):
                kquants.install(model, {target: weight})
            else:
                quantized.install(model, {target: weight}, a8)
            kept: set[int] = set()
        else:
            loaded = [checkpoint.load(name).to(model.dtype) for name in names]
            tensor = torch.cat(loaded) if len(loaded) > 1 else loaded[0]
            _assign(model, target, tensor)
            kept = {tensor.untyped_storage().data_ptr()}
        for name in names:
            address, length = checkpoint.span(name)
            read += length
            if address not in kept:
                mappings.release(address, length)
        counts[fmt or "float"] = counts.get(fmt or "float", 0) + 1
    unfilled = [name for name, param in model.named_parameters() if param.is_meta]
    if unfilled:
        raise CheckpointMismatchError(f"internal: no checkpoint tensor filled {unfilled}")
    return f"{_gib(read)} read; " + ", ".join(
        f"{count} {fmt}" for fmt, count in sorted(counts.items())
    )


def _assign(model: PackedTransformer, target: str, tensor: torch.Tensor) -> None:
    """`tensor` as the parameter `target` of `model` (in place of its meta one)."""
    path, _, name = target.rpartition(".")
    module = model.get_submodule(path) if path else model
    setattr(module, name, torch.nn.Parameter(tensor, requires_grad=False))


# Every quantised format cellbatch holds takes at least this many bits per weight.
_LEAST_QUANTIZED_BITS = 4


def _check_memory(checkpoint: Checkpoint, formats: dict[str, str], dtype: torch.dtype) -> None:
    """Refuses, with the numbers and the fix, weights whose least size is more than the
    memory available: float targets at `dtype`'s size, quantised ones at 4 bits a weight."""
    floats = quantised = 0
    for target, parts in checkpoint.sources.items():
        count = sum(math.prod(shape) for _, shape in parts)
        if target in formats:
            quantised += count * _LEAST_QUANTIZED_BITS // 8
        else:
            floats += count * dtype.itemsize
    memory = read_memory()
    if floats + quantised <= memory.available_bytes:
        return
    fixes = ["free memory", "load a smaller model"]
    if floats > quantised:
        if dtype == torch.float32:
            fixes.append("use --dtype bfloat16 (half the bytes)")
        fixes.append("quantise it with --quantize int4 (about a third of bf16's bytes)")
    raise InvalidArgumentError(
        f"the weights of {checkpoint.path.name} need at least {_gib(floats + quantised)} of "
        f"memory ({_gib(floats)} {str(dtype).removeprefix('torch.')}, {_gib(quantised)} "
        f"quantised), but {_gib(memory.available_bytes)} of {_gib(memory.total_bytes)} is "
        f"available; " + ", or ".join(fixes)
    )


def _return_freed_memory() -> None:
    """Hands the scratch memory of loading (the GGUF reader's metadata, float tensors,
    conversion buffers) back to the OS; glibc keeps freed heap pages otherwise."""
    gc.collect()  # the reader's objects may sit in reference cycles
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return  # not glibc: nothing to do
    trim(0)


def _formats(checkpoint: Checkpoint, quantize: str, activations: str, a8: str) -> dict[str, str]:
    """Each quantisable weight's format (quantized.target_format); one note names the GGUF
    kinds that "auto" had to load as float."""
    roles = {"embed.weight": "embedding", "lm_head.weight": "lm_head"}
    formats, unkept = {}, set()
    for target, parts in checkpoint.sources.items():
        role = roles.get(target, "projection")
        if target not in roles and not re.search(r"\.(qkv|o_proj|gate_up|down)\.weight$", target):
            continue
        kinds = checkpoint.kinds([name for name, _ in parts])
        formats[target] = quantized.target_format(quantize, role, kinds, activations, a8)
        if quantize == "auto" and formats[target] == "none" and kinds is not None:
            unkept |= set(kinds) - quantized.GGUF_FLOAT_KINDS
    if unkept:
        log.warning(
            "note: %s tensors cannot stay quantised; they load dequantised to float",
            ", ".join(sorted(unkept)),
        )
    return {target: fmt for target, fmt in formats.items() if fmt != "none"}
