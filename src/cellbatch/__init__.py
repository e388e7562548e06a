"""cellbatch: many generations of one language model at once, sharing every forward."""

from cellbatch.types import (
    FinishReason,
    GenConfig,
    GenerationUpdate,
    InvalidArgumentError,
    OutOfResourcesError,
    SamplingParams,
)

__all__ = [
    "FinishReason",
    "GenConfig",
    "GenerationUpdate",
    "InvalidArgumentError",
    "OutOfResourcesError",
    "SamplingParams",
]
