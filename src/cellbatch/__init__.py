"""cellbatch: many generations of one language model at once, sharing every forward."""

import os

# MKL's fp32 products (torch's F.linear, bmm: the torch implementations of the ops, which the
# compiled kernels are tested against) round a row differently by the row count of the call
# on Intel CPUs unless its conditional numerical reproducibility is strict. MKL reads this
# once, at its first product in the process, so it is set before anything computes; a
# value the user set stays.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from cellbatch.generation_config import Constraint, GenConfig, SamplingParams
from cellbatch.metrics import EngineMetrics, GenerationMetrics
from cellbatch.runner import GenerationHandle, Runner, Session
from cellbatch.types import (
    FinishReason,
    GenerationUpdate,
    InvalidArgumentError,
    OutOfResourcesError,
)

__all__ = [
    "Constraint",
    "Engine",
    "EngineMetrics",
    "FinishReason",
    "GenConfig",
    "GenerationHandle",
    "GenerationMetrics",
    "GenerationUpdate",
    "InvalidArgumentError",
    "OutOfResourcesError",
    "Runner",
    "SamplingParams",
    "Session",
]


def __getattr__(name: str) -> object:
    # Engine pulls in the model loaders (torch, gguf, transformers): imported on first use,
    # so that `import cellbatch` stays light for users of the Runner alone.
    if name == "Engine":
        from cellbatch.engine import Engine

        return Engine
    raise AttributeError(f"module 'cellbatch' has no attribute {name!r}")
