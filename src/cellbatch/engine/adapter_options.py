"""The LoRA options of `Engine.from_pretrained`, checked before anything loads.

Owns: `check_lora_options`, and `NoAdapters`, the adapter lookup of an engine whose
executor runs none.
Promises: returns the adapters to load (name -> folder) only where they can run: names
checked, no more than `max_loras`, a model folder or GGUF file (not an exported
program) run on the CPU; anything else is an InvalidArgumentError naming the problem
and the fix. A generation naming an adapter on an engine that runs none fails with
that engine's reason and fix (`NoAdapters`), never runs on the base model instead.
Never: reads an adapter (`AdapterBank.load` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from cellbatch.executor.cuda_executor import CudaExecutor
from cellbatch.executor.program_executor import ProgramExecutor
from cellbatch.model.adapters import check_max_loras, check_name
from cellbatch.types import InvalidArgumentError


@dataclass(frozen=True)
class NoAdapters:
    """The runner's adapter lookup where the backend runs no adapters: every name is
    refused with `reason` (the backend's, with its fix)."""

    reason: str

    def acquire(self, name: str) -> int:
        raise InvalidArgumentError(
            f"adapter {name!r}: this engine runs no LoRA adapters: {self.reason}"
        )

    def release(self, adapter_id: int, prompt_tokens: int, generated_tokens: int) -> None:
        """Nothing was acquired."""


def check_lora_options(
    lora_adapters: Mapping[str, str | Path] | None,
    max_loras: int,
    program: bool,
    device: torch.device,
) -> dict[str, str | Path]:
    """The adapters to load at start (see the module); `program`: the model is an
    exported program, `device`: where the model runs."""
    adapters = dict(lora_adapters or {})
    for name in adapters:
        check_name(name)
    if len(adapters) > check_max_loras(max_loras):
        raise InvalidArgumentError(
            f"{len(adapters)} LoRA adapters asked for, above max_loras={max_loras}; raise max_loras"
        )
    if adapters and program:
        raise InvalidArgumentError(f"lora_adapters: {ProgramExecutor.ADAPTERS_REFUSAL}")
    if adapters and device.type != "cpu":
        raise InvalidArgumentError(f"lora_adapters on {device}: {CudaExecutor.ADAPTERS_REFUSAL}")
    return adapters
