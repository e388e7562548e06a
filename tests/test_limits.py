"""The engine's limits (cellbatch.engine.limits): the KV pool's cap from the model and the
memory the machine has, and the refusals, with their numbers, when it cannot fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cellbatch.engine.limits import GIB, EngineShape, KVMemory, resolve_limits
from cellbatch.kv_format import kv_bytes_per_cell
from cellbatch.types import InvalidArgumentError
from tiny_models import head_geometry

# An 8B-shaped model: 32 layers, 8 KV heads of 128: 128 KiB per bf16 cell, 66 KiB int8.
GEOMETRY = dataclasses.replace(
    head_geometry(num_heads=32, num_kv_heads=8, head_dim=128),
    num_layers=32,
    layer_windows=(None,) * 32,
    max_positions=131072,
)
BF16_CELL = kv_bytes_per_cell(32, 8, 128, torch.bfloat16)


def test_without_memory_the_pool_holds_every_session_at_its_longest() -> None:
    limits = resolve_limits(EngineShape(max_sessions=4), GEOMETRY, torch.bfloat16)
    assert limits.max_cells == 4 * limits.max_session_tokens


def test_the_default_cap_is_what_memory_leaves_after_reserve_and_growth() -> None:
    memory = KVMemory(available_bytes=12 * GIB, total_bytes=24 * GIB)
    assert memory.reserve_bytes == 24 * GIB // 10
    limits = resolve_limits(EngineShape(), GEOMETRY, torch.bfloat16, memory)
    expected = (12 * GIB - 24 * GIB // 10) * 2 // 3 // BF16_CELL
    assert limits.max_cells == expected < 64 * limits.max_session_tokens
    assert limits.max_cells * BF16_CELL <= memory.available_bytes
    # int8 K/V: about twice the cells in the same memory.
    int8 = resolve_limits(EngineShape(), GEOMETRY, torch.int8, memory)
    assert int8.max_cells == pytest.approx(2 * expected * 128 / 132, rel=1e-3)
    # Room for every session: the sessions decide.
    small = resolve_limits(EngineShape(max_sessions=2), GEOMETRY, torch.bfloat16, memory)
    assert small.max_cells == 2 * small.max_session_tokens


def test_an_asked_max_cells_that_cannot_fit_is_refused_with_the_numbers_and_the_fix() -> None:
    memory = KVMemory(available_bytes=4 * GIB, total_bytes=8 * GIB)
    fit = (4 * GIB - GIB) * 2 // 3 // BF16_CELL
    assert resolve_limits(EngineShape(max_cells=fit), GEOMETRY, torch.bfloat16, memory)
    with pytest.raises(InvalidArgumentError) as refused:
        resolve_limits(EngineShape(max_cells=fit + 1), GEOMETRY, torch.bfloat16, memory)
    message = str(refused.value)
    for words in (
        f"max_cells={fit + 1}",
        f"{BF16_CELL} bytes per cell of bfloat16",
        "4.00 GiB of 8.00 GiB available",
        "1.00 GiB kept",
        f"at most {fit}",
        "kv_dtype int8",
    ):
        assert words in message, (words, message)


def test_a_machine_with_no_room_for_one_step_is_refused_before_the_engine_starts() -> None:
    memory = KVMemory(available_bytes=GIB + 10 * 2**20, total_bytes=4 * GIB)
    with pytest.raises(InvalidArgumentError, match="no memory is left for the KV pool"):
        resolve_limits(EngineShape(), GEOMETRY, torch.bfloat16, memory)


def test_on_a_gpu_the_pool_s_memory_is_the_device_s_free_memory(monkeypatch) -> None:
    """The pool lives where the model runs: on a GPU its free memory (the weights are on
    it already) bounds the pool, not the host's."""
    from types import SimpleNamespace

    from cellbatch.engine import loader

    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 30 * GIB, 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(loader, "read_memory", lambda: pytest.fail("read the host's memory"))
    backend = SimpleNamespace(device=torch.device("cuda", 1), mapped_weights_bytes=0)
    assert loader.machine_kv_memory(backend) == KVMemory(30 * GIB, 80 * GIB)
    assert asked == [torch.device("cuda", 1)]


def test_a_draft_model_s_cache_counts_against_the_same_memory(monkeypatch) -> None:
    """A draft model keeps a cell of its own beside each of the pool's: the cap fits the
    two together, a refusal says so, and the draft's mapped weights are not free memory."""
    from types import SimpleNamespace

    from cellbatch.engine import loader
    from cellbatch.machine import MemoryInfo

    memory = KVMemory(available_bytes=12 * GIB, total_bytes=24 * GIB)
    draft_cell = kv_bytes_per_cell(8, 4, 64, torch.bfloat16)
    alone = resolve_limits(EngineShape(), GEOMETRY, torch.bfloat16, memory)
    drafted = resolve_limits(EngineShape(), GEOMETRY, torch.bfloat16, memory, draft_cell)
    assert drafted.max_cells == memory.pool_bytes // (BF16_CELL + draft_cell) < alone.max_cells
    with pytest.raises(InvalidArgumentError, match="the draft model's cache included"):
        resolve_limits(
            EngineShape(max_cells=alone.max_cells), GEOMETRY, torch.bfloat16, memory, draft_cell
        )
    monkeypatch.setattr(
        loader, "read_memory", lambda: MemoryInfo(total_bytes=24 * GIB, available_bytes=10 * GIB)
    )
    target = SimpleNamespace(device=torch.device("cpu"), mapped_weights_bytes=GIB)
    draft = SimpleNamespace(device=torch.device("cpu"), mapped_weights_bytes=GIB // 2)
    assert loader.machine_kv_memory(target, draft).available_bytes == 10 * GIB - GIB - GIB // 2
