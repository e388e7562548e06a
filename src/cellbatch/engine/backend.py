"""What runs an engine's forwards: a torch module or an exported program, behind one face.

Owns: `ModelBackend` and its two kinds (`ModuleBackend`: a PackedTransformer with its
config and the bank of its LoRA adapters; `ProgramBackend`: a program file's methods),
and loading each from a path with the options checked against what the file can do.
Promises: an Engine reads the geometry, the activations' dtype, the kernels, the weight
summary and the weights' bytes from its backend, and gets its executor from it, without
asking which kind it holds. A program refuses options its export fixed (dtype, kv_dtype,
quantize, kernels "torch"), naming what it holds and how to get another.
Never: schedules, tokenizes or generates; the Engine and the Runner do.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from cellbatch.constraint import ConstraintCompiler
from cellbatch.executor.cell_executor import CellExecutor, ExecutorShape
from cellbatch.executor.module_executor import ModuleExecutor
from cellbatch.executor.program_executor import ProgramExecutor
from cellbatch.export.program import Program, load_program, read_tokenizer
from cellbatch.model.adapters import AdapterBank
from cellbatch.model.config import ModelConfig
from cellbatch.model.loading import LoadProgress, PhaseClock, load_model
from cellbatch.model.quantized import WeightsSummary
from cellbatch.model.quantized import describe as describe_weights
from cellbatch.model.tokenizer import Tokenizer, tokenizer_from_files
from cellbatch.model.transformer import DTYPES, PackedTransformer, resolve_dtype
from cellbatch.threads import in_short_lived_thread
from cellbatch.types import DEFAULT_MAX_LORAS, InvalidArgumentError, ModelGeometry


class ModelBackend(ABC):
    """The model as an engine runs it."""

    @property
    @abstractmethod
    def geometry(self) -> ModelGeometry: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The activations' dtype (quantised weights have integer parameters)."""

    @property
    @abstractmethod
    def kernels(self) -> str:
        """ "compiled" or "torch": which implementation of the ops runs."""

    @property
    @abstractmethod
    def kind(self) -> str:
        """ "module" (the torch module itself) or "program" (an exported program)."""

    @property
    @abstractmethod
    def weights(self) -> WeightsSummary: ...

    @property
    @abstractmethod
    def weights_bytes(self) -> int: ...

    @property
    def max_step_tokens(self) -> int | None:
        """The widest step it can run, where it has one (a program's widest method)."""
        return None

    @property
    def adapters(self) -> AdapterBank | None:
        """The LoRA adapters its forwards run (None: it runs none)."""
        return None

    @abstractmethod
    def executor(
        self, shape: ExecutorShape, constraints: ConstraintCompiler | None = None
    ) -> CellExecutor:
        """A new executor over this model (initialised by the Runner's engine thread);
        `constraints` compiles its generations' constraints."""


@dataclasses.dataclass(frozen=True)
class ModuleBackend(ModelBackend):
    """A PackedTransformer run in this process, one forward per slice of a step."""

    module: PackedTransformer
    config: ModelConfig
    bank: AdapterBank | None = None  # None: a bank of DEFAULT_MAX_LORAS is made

    def __post_init__(self) -> None:
        if self.bank is None:
            bank = AdapterBank(self.config, self.module.dtype, DEFAULT_MAX_LORAS)
            object.__setattr__(self, "bank", bank)  # a frozen dataclass's own default

    @property
    def adapters(self) -> AdapterBank:
        assert self.bank is not None
        return self.bank

    @property
    def geometry(self) -> ModelGeometry:
        return self.module.geometry

    @property
    def dtype(self) -> torch.dtype:
        return self.module.dtype

    @property
    def kernels(self) -> str:
        return self.module.ops.kind

    @property
    def kind(self) -> str:
        return "module"

    @property
    def weights(self) -> WeightsSummary:
        return describe_weights(self.module)

    @property
    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    def executor(
        self, shape: ExecutorShape, constraints: ConstraintCompiler | None = None
    ) -> CellExecutor:
        return ModuleExecutor(self.module, self.config, shape, constraints, self.adapters)

    @classmethod
    def load(
        cls,
        path: Path,
        dtype: torch.dtype,
        kernels: str,
        quantize: str,
        progress: LoadProgress | None,
        activations: str = "auto",
        max_loras: int = DEFAULT_MAX_LORAS,
    ) -> ModuleBackend:
        """A Hugging Face folder or a GGUF file, loaded in a thread of its own (its
        native pools die with it: `in_short_lived_thread`), with a bank for up to
        `max_loras` LoRA adapters."""
        config, module = in_short_lived_thread(
            lambda: load_model(path, dtype, kernels, quantize, progress, activations)
        )
        return cls(module, config, AdapterBank(config, module.dtype, max_loras))


@dataclasses.dataclass(frozen=True)
class ProgramBackend(ModelBackend):
    """An exported program's compiled methods; no model code runs."""

    program: Program

    @property
    def geometry(self) -> ModelGeometry:
        return self.program.manifest.model

    @property
    def dtype(self) -> torch.dtype:
        return self.program.dtype

    @property
    def kernels(self) -> str:
        return "compiled"  # a program runs the kernels it was compiled with

    @property
    def kind(self) -> str:
        return "program"

    @property
    def weights(self) -> WeightsSummary:
        """From the manifest (one written before the manifest said holds float weights of
        its dtype)."""
        manifest = self.program.manifest
        if manifest.weight_formats:
            return WeightsSummary(
                manifest.weights_format,
                dict(manifest.weight_formats),
                manifest.weight_kernel,
                dict(manifest.weight_bytes_by_format),
            )
        dtype = manifest.dtype
        roles = dict.fromkeys(("projections", "embedding", "lm_head"), dtype)
        return WeightsSummary(dtype, roles, "none", {dtype: self.program.weights_bytes})

    @property
    def weights_bytes(self) -> int:
        return self.program.weights_bytes

    @property
    def max_step_tokens(self) -> int | None:
        return self.program.manifest.max_step_tokens

    def executor(
        self, shape: ExecutorShape, constraints: ConstraintCompiler | None = None
    ) -> CellExecutor:
        return ProgramExecutor(self.program, shape, constraints)

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        dtype: str | torch.dtype,
        kv_dtype: str | torch.dtype | None,
        kernels: str,
        quantize: str,
        progress: LoadProgress | None,
        activations: str = "auto",
    ) -> tuple[ProgramBackend, Tokenizer | None]:
        """The program and the tokenizer it carries (None when it carries none). Options
        its export fixed must be "auto" or what it holds."""
        asked = {
            name: None if value in (None, "auto") else resolve_dtype(value)
            for name, value in (("dtype", dtype), ("kv_dtype", kv_dtype))
        }
        if kernels == "torch":
            raise InvalidArgumentError(
                f"program {path} runs its own compiled kernels; kernels apply to models, "
                "not programs"
            )
        if activations != "auto":
            raise InvalidArgumentError(
                f"program {path} runs the products it was exported with (activations are "
                "fixed at export); drop activations or export the model again with "
                "`cellbatch export --activations`"
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
        backend = cls(program)
        exported_as = backend.weights.formats["projections"]
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
        return backend, tokenizer
