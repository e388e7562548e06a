"""The Engine: a model backend, its tokenizer and a Runner, as one object
(docs/design.md#engine).

Imports only go down this list: `backend` (module or program) < `batch` (one call's
results) < `engine`.
"""

from cellbatch.engine.backend import ModelBackend, ModuleBackend, ProgramBackend
from cellbatch.engine.batch import GenerationBatch, GenerationResult, Prompt
from cellbatch.engine.engine import (
    DEFAULT_MAX_BATCH_TOKENS,
    MIN_SHARED_PREFIX,
    Engine,
    EngineLimits,
    EngineShape,
    Message,
)

__all__ = [
    "DEFAULT_MAX_BATCH_TOKENS",
    "MIN_SHARED_PREFIX",
    "Engine",
    "EngineLimits",
    "EngineShape",
    "GenerationBatch",
    "GenerationResult",
    "Message",
    "ModelBackend",
    "ModuleBackend",
    "ProgramBackend",
    "Prompt",
]
