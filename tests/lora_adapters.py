"""LoRA adapters made with PEFT for the tests, and PEFT's own model to compare with.

`make_adapter(base, folder, targets, rank, ...)` trains nothing: it wraps a copy of a
transformers model with PEFT's LoRA layers, draws every A and B at random (B non-zero,
so that each adapter moves the logits) and saves the adapter as PEFT does
(`adapter_config.json` + `adapter_model.safetensors`). `peft_model(base, folder)` loads
it back onto a copy of the base with `PeftModel.from_pretrained`, the reference.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base,  # transformers.PreTrainedModel
    folder: Path,
    targets: Sequence[str] = ALL_MODULES,
    rank: int = 8,
    *,
    alpha: float = 16.0,
    seed: int = 0,
    std: float = 0.1,
    rslora: bool = False,
    dtype: torch.dtype = torch.float32,
    **config: object,
) -> Path:
    """A random LoRA adapter for `base` saved in `folder`; `config` adds LoraConfig fields
    (layers_to_transform, alpha_pattern, ...)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=rslora,
        lora_dropout=0.0,
        init_lora_weights=False,
        **config,
    )
    model = get_peft_model(copy.deepcopy(base), lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.to(dtype).save_pretrained(folder)
    return folder


def peft_model(base, folder: Path):  # -> peft.PeftModel
    """PEFT's model of `base` with the adapter in `folder`, in float32, for reference."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).float().eval()
