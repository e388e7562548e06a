"""cellbatch: many generations of one language model at once, sharing every forward."""

from cellbatch.metrics import EngineMetrics, GenerationMetrics
from cellbatch.prefix_cache import PrefixCache
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
    "EngineMetrics",
    "FinishReason",
    "GenConfig",
    "GenerationHandle",
    "GenerationMetrics",
    "GenerationUpdate",
    "InvalidArgumentError",
    "OutOfResourcesError",
    "PrefixCache",
    "Runner",
    "SamplingParams",
    "Session",
]
