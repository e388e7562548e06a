"""Fixtures for the replica tests: the tiny chat model of the server tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from cellbatch.distributed.cluster import import_ray
from served import CONTEXT
from tiny_models import make_tiny_chat_checkpoint

# Before anything here imports Ray: the local Ray instances of these tests then stay on
# the loopback interface.
import_ray(local=True)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_checkpoint(tmp_path_factory.mktemp("replicated") / "llama", CONTEXT)
