"""A loaded program: its manifest, its methods and the one set of weights they share.

Owns: `Program` and `load_program`, which turn a program file into callables (and
`read_tokenizer`, the tokenizer's files alone): the checks
of the file (`ProgramArchive`), of this machine against it (torch version, CPU
capability), the custom ops it calls (`ensure_custom_ops`), the weights (read once,
oneDNN-reordered where the manifest says, handed to every method as user-managed
constants, so no method holds a copy), and each method's AOTInductor model, whose
metadata and constants are checked against the manifest.
Promises: `Program.methods[name](inputs)` runs a method on the inputs of
`manifest.METHOD_INPUTS` plus the K and V pool tensors (updated in place) and returns
float32 logits. A program this machine cannot run is refused before any of its code
runs, with a `ProgramFormatError` naming what differs and what to do.
Never: imports model code (`cellbatch.model`), traces or compiles anything.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from cellbatch.export.archive import TOKENIZER_DIR, WEIGHTS, ProgramArchive
from cellbatch.export.custom_ops import ensure_custom_ops
from cellbatch.export.manifest import Manifest, MethodSpec, ProgramFormatError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = {**DTYPES, "int8": torch.int8}  # the pool's (cellbatch.kv_format)
# Torch's CPU capabilities, each able to run code compiled for those before it.
CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")
# What each compiled method carries in its AOTInductor metadata, checked at load.
METADATA_PREFIX = "cellbatch."


class Method:
    """One compiled method: `method(inputs)` -> float32 logits [len(logit_rows), V]."""

    def __init__(self, spec: MethodSpec, loader: torch._C._aoti.AOTIModelPackageLoader) -> None:
        self.spec = spec
        self._loader = loader

    def __call__(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return self._loader.run(list(inputs))[0]


@dataclass
class Program:
    """What the runtime runs instead of a model."""

    path: Path
    manifest: Manifest
    methods: dict[str, Method]
    # The methods' constants: the methods hold bare pointers to these (user-managed), so
    # the program keeps them alive.
    constants: dict[str, torch.Tensor]
    weights_bytes: int  # the stored weights, once
    load_seconds: float

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.manifest.dtype]

    @property
    def kv_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.manifest.kv_dtype]


def load_program(path: str | Path) -> Program:
    """Opens, checks and loads the program file at `path` (see the module docstring)."""
    start = time.perf_counter()
    archive = ProgramArchive(path)
    try:
        manifest = archive.manifest
        _check_machine(archive.path, manifest)
        ensure_custom_ops(
            manifest.custom_ops,
            lambda: archive.read_bytes(manifest.kernel_library),
            manifest.c_shims,
        )
        stored = load_safetensors(archive.read_bytes(WEIGHTS))
        constants = _constants(archive.path, manifest, stored)
        methods = {}
        for spec in manifest.methods:
            archive.verify_method(spec.name)
            methods[spec.name] = _load_method(archive.path, manifest, spec, constants)
    finally:
        archive.close()
    weights_bytes = sum(t.numel() * t.element_size() for t in stored.values())
    return Program(
        archive.path,
        manifest,
        methods,
        constants,
        weights_bytes,
        time.perf_counter() - start,
    )


def read_tokenizer(path: str | Path) -> tuple[dict[str, str], list[int]]:
    """The tokenizer files (name -> text) and stop tokens a program carries, read without
    loading its methods (so that the tokenizer can be built while they load)."""
    archive = ProgramArchive(path)
    try:
        manifest = archive.manifest
        files = {name: archive.read_text(TOKENIZER_DIR + name) for name in manifest.tokenizer_files}
        return files, manifest.stop_tokens
    finally:
        archive.close()


def _check_machine(path: Path, manifest: Manifest) -> None:
    refuse = f"cannot run program {path}:"
    if manifest.torch_version != torch.__version__:
        raise ProgramFormatError(
            f"{refuse} it was compiled against torch {manifest.torch_version} but torch "
            f"{torch.__version__} runs here; export the model again with this torch"
        )
    here = torch.backends.cpu.get_cpu_capability()
    wanted = manifest.cpu_capability
    if wanted not in CAPABILITIES or CAPABILITIES.index(wanted) > _rank(here):
        raise ProgramFormatError(
            f"{refuse} its code was compiled for CPU capability {wanted}, this CPU has "
            f"{here}; export the model again on this machine"
        )
    if manifest.dtype not in DTYPES or manifest.kv_dtype not in KV_DTYPES:
        raise ProgramFormatError(
            f"{refuse} unknown dtype {manifest.dtype} / KV dtype {manifest.kv_dtype}"
        )


def _rank(capability: str) -> int:
    return CAPABILITIES.index(capability) if capability in CAPABILITIES else 0


def _constants(
    path: Path, manifest: Manifest, stored: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every method constant, made once from the stored tensors: the ones the products
    take reordered for oneDNN (as the eager model reorders its weights at load)."""
    made: dict[tuple[str, bool], torch.Tensor] = {}
    constants = {}
    for name, spec in manifest.constants.items():
        tensor = stored.get(spec.tensor)
        if tensor is None:
            raise ProgramFormatError(
                f"cannot run program {path}: constant {name} needs the stored tensor "
                f"{spec.tensor}, which it lacks; export the model again"
            )
        key = (spec.tensor, spec.packed)
        if key not in made:
            made[key] = (
                torch.ops.mkldnn._reorder_linear_weight(tensor, None) if spec.packed else tensor
            )
        constants[name] = made[key]
    return constants


def _load_method(
    path: Path, manifest: Manifest, spec: MethodSpec, constants: dict[str, torch.Tensor]
) -> Method:
    expected = method_metadata(spec, manifest.num_inputs, manifest.format_version)
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), spec.name, False, 1, -1)
    found = {k: v for k, v in loader.get_metadata().items() if k.startswith(METADATA_PREFIX)}
    if found != expected:
        raise ProgramFormatError(
            f"cannot run program {path}: its manifest describes method {spec.name} as "
            f"{expected}, its compiled code says {found}; export the model again"
        )
    names = loader.get_constant_fqns()
    missing = sorted(set(names) - set(constants))
    if missing:
        raise ProgramFormatError(
            f"cannot run program {path}: method {spec.name} needs constants {missing[:4]} "
            "that its manifest does not give; export the model again"
        )
    # user_managed: the method keeps pointers to these very tensors, shared by every method.
    loader.load_constants({name: constants[name] for name in names}, False, True, True, False)
    return Method(spec, loader)


def method_metadata(spec: MethodSpec, num_inputs: int, format_version: int) -> dict[str, str]:
    """The metadata a method's compiled code carries (written at export, checked here)."""
    return {
        f"{METADATA_PREFIX}method": spec.name,
        f"{METADATA_PREFIX}kind": spec.kind,
        f"{METADATA_PREFIX}tokens": f"{spec.min_tokens}-{spec.max_tokens}",
        f"{METADATA_PREFIX}inputs": str(num_inputs),
        f"{METADATA_PREFIX}format": str(format_version),
    }
