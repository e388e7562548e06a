"""The Files, Batch and Embeddings APIs wired for one app: their settings, their parts and
their life beside the server's.

Owns: `BatchSettings` (`--max-file-bytes`, `--max-batch-lines`, `--batch-concurrency`,
`--embedding-pooling`) and `BatchFeatures`, which builds, on the app's storage (SQLite
under `--data-dir`; without one, in memory), the file store (the files' bytes under the
data folder; without one, a temporary folder that goes with the server), the batch
store, the embedder,
the line runner and the batch worker, gives the app their routers and request bodies,
and starts and stops the worker with the app.
Promises: the worker starts (resuming every unfinished batch) each time the app starts,
and stops before the backend closes, so that no line is answered from a generation the
server's own stop cut short; batch lines hold at most `concurrency` sessions (by
default three quarters of the engine's), which leaves interactive requests sessions to
start on.
Never: answers a request itself (the routers do).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter
from pydantic import BaseModel

from cellbatch.server.api import Backend
from cellbatch.server.batch_lines import LineRunner
from cellbatch.server.batch_protocol import BatchCreateRequest
from cellbatch.server.batch_store import BatchStore
from cellbatch.server.batch_worker import BatchWorker
from cellbatch.server.batches_api import batches_router
from cellbatch.server.embeddings_api import Embedder, EmbeddingRequest, embeddings_router
from cellbatch.server.file_store import FileStore
from cellbatch.server.files_api import files_router
from cellbatch.server.planner import RequestPlanner
from cellbatch.server.responses import Responses
from cellbatch.server.storage import Storage


@dataclass(frozen=True)
class BatchSettings:
    max_file_bytes: int = 200 * 1024 * 1024  # OpenAI's limit on a batch file
    max_batch_lines: int = 50_000  # OpenAI's limit on a batch's requests
    concurrency: int | None = None  # sessions batch lines hold at once (None: 3/4)
    embedding_pooling: str = "last"  # "last" or "mean"


def default_concurrency(max_sessions: int) -> int:
    """Three quarters of the sessions (at least one), the rest left to interactive work."""
    return max(1, max_sessions - max(1, max_sessions // 4))


class BatchFeatures:
    def __init__(
        self,
        settings: BatchSettings,
        storage: Storage,
        data_dir: Path | None,
        backend: Backend,
        planner: RequestPlanner,
        responses: Responses,
        names: tuple[str, ...],
        max_request_bytes: int,
    ) -> None:
        self.settings = settings
        self._temporary: tempfile.TemporaryDirectory[str] | None = None
        folder = data_dir
        if folder is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="cellbatch-files-")
            folder = Path(self._temporary.name)
        self.storage = storage
        self.files = FileStore(self.storage, folder / "files")
        self.batches = BatchStore(self.storage, self.files)
        self.embedder = Embedder(backend, planner, names[0], names, settings.embedding_pooling)
        lines = LineRunner(backend, planner, responses, self.embedder, names)
        concurrency = settings.concurrency or default_concurrency(backend.shape.max_sessions)
        self.worker = BatchWorker(self.batches, self.files, lines, concurrency)
        self._routers = [
            files_router(self.files, self.batches, settings.max_file_bytes),
            batches_router(
                self.batches,
                self.files,
                self.worker,
                names[0],
                settings.max_batch_lines,
                max_request_bytes,
            ),
            embeddings_router(self.embedder, max_request_bytes),
        ]

    def routers(self) -> list[APIRouter]:
        return self._routers

    @staticmethod
    def request_bodies() -> dict[str, type[BaseModel]]:
        """The JSON bodies its routes read themselves, for the published schema."""
        return {"/v1/batches": BatchCreateRequest, "/v1/embeddings": EmbeddingRequest}

    def start(self) -> None:
        self.worker.start()

    async def stop(self) -> None:
        """Stop the worker. The storage stays open (an app may be started again, as
        schemathesis does around each request); a temporary folder goes with this object."""
        await self.worker.stop()
