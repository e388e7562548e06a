"""Fixtures for `cellbatch serve` tests: a tiny random Llama carrying the default
model's tokenizer and chat template, and live servers over it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from served import CONTEXT, LiveServer, start_live_server
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    from cellbatch.model.default import default_model_path

    gguf = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    folder = tmp_path_factory.mktemp("served") / "llama"
    make_tiny_checkpoint(
        "llama",
        folder,
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=CONTEXT,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    tokenizer.save_pretrained(folder)
    return folder


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
