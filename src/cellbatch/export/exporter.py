"""Model -> program file: `export_program`, what `cellbatch export` runs
(docs/design.md#programs-and-export).

Owns: tracing the packed-step transformer with `torch.export` into its methods (`prefill`:
a dynamic token count from `min_prefill_tokens`; `decode_<W>`: one static width W each),
compiling each with AOTInductor (constants left out of the compiled code), and gathering
what the program file holds: the weights once, the manifest, the tokenizer's files and
the compiled library of the model's custom ops.
Promises: every method takes the inputs of `manifest.METHOD_INPUTS` plus the KV pool's
per-layer K and V tensors, which it updates in place (the pool stays outside the program,
in the cell layout), and returns float32 logits for `logit_rows` only. The methods call
the model's own ops (the compiled kernels, through `torch.library`) and products, so a
program computes what the eager model computes. Weights the eager model keeps reordered
for oneDNN are stored plain and marked `packed`: the runtime reorders them once, for its
own CPU. `min_prefill_tokens` in the manifest is what the prefill method accepts (at
least 2: torch.export specialises sizes 0 and 1). Progress goes to `progress`, with the
time each method took.
Never: pickles Python objects, or writes a partial program file (see `archive`).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from cellbatch.cache import FlatAttentionPlan
from cellbatch.export.archive import PROGRAM_SUFFIX, write_program
from cellbatch.export.manifest import (
    DECODE,
    FORMAT_VERSION,
    LOGITS_MODE,
    METHOD_INPUTS,
    PREFILL,
    ConstantSpec,
    Manifest,
    MethodSpec,
)
from cellbatch.export.program import method_metadata
from cellbatch.kv_format import head_width
from cellbatch.model import kernels
from cellbatch.model.attention import QUERY_BLOCK
from cellbatch.model.config import ModelConfig
from cellbatch.model.default import default_model_path
from cellbatch.model.loading import load_model, locate_model
from cellbatch.model.tokenizer import load_tokenizer
from cellbatch.model.transformer import PackedTransformer, resolve_dtype, resolve_kv_dtype
from cellbatch.model.weights_summary import describe as describe_weights
from cellbatch.types import InvalidArgumentError

if TYPE_CHECKING:  # typeshed's name for "bytes-like", known to type checkers only
    from typing_extensions import Buffer

KERNEL_LIBRARY = "data/cellbatch/kernels.so"
# The most KV pool rows a method takes (cells + the scratch row): far above any pool
# this machine could hold, low enough for 64-bit index arithmetic everywhere.
MAX_POOL_ROWS = 1 << 40
_TOKENIZER_SUFFIXES = (".json", ".jinja", ".txt")


@dataclass(frozen=True)
class ExportOptions:
    """What `cellbatch export` asks for (see its --help)."""

    dtype: str = "auto"
    kv_dtype: str | None = None  # None: the weight dtype
    quantize: str = "auto"  # as the eager model's (cellbatch.model.quantized.target_format)
    activations: str = "auto"  # as the eager model's (quantized.resolve_activations)
    max_step_tokens: int = 544
    decode_widths: tuple[int, ...] = (1,)
    min_prefill_tokens: int = 2
    threads: int | None = None


class ProgramForward(nn.Module):
    """The model as one method sees it: tensors in, logits out (`METHOD_INPUTS`)."""

    def __init__(self, model: PackedTransformer) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cells: torch.Tensor,
        attention_cells: torch.Tensor,
        attention_rows: torch.Tensor,
        attention_positions: torch.Tensor,
        attention_cell_offsets: torch.Tensor,
        attention_block_starts: torch.Tensor,
        logit_rows: torch.Tensor,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
    ) -> torch.Tensor:
        attention = FlatAttentionPlan(
            attention_cells,
            attention_rows,
            attention_positions,
            attention_cell_offsets,
            attention_block_starts,
            tokens.shape[0],
        )
        return self.model.forward_flat(tokens, positions, cells, attention, k, v, logit_rows)


def export_program(
    model: str | Path | None,
    output: str | Path,
    options: ExportOptions = ExportOptions(),
    progress: Callable[[str], None] = lambda message: None,
) -> Manifest:
    """Writes the program of the model at `model` (default: the embedded SmolLM2) to
    `output` (a `.pt2` file) and returns its manifest."""
    output = Path(output)
    if output.suffix != PROGRAM_SUFFIX:
        raise InvalidArgumentError(f"the program file must end in {PROGRAM_SUFFIX}: {output}")
    if not output.parent.is_dir():
        raise InvalidArgumentError(f"cannot write {output}: {output.parent} is not a folder")
    path = Path(model) if model is not None else default_model_path()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    if not kernels.load():
        raise InvalidArgumentError(
            "export needs the compiled kernels, which a program calls "
            f"({kernels.unavailable_reason()})"
        )
    started = time.perf_counter()
    dtype = resolve_dtype(options.dtype)
    kv_dtype = resolve_kv_dtype(options.kv_dtype, dtype)
    progress(f"loading {path} in {str(dtype).removeprefix('torch.')}")
    config, module = load_model(
        path, dtype, "compiled", quantize=options.quantize, activations=options.activations
    )
    # The program traces each layer's own steps: AOTInductor calls each op directly, so
    # the one-op layer (decoder_layer) would save nothing there.
    module.fuse_layers(False)
    methods = _method_specs(options, module.min_rows)
    weights = describe_weights(module)
    progress(f"loaded in {time.perf_counter() - started:.1f} s (weights {weights.format})")
    forward = ProgramForward(module).eval()
    num_inputs = len(METHOD_INPUTS) + 2 * config.num_layers
    files: dict[str, list[str]] = {}
    seconds: dict[str, float] = {}
    custom_ops: dict[str, str] = {}
    c_shims: dict[torch._ops.OpOverload, str] = {}
    for index, spec in enumerate(methods, 1):
        began = time.perf_counter()
        progress(
            f"[{index}/{len(methods)}] {spec.name} ({spec.kind}, "
            f"{_tokens(spec)}): tracing with torch.export"
        )
        exported = _export(forward, spec, options.max_step_tokens, kv_dtype)
        called = _custom_ops(exported)
        custom_ops.update({str(op._schema.name): str(op._schema) for op in called})
        c_shims.update({op: _c_shim(op) for op in called if _has_c_shim(op)})
        progress(f"[{index}/{len(methods)}] {spec.name}: compiling with AOTInductor")
        files[spec.name] = _compile(
            exported,
            method_metadata(spec, num_inputs, FORMAT_VERSION),
            options.threads,
            c_shims,
        )
        seconds[spec.name] = round(time.perf_counter() - began, 1)
        progress(f"[{index}/{len(methods)}] {spec.name}: done in {seconds[spec.name]:.1f} s")
    progress("writing the program")
    constants, stored = _weights(forward)
    tokenizer = _tokenizer_files(path)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        cellbatch_version=_cellbatch_version(),
        torch_version=torch.__version__,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        model=module.geometry,
        dtype=str(dtype).removeprefix("torch."),
        kv_dtype=str(kv_dtype).removeprefix("torch."),
        weights_format=weights.format,
        weight_formats=weights.formats,
        weight_kernel=weights.kernel,
        weight_bytes_by_format=weights.bytes_by_format,
        c_shims=sorted(_c_shim_symbol(op) for op in c_shims),
        methods=methods,
        min_prefill_tokens=methods[0].min_tokens,
        max_step_tokens=options.max_step_tokens,
        max_pool_rows=MAX_POOL_ROWS,
        query_block=QUERY_BLOCK,
        logits=LOGITS_MODE,
        stop_tokens=sorted(tokenizer[1]) if tokenizer else list(config.eos_token_ids),
        source=_source_identity(path),
        constants=constants,
        custom_ops=custom_ops,
        kernel_library=KERNEL_LIBRARY,
        tokenizer_files=sorted(tokenizer[0]) if tokenizer else [],
        export_seconds=seconds,
    )
    write_program(
        output,
        manifest,
        files,
        stored,
        tokenizer[0] if tokenizer else {},
        _kernel_library().read_bytes(),
    )
    total = time.perf_counter() - started
    size = output.stat().st_size / 2**20
    progress(f"wrote {output} ({size:.1f} MiB) in {total:.1f} s")
    return manifest


def _method_specs(options: ExportOptions, min_rows: int) -> list[MethodSpec]:
    """prefill first, then the decode widths narrowest first; the prefill bound is what
    the traced graph accepts: >= 2 (sizes 0 and 1 specialise) and >= the model's padded
    product height (below it the model pads, a branch a dynamic size cannot take)."""
    step = options.max_step_tokens
    if step < 2:
        raise InvalidArgumentError(f"max_step_tokens must be >= 2, got {step}")
    widths = sorted(set(options.decode_widths))
    if not widths or widths[0] < 1 or widths[-1] > step:
        raise InvalidArgumentError(
            f"decode widths must be between 1 and max_step_tokens={step}, got "
            f"{list(options.decode_widths)}"
        )
    low = max(options.min_prefill_tokens, 2, min_rows)
    if low > step:
        raise InvalidArgumentError(
            f"min_prefill_tokens={low} is above max_step_tokens={step}"
            + (f" (this model pads its products to {min_rows} rows)" if min_rows > 2 else "")
        )
    prefill = MethodSpec(PREFILL, PREFILL, low, step)
    return [prefill] + [MethodSpec(f"{DECODE}_{w}", DECODE, w, w) for w in widths]


def _tokens(spec: MethodSpec) -> str:
    return f"{spec.min_tokens} tokens" if spec.static else f"{spec.min_tokens}..{spec.max_tokens}"


def _export(
    forward: ProgramForward, spec: MethodSpec, max_step: int, kv_dtype: torch.dtype
) -> torch.export.ExportedProgram:
    """The method traced on example inputs whose sizes are all distinct (so that no two
    dynamic sizes are taken for one)."""
    config = forward.model.config
    sizes: list[int] = []
    tokens = _distinct(sizes, spec.max_tokens if spec.static else max(spec.min_tokens, 17))
    blocks = _distinct(sizes, math.ceil(tokens / QUERY_BLOCK) + 1)
    # A static method returns the logits of all its rows (at least 2); prefill as asked.
    rows = max(tokens, 2) if spec.static else _distinct(sizes, 3)
    keys = _distinct(sizes, tokens + 5)
    pool = _distinct(sizes, keys + 7)
    # Every input its own tensor: inputs passed as one object would be traced as one.
    args = (
        torch.zeros(tokens, dtype=torch.long),
        torch.arange(tokens),
        torch.arange(tokens) + 1,
        torch.arange(keys) % (pool - 1) + 1,
        torch.arange(tokens),
        torch.arange(tokens),
        torch.zeros(tokens, dtype=torch.long),
        torch.linspace(0, tokens, blocks).long(),
        torch.full((rows,), tokens - 1),
        [_pool(pool, config, kv_dtype) for _ in range(config.num_layers)],
        [_pool(pool, config, kv_dtype) for _ in range(config.num_layers)],
    )
    dim = torch.export.Dim
    token_dim = None if spec.static else dim("tokens", min=spec.min_tokens, max=spec.max_tokens)
    per_token = {0: token_dim} if token_dim is not None else None
    pool_dim = dim("pool_rows", min=2, max=MAX_POOL_ROWS)
    shapes = (
        per_token,
        per_token,
        per_token,
        {0: dim("attention_cells", min=2, max=MAX_POOL_ROWS * max_step)},
        per_token,
        per_token,
        per_token,
        {0: dim("blocks", min=2, max=max_step + 1)},
        None if spec.static else {0: dim("logit_rows", min=2, max=spec.max_tokens)},
        [{0: pool_dim}] * config.num_layers,
        [{0: pool_dim}] * config.num_layers,
    )
    with torch.no_grad():
        exported = torch.export.export(forward, args, dynamic_shapes=shapes, strict=False)
        # An ExportedProgram (torch's decorator on run_decompositions hides its type).
        decomposed: torch.export.ExportedProgram = exported.run_decompositions()
        return decomposed


def _distinct(taken: list[int], size: int) -> int:
    """`size`, moved up past the sizes already `taken`, and taken."""
    while size in taken:
        size += 1
    taken.append(size)
    return size


def _pool(rows: int, config: ModelConfig, kv_dtype: torch.dtype) -> torch.Tensor:
    width = head_width(config.head_dim, kv_dtype)
    return torch.zeros(rows, config.num_kv_heads, width, dtype=kv_dtype)


def _custom_ops(exported: torch.export.ExportedProgram) -> set[torch._ops.OpOverload]:
    """Every op outside PyTorch's own namespaces that the method calls."""
    ops = set()
    for node in exported.graph.nodes:
        for target in (node.target, *node.args[:1]):  # an auto_functionalized op's is args[0]
            if isinstance(target, torch._ops.OpOverload) and target.namespace.startswith(
                "cellbatch"
            ):
                ops.add(target)
    return ops


