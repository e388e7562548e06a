"""Which torch device a model runs on, and what that device allows (docs/design.md#devices).

Owns: `DEVICE_CHOICES`, `resolve_device` (a user's "auto" | "cpu" | "cuda" | "cuda:N" to a
torch device, refused with the fix when the machine cannot honour it), and the rule of
what `quantize` means off the CPU (`device_quantize`).
Promises: "auto" takes the first CUDA GPU when torch sees one, else the CPU; "cuda" on a
machine where torch sees none is an `InvalidArgumentError` naming why (a CPU build of
torch, or no driver/GPU) and the fix, before anything loads. Off the CPU the weights are
float in the model's dtype (bf16 by default): the quantised products are compiled CPU
kernels, and their torch fallbacks rebuild a float weight on every call, so "auto" means
float there and an explicit int8/int4 is refused with the fix.
Never: loads a model, or initialises CUDA for a CPU choice.
"""

from __future__ import annotations

import torch

from cellbatch.types import InvalidArgumentError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(choice: str | torch.device) -> torch.device:
    """The torch device for `choice`: "auto", "cpu", "cuda" or "cuda:N" (or a torch.device)."""
    if isinstance(choice, torch.device):
        name = str(choice)
    elif isinstance(choice, str):
        name = choice.strip().lower()
    else:
        raise InvalidArgumentError(
            f"device must be one of {', '.join(DEVICE_CHOICES)} (or cuda:N), "
            f"got {type(choice).__name__}"
        )
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise InvalidArgumentError(
            f"unknown device {choice!r}; use one of {', '.join(DEVICE_CHOICES)} (or cuda:N)"
        ) from error
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise InvalidArgumentError(
            f"device {choice!r} is not supported; use one of {', '.join(DEVICE_CHOICES)}"
        )
    if not torch.cuda.is_available():
        raise InvalidArgumentError(f"device {name!r} was asked for, but {cuda_missing_reason()}")
    count = torch.cuda.device_count()
    index = 0 if device.index is None else device.index
    if index >= count:
        raise InvalidArgumentError(
            f"device {name!r} was asked for, but torch sees {count} CUDA GPU(s) "
            f"(cuda:0 .. cuda:{count - 1}); pick one of those"
        )
    return torch.device("cuda", index)


def cuda_missing_reason() -> str:
    """Why torch sees no CUDA GPU here, with the fix."""
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is a CPU build, without CUDA"
        fix = "install a CUDA build of torch (pip install torch from its CUDA index)"
    else:
        cuda = torch.version.cuda
        why = f"torch {torch.__version__} (CUDA {cuda}) sees no GPU: no driver or device"
        fix = "check nvidia-smi and CUDA_VISIBLE_DEVICES"
    return f"{why}; {fix}, or run on the CPU with device 'cpu' (or 'auto')"


def device_quantize(quantize: str, device: torch.device) -> str:
    """What `quantize` (already checked) loads as on `device`: itself on the CPU; off it,
    "auto" and "none" load float weights and int8/int4 are refused."""
    if device.type == "cpu" or quantize == "none":
        return quantize
    if quantize == "auto":
        return "none"
    raise InvalidArgumentError(
        f"quantize {quantize!r} runs on the compiled CPU kernels only; on {device.type} the "
        "weights load as float in the model's dtype (bf16 by default): use quantize 'auto' "
        "or 'none' there, or device 'cpu'"
    )
