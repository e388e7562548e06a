"""cellbatch: many generations of one language model at once, sharing every forward."""

from cellbatch.metrics import EngineMetrics, GenerationMetrics
from cellbatch.runner import GenerationHandle, Runner, Session
from cellbatch.types import (
    FinishReason,
    GenConfig,
    GenerationUpdate,
    InvalidArgumentError,
    OutOfResourcesError,
    SamplingParams,
)

__all__ = [
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