# How AOTInductor passes each schema type to an op's C entry point (kernels/aoti_shims.cpp).
_C_TYPES = {"Tensor": "AtenTensorHandle", "int": "int64_t", "float": "double"}


def _c_shim_symbol(op: torch._ops.OpOverload) -> str:
    """The C entry point AOTInductor's generated code calls for `op` (its naming rule)."""
    return f"aoti_torch_cpu_{op._schema.name.partition('::')[2]}"


def _c_shim(op: torch._ops.OpOverload) -> str:
    """The C declaration of `op`'s entry point, from its schema."""
    schema = op._schema
    parameters = [f"{_C_TYPES[str(a.type)]} {a.name}" for a in schema.arguments]
    # An op that returns nothing still gets one (null) output handle.
    parameters += [f"AtenTensorHandle* ret{i}" for i in range(max(1, len(schema.returns)))]
    return f"AOTITorchError {_c_shim_symbol(op)}({', '.join(parameters)})"


def _has_c_shim(op: torch._ops.OpOverload) -> bool:
    """Whether `op` can be called through its C entry point: this torch's AOTInductor
    calls custom ops that way (2.7 and later), the op's types have a C form, and the
    compiled kernels carry the entry point."""
    from torch._inductor import config as inductor_config

    if not hasattr(inductor_config.aot_inductor, "custom_ops_to_c_shims"):
        return False
    schema = op._schema
    if any(str(a.type) not in _C_TYPES for a in schema.arguments) or any(
        str(r.type) != "Tensor" for r in schema.returns
    ):
        return False
    return hasattr(ctypes.CDLL(str(_kernel_library())), _c_shim_symbol(op))


