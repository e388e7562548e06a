"""The LoRA options of `Engine.from_pretrained`, checked before anything loads.

Owns: `check_lora_options`.
Promises: returns the adapters to load (name -> folder) only where they can run: names
checked, no more than `max_loras`, a model folder or GGUF file (not an exported
program) run on the CPU; anything else is an InvalidArgumentError naming the problem
and the fix.
Never: reads an adapter (`AdapterBank.load` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from cellbatch.executor.cuda_executor import CudaExecutor
from cellbatch.executor.program_executor import ProgramExecutor
from cellbatch.model.adapters import check_max_loras, check_name
from cellbatch.types import InvalidArgumentError


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
