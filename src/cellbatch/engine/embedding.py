"""Embeddings: what a caller gets from a prompt's pooled hidden states.

Owns: the size an embedding may have (`embedding_size`: the model's hidden size, or one
its config allows it to be shortened to) and the vector a caller gets from the pooled
one (`finish_embedding`: shortened, then normalised).
Promises: a size the model does not allow is an InvalidArgumentError naming the sizes
it allows; a vector is shortened before it is normalised (a Matryoshka model's rule),
and normalised to unit L2 length when asked (a zero vector stays zero).
Never: runs the model (the executor pools, the Engine submits).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cellbatch.types import InvalidArgumentError


def embedding_size(hidden_size: int, matryoshka: tuple[int, ...] | None, asked: int | None) -> int:
    """The size of the embeddings to give: `asked`, where the model allows it (its hidden
    size always; shorter ones where its config lists them, or any with `is_matryoshka`)."""
    if asked is None or asked == hidden_size:
        return hidden_size
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        raise InvalidArgumentError(f"dimensions must be a positive integer, got {asked!r}")
    if asked > hidden_size:
        raise InvalidArgumentError(
            f"dimensions {asked} is above this model's {hidden_size}-dimensional embeddings"
        )
    if matryoshka is None:
        raise InvalidArgumentError(
            f"this model's embeddings have {hidden_size} dimensions and it was not trained to "
            "shorten them (its config.json names no matryoshka_dimensions); leave dimensions "
            f"out or give {hidden_size}"
        )
    if matryoshka and asked not in matryoshka:
        allowed = ", ".join(str(size) for size in sorted({*matryoshka, hidden_size}))
        raise InvalidArgumentError(
            f"dimensions {asked} is not one this model was trained for; give one of {allowed}"
        )
    return asked


def finish_embedding(pooled: Sequence[float], size: int, normalize: bool = True) -> np.ndarray:
    """The first `size` values of a pooled vector (float32), normalised to unit length
    if asked (in float64, then rounded)."""
    vector = np.asarray(pooled[:size], dtype=np.float64)
    if normalize:
        norm = float(np.linalg.norm(vector))
        if norm > 0.0:
            vector = vector / norm
    return vector.astype(np.float32)