def _compile(
    exported: torch.export.ExportedProgram,
    metadata: dict[str, str],
    threads: int | None,
    c_shims: dict[torch._ops.OpOverload, str],
) -> list[str]:
    """AOTInductor's files for one method, its constants left out of the compiled code
    (the program stores the weights once, for every method), and the custom ops of
    `c_shims` called through their C entry points (declarations) rather than through
    torch's proxy executor, which boxes each call's arguments: a cost every op call of every
    step would pay."""
    from torch._inductor import aot_compile

    options = {
        "aot_inductor.package": True,
        "aot_inductor.package_constants_in_so": False,
        "aot_inductor.metadata": metadata,
        # The wrapper is straight-line calls into kernels: optimising it costs a third of
        # the compile time and gains nothing measurable per step; nor do line tables.
        "aot_inductor.compile_wrapper_opt_level": "O0",
        "aot_inductor.enable_line_tables": False,
        # Round every bf16/fp16 intermediate to its dtype, as eager does: fused into one
        # loop, `hidden + o` then `+ down` were added in float32 without the rounding
        # between, which changed greedy tokens from the first and made a step's rows
        # depend on which method ran them.
        "emulate_precision_casts": True,
    }
    if threads is not None:
        options["compile_threads"] = threads
    if c_shims:
        options["aot_inductor.custom_ops_to_c_shims"] = {
            op: [declaration] for op, declaration in c_shims.items()
        }
    files = aot_compile(exported.module(), exported.example_inputs[0], options=options)
    if not isinstance(files, list):  # it returns a list whenever aot_inductor.package is set
        raise TypeError(f"AOTInductor returned {type(files).__name__}, not its files")
    # Paths only: AOTInductor adds a Weights entry only for package_constants_on_disk_format
    # "pickle_weights", which is not asked for.
    paths = cast("list[str]", files)
    # The C++ sources stay behind: the compiled libraries and their metadata run.
    return [file for file in paths if not str(file).endswith(".cpp")]


