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
from cellbatch.executor.cuda_executor import CudaExecutor, CudaOptions
from cellbatch.executor.drafting import Drafter
from cellbatch.executor.module_executor import ModuleExecutor
from cellbatch.executor.program_executor import ProgramExecutor
from cellbatch.export.program import Program, load_program, read_tokenizer
from cellbatch.machine import FileMappings
from cellbatch.model.adapters import AdapterBank
from cellbatch.model.config import ModelConfig
from cellbatch.model.loading import LoadProgress, PhaseClock, load_model
from cellbatch.model.tokenizer import Tokenizer, tokenizer_from_files
from cellbatch.model.transformer import (
    DTYPES,
    PackedTransformer,
    resolve_dtype,
    resolve_kv_dtype,
)
from cellbatch.model.weights_summary import WeightsSummary
from cellbatch.model.weights_summary import describe as describe_weights
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
    def device(self) -> torch.device:
        """Where the forwards run."""
        return torch.device("cpu")

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
    def mapped_weights_bytes(self) -> int:
        """Bytes of the weights a file mapping holds (page cache: counted as available
        memory, but needed); 0 where every weight is in the process's own memory."""
        return 0

    @property
    def adapters(self) -> AdapterBank | None:
        """The LoRA adapters its forwards run (None: it runs none)."""
        return None

    @property
    def adapters_refusal(self) -> str:
        """Why it runs no LoRA adapters, and the fix (where `adapters` is None)."""
        return CellExecutor.ADAPTERS_REFUSAL

    @property
    def matryoshka_dimensions(self) -> tuple[int, ...] | None:
        """The sizes its embeddings may be shortened to (ModelConfig's); None: none."""
        return None

    @abstractmethod
    def executor(
        self,
        shape: ExecutorShape,
        constraints: ConstraintCompiler | None = None,
        drafter: Drafter | None = None,
    ) -> CellExecutor:
        """A new executor over this model (initialised by the Runner's engine thread);
        `constraints` compiles its generations' constraints, `drafter` drafts for the
        decodes that speculate."""


@dataclasses.dataclass(frozen=True)
class ModuleBackend(ModelBackend):
    """A PackedTransformer run in this process: on the CPU one forward per slice of a step
    (ModuleExecutor); with `cuda` options (a model on a GPU) through a CudaExecutor."""

    module: PackedTransformer
    config: ModelConfig
    cuda: CudaOptions | None = None
    bank: AdapterBank | None = None  # on the CPU, None: a bank of DEFAULT_MAX_LORAS is made

    def __post_init__(self) -> None:
        if self.bank is None and self.cuda is None:
            bank = AdapterBank.for_model(self.module, self.config, DEFAULT_MAX_LORAS)
            object.__setattr__(self, "bank", bank)  # a frozen dataclass's own default

    @property
    def adapters(self) -> AdapterBank | None:
        return None if self.cuda is not None else self.bank

    @property
    def adapters_refusal(self) -> str:
        return CudaExecutor.ADAPTERS_REFUSAL

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
    def device(self) -> torch.device:
        return self.module.norm.weight.device

    @property
    def weights(self) -> WeightsSummary:
        return describe_weights(self.module)

    @property
    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    @property
    def mapped_weights_bytes(self) -> int:
        return FileMappings().bytes_of(list(self.module.parameters()))

    @property
    def matryoshka_dimensions(self) -> tuple[int, ...] | None:
        return self.config.matryoshka_dimensions

    def executor(
        self,
        shape: ExecutorShape,
        constraints: ConstraintCompiler | None = None,
        drafter: Drafter | None = None,
    ) -> CellExecutor:
        if self.cuda is not None:
            return CudaExecutor(
                self.module, self.config, shape, self.cuda, constraints, drafter=drafter
            )
        return ModuleExecutor(
            self.module, self.config, shape, constraints, drafter, adapters=self.adapters
        )

    @classmethod
    def load(
        cls,
        path: Path,
        dtype: torch.dtype,
        kernels: str,
        quantize: str,
        progress: LoadProgress | None,
        activations: str = "auto",
        device: torch.device | None = None,
        cuda: CudaOptions | None = None,
        cache: str | Path | None = None,
        max_loras: int = DEFAULT_MAX_LORAS,
    ) -> ModuleBackend:
        """A Hugging Face folder or a GGUF file, loaded in a thread of its own (its
        native pools die with it: `in_short_lived_thread`), onto `device`; off the CPU it
        runs through a CudaExecutor with `cuda` (default options when None). None: the CPU.
        `cache`: the repacked-weights cache's folder (see load_model). On the CPU it has a
        bank for up to `max_loras` LoRA adapters."""
        device = device or torch.device("cpu")
        config, module = in_short_lived_thread(
            lambda: load_model(path, dtype, kernels, quantize, progress, activations, device, cache)
        )
        if device.type != "cpu":
            return cls(module, config, cuda or CudaOptions())
        return cls(module, config, bank=AdapterBank.for_model(module, config, max_loras))


@dataclasses.dataclass(frozen=True)
class ProgramBackend(ModelBackend):
    """An exported program's compiled methods; no model code runs."""

    program: Program

    @property
    def adapters_refusal(self) -> str:
        return ProgramExecutor.ADAPTERS_REFUSAL

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
        self,
        shape: ExecutorShape,
        constraints: ConstraintCompiler | None = None,
        drafter: Drafter | None = None,
    ) -> CellExecutor:
        return ProgramExecutor(self.program, shape, constraints, drafter)

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
            "dtype": None if dtype == "auto" else resolve_dtype(dtype),
            # (a kv_dtype given: the weight dtype, its default, plays no part)
            "kv_dtype": None
            if kv_dtype in (None, "auto")
            else resolve_kv_dtype(kv_dtype, torch.float32),
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
