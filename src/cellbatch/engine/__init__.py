"""The Engine: a model backend, its tokenizer and a Runner, as one object
(docs/design.md#engine).

Imports only go down this list: `backend` (module or program) < `batch` (one call's
results) < `call_checks` (one call's prompts and configs) < `limits` (EngineShape,
EngineLimits) < `prefix` (a call's shared prompt prefix) < `loader` (a model's files to
what an Engine runs) < `start` (an Engine's construction and loading) < `engine` (the
calls on a started one).
"""

from cellbatch.engine.backend import ModelBackend, ModuleBackend, ProgramBackend
from cellbatch.engine.batch import GenerationBatch, GenerationResult, Prompt
from cellbatch.engine.engine import Engine, Message
from cellbatch.engine.limits import DEFAULT_MAX_BATCH_TOKENS, EngineLimits, EngineShape
from cellbatch.engine.loader import LoadOptions
from cellbatch.engine.prefix import MIN_SHARED_PREFIX

__all__ = [
    "DEFAULT_MAX_BATCH_TOKENS",
    "MIN_SHARED_PREFIX",
    "Engine",
    "EngineLimits",
    "EngineShape",
    "GenerationBatch",
    "GenerationResult",
    "LoadOptions",
    "Message",
    "ModelBackend",
    "ModuleBackend",
    "ProgramBackend",
    "Prompt",
]