def _weights(
    forward: ProgramForward,
) -> tuple[dict[str, ConstantSpec], dict[str, torch.Tensor]]:
    """Each method constant (the module's parameters and buffers) as a stored tensor,
    plain and stored once whatever its uses (a tied head's packed copy is the embedding)."""
    named: dict[str, torch.Tensor] = dict(forward.named_parameters(remove_duplicate=False))
    named.update(forward.named_buffers(remove_duplicate=False))
    constants: dict[str, ConstantSpec] = {}
    stored: dict[str, torch.Tensor] = {}
    by_content: dict[tuple[str, torch.dtype, tuple[int, ...]], str] = {}
    for name, tensor in named.items():
        packed = tensor.is_mkldnn
        plain = (tensor.to_dense() if packed else tensor).detach().contiguous()
        # An ndarray is a buffer; numpy's stubs say so only for Python 3.12 and later.
        data = cast("Buffer", plain.view(-1).view(torch.uint8).numpy())
        digest = hashlib.sha256(data).hexdigest()
        key = (digest, plain.dtype, tuple(plain.shape))
        if key not in by_content:
            by_content[key] = name
            stored[name] = plain
        constants[name] = ConstantSpec(tensor=by_content[key], packed=packed)
    return constants, stored


def _tokenizer_files(path: Path) -> tuple[dict[str, str], frozenset[int]] | None:
    """The tokenizer's own files (tokenizer.json, its config and chat template) and its
    stop tokens; None for a model without a tokenizer."""
    try:
        tokenizer = load_tokenizer(path)
    except FileNotFoundError:
        return None
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.backend.save_pretrained(folder)
        files = {
            file.name: file.read_text(encoding="utf-8")
            for file in sorted(Path(folder).iterdir())
            if file.suffix in _TOKENIZER_SUFFIXES
        }
    return files, tokenizer.stop_tokens


def _source_identity(path: Path) -> dict[str, str]:
    """Which model the program was made from: where it was, and a hash of its files."""
    files = locate_model(path)
    parts = (
        [files.path]
        if files.kind == "gguf"
        else [files.path / "config.json", *sorted(files.path.glob("*.safetensors"))]
    )
    digest = hashlib.sha256()
    for part in parts:
        with open(part, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return {
        "path": str(files.path.resolve()),
        "kind": files.kind,
        "name": files.path.name,
        "bytes": str(sum(part.stat().st_size for part in parts)),
        "sha256": digest.hexdigest(),
    }


def _kernel_library() -> Path:
    """The compiled kernels' library this process loaded (what the methods call)."""
    loaded = [Path(p) for p in torch.ops.loaded_libraries if "cellbatch" in str(p)]
    if not loaded:
        raise InvalidArgumentError(
            "the compiled kernels are loaded but their library file is not known to torch"
        )
    return loaded[0]


def _cellbatch_version() -> str:
    try:
        return version("cellbatch")
    except PackageNotFoundError:
        return "unknown"
