"""Fixtures for `cellbatch serve` tests: a tiny random Llama carrying the default
model's tokenizer and chat template, and live servers over it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from served import CONTEXT, LiveServer, start_live_server
from tiny_models import make_tiny_chat_checkpoint


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_checkpoint(tmp_path_factory.mktemp("served") / "llama", CONTEXT)


@pytest.fixture(scope="session")
def start_server(tiny_chat_model: Path) -> Iterator[Callable[..., LiveServer]]:
    """start_server(**options) -> a live server over the tiny model, stopped at the end
    of the session (options: api_key, max_queued_requests, Engine.from_pretrained's)."""
    started: list[LiveServer] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread costs more than it gives

    def start(**options: object) -> LiveServer:
        started.append(start_live_server(tiny_chat_model, **options))  # type: ignore[arg-type]
        return started[-1]

    yield start
    for live in started:
        live.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def live(start_server: Callable[..., LiveServer]) -> LiveServer:
    """The shared server: prefix cache on, as `cellbatch serve` runs by default."""
    return start_server(prefix_cache_entries=8)
