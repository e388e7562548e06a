"""Shared fixtures for the model tests: tiny random transformers checkpoints, and a
driver that runs packed steps through CellCache + KVPool the way an executor would."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from cellbatch.cache import CellCache
from cellbatch.kv_pool import KVPool
from cellbatch.model import kernels, ops
from cellbatch.model.adapters import AdapterBank
from cellbatch.model.transformer import PackedTransformer
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def compiled_ops() -> ops.Ops:
    """The compiled ops' table. On the project's machines the kernels must be there: a
    missing library fails the test (not a skip), so a broken build cannot hide behind the
    fallback; CELLBATCH_KERNELS=0 is the one way to skip."""
    if kernels.disabled():
        pytest.skip("CELLBATCH_KERNELS=0")
    assert kernels.load(), kernels.unavailable_reason()
    return ops.table(ops.NAMESPACE)


@pytest.fixture(scope="session")
def torch_ops() -> ops.Ops:
    """The pure-torch ops' table."""
    return ops.table(ops.TORCH_NAMESPACE)


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., tuple[object, Path]]:
    """make(kind, **config overrides) -> (transformers model in fp32, its saved folder)."""

    def make(kind: str, max_shard_size: str | None = None, **overrides: object):
        return make_tiny_checkpoint(
            kind, tmp_path / kind, max_shard_size=max_shard_size, **overrides
        )

    return make


def run_steps(
    model: PackedTransformer,
    steps: Sequence[Sequence[tuple[int, Sequence[int]]]],
    num_sequences: int,
    kv_dtype: torch.dtype = torch.float32,
    adapters: tuple[AdapterBank, Sequence[int]] | None = None,
) -> list[torch.Tensor]:
    """Runs packed steps; each step is a list of (sequence index, tokens) in token-axis
    order. Returns every step's logits for all its rows. `adapters` (bank, ids): the
    rows of sequence i run with the bank's adapter ids[i] (0: none)."""
    config = model.config
    cache = CellCache(capacity=4096)
    pool = KVPool(
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        capacity=4096,
        dtype=kv_dtype,
        initial_cells=8,
    )
    seqs = [cache.seq_alloc() for _ in range(num_sequences)]
    lengths = [0] * num_sequences
    results = []
    for step in steps:
        tokens, seq_ids, positions = [], [], []
        for index, chunk in step:
            tokens += list(chunk)
            seq_ids += [seqs[index]] * len(chunk)
            positions += range(lengths[index], lengths[index] + len(chunk))
            lengths[index] += len(chunk)
        seq_ids_np, positions_np = np.array(seq_ids), np.array(positions)
        assert cache.declare_step(seq_ids_np)
        cells = cache.place_step(seq_ids_np, positions_np)
        pool.ensure(cache.high_water())
        plan = cache.attention_plan(seq_ids_np, positions_np, cells)
        lora = None
        if adapters is not None:
            bank, ids = adapters
            lora = bank.step(
                np.repeat([ids[index] for index, _ in step], [len(c) for _, c in step])
            )
        with torch.no_grad():
            logits = model(
                torch.tensor(tokens),
                torch.tensor(positions),
                plan,
                pool,
                torch.from_numpy(cells),
                torch.arange(len(tokens)),
                lora,
            )
        results.append(logits)
    return results


@pytest.fixture
def packed_steps() -> Callable[..., list[torch.Tensor]]:
    return run_steps


def schedule(
    prompts: Sequence[Sequence[int]], decodes: Sequence[int], order: Sequence[int], chunk: int
) -> tuple[list[list[tuple[int, list[int]]]], list[slice]]:
    """Steps that feed each sequence in `order` its prompt in chunks of at most `chunk`,
    then the `decodes` tokens one per step; also, per step, the rows of sequence 0."""
    steps, rows_of_first = [], []
    fed = dict.fromkeys(order, 0)
    sequences = {i: list(prompts[i]) + list(decodes) for i in order}
    while any(fed[i] < len(sequences[i]) for i in order):
        step, rows, width = [], slice(0, 0), 0
        for i in order:
            prompt_left = len(prompts[i]) - fed[i]
            size = min(chunk, prompt_left) if prompt_left > 0 else 1
            tokens = sequences[i][fed[i] : fed[i] + size]
            if tokens:
                step.append((i, tokens))
                if i == 0:
                    rows = slice(width, width + len(tokens))
                width += len(tokens)
                fed[i] += len(tokens)
        steps.append(step)
        rows_of_first.append(rows)
    return steps, rows_of_first


@pytest.fixture
def first_sequence_logits() -> Callable[..., torch.Tensor]:
    """(model, prompts, decodes, order, chunk, kv_dtype=float32) -> logits of every token
    of sequence 0, in position order, when the sequences of `order` are scheduled
    together."""

    def run(model, prompts, decodes, order, chunk, kv_dtype=torch.float32) -> torch.Tensor:
        steps, rows = schedule(prompts, decodes, order, chunk)
        results = run_steps(model, steps, len(prompts), kv_dtype)
        return torch.cat([r[rows_of] for r, rows_of in zip(results, rows, strict=True)])

    return run
