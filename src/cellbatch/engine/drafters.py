"""The drafter a speculative config asks for (docs/design.md#speculative-decoding).

Owns: loading a draft model (`load_draft`), the bytes its cache keeps per cell of the
pool (`draft_bytes_per_cell`, which the KV memory cap counts), and building the
executor's drafter from a `SpeculativeConfig` (`make_drafter`): prompt lookup, or a
draft model with an executor of its own sized like the target's.
Promises: a draft model is loaded with the target's dtype, device and the same kernel
and weight options, and refused, naming both sizes, when its vocabulary is not the
target's (a draft must speak the target's tokens).
Never: runs anything; the executor calls the drafter on its engine thread.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cellbatch.engine.backend import ModelBackend, ModuleBackend
from cellbatch.executor.cell_executor import ExecutorShape
from cellbatch.executor.draft_model import ModelDrafter
from cellbatch.executor.drafting import Drafter, NgramDrafter
from cellbatch.kv_format import kv_bytes_per_cell
from cellbatch.model.loading import LoadProgress, PhaseClock
from cellbatch.speculative import SpeculativeConfig
from cellbatch.types import InvalidArgumentError


def load_draft(
    config: SpeculativeConfig | None,
    target: ModelBackend,
    kernels: str,
    quantize: str,
    activations: str,
    progress: LoadProgress | None,
    cache: str | Path | None = None,
) -> ModelBackend | None:
    """The draft model a "draft_model" config names, loaded like the target: its dtype,
    on its device (with its CUDA options there), through the same weights cache `cache`
    (None for other configs)."""
    if config is None or config.method != "draft_model":
        return None
    assert config.model is not None
    path = Path(config.model)
    if not path.exists():
        raise InvalidArgumentError(
            f"the speculative config's draft model {path} does not exist; give the path of "
            "a Hugging Face folder or a GGUF file"
        )
    cuda = target.cuda if isinstance(target, ModuleBackend) else None
    draft = ModuleBackend.load(
        path, target.dtype, kernels, quantize, None, activations, target.device, cuda, cache
    )
    PhaseClock(progress).done(f"loaded the draft model {path.name}")
    return draft


def make_drafter(
    config: SpeculativeConfig | None,
    target: ModelBackend,
    shape: ExecutorShape,
    draft: ModelBackend | None,
) -> Drafter | None:
    """The drafter of `config` for an executor of `shape` over `target`, with `draft`
    the draft model `load_draft` loaded for a "draft_model" config."""
    if config is None:
        return None
    if config.method == "ngram":
        low, high = config.lookup
        return NgramDrafter(low, high)
    if draft is None:
        raise ValueError("a draft_model config needs its draft model loaded (load_draft)")
    vocab, draft_vocab = target.geometry.vocab_size, draft.geometry.vocab_size
    if draft_vocab != vocab:
        raise InvalidArgumentError(
            f"the draft model {config.model} has a vocabulary of {draft_vocab} tokens, the "
            f"model {vocab}; a draft model must use the model's tokenizer"
        )
    draft_shape = dataclasses.replace(shape, kv_dtype=draft.dtype)
    return ModelDrafter(draft.executor(draft_shape))


def draft_bytes_per_cell(draft: ModelBackend | None) -> int:
    """The bytes a draft model's cache keeps per cell of the pool (its cache has as many
    cells, in its own dtype; 0 without a draft model)."""
    if draft is None:
        return 0
    shape = draft.geometry
    return kv_bytes_per_cell(shape.num_layers, shape.num_kv_heads, shape.head_dim, draft.dtype)
