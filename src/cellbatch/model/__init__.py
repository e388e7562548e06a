"""Models: configs, the packed-step transformer, weight loading, tokenizer, the default model.

Owns: everything that knows what a Llama-family model is (docs/design.md#model).
Promises: `load_model(path, dtype)` and `load_tokenizer(path)` accept a Hugging Face
folder or a GGUF file; `default_model_path()` finds the embedded SmolLM2.
Never: owns cells, sessions or sampling.
"""

from cellbatch.model.checkpoints import CheckpointMismatchError
from cellbatch.model.config import ModelConfig, RopeScaling, UnsupportedModelError
from cellbatch.model.default import DefaultModelMissingError, default_model_path
from cellbatch.model.loading import ModelFiles, load_model, locate_model
from cellbatch.model.tokenizer import Tokenizer, load_tokenizer
from cellbatch.model.transformer import PackedTransformer, resolve_dtype

__all__ = [
    "CheckpointMismatchError",
    "DefaultModelMissingError",
    "ModelConfig",
    "ModelFiles",
    "PackedTransformer",
    "RopeScaling",
    "Tokenizer",
    "UnsupportedModelError",
    "default_model_path",
    "load_model",
    "load_tokenizer",
    "locate_model",
    "resolve_dtype",
]
