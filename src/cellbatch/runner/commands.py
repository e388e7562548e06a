"""The runner's inbox: typed commands from any thread to the engine thread.

Owns: the command dataclasses and `Inbox`, the one FIFO queue between the faces
(`Session`, `GenerationHandle`, `Runner`'s public methods) and the engine thread.
Promises: `post` is safe from any thread, also re-entrantly (a Session finalizer
may post while another post is under way on the same thread); commands leave in
the order they were posted; once closed, `post` refuses (returns False) and the
closing outcome says how refused work ends.
Never: runs a command itself; only the engine thread takes commands out.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cellbatch.types import FinishReason

if TYPE_CHECKING:
    from cellbatch.runner.generation import Generation, SessionRecord

# Resolves to a `Session` face, or None. `Session` lives in runner.session, which posts
# these commands: naming it here would be an import cycle.
SessionFuture = concurrent.futures.Future[Any]


@dataclass(frozen=True)
class OpenSession:
    future: SessionFuture


@dataclass(frozen=True)
class CloneSession:
    source: SessionRecord
    upto: int
    future: SessionFuture


@dataclass(frozen=True)
class StartGeneration:
    """A turn on an existing session, or (with no session) a submitted generation
    that waits for a session of its own."""

    generation: Generation


@dataclass(frozen=True)
class CancelGeneration:
    generation: Generation


@dataclass(frozen=True)
class CloseSession:
    state: SessionRecord


@dataclass(frozen=True)
class Sync:
    """Answered once every command posted before it has been applied and the published
    KV figures count what those commands (and the settlements before them) released."""

    future: concurrent.futures.Future[None]


@dataclass(frozen=True)
class Wake:
    """Nothing to do: makes an idle engine look at its stop flag at once."""


Command = (
    OpenSession | CloneSession | StartGeneration | CancelGeneration | CloseSession | Sync | Wake
)


class Inbox:
    """FIFO of commands for the engine thread."""

    def __init__(self) -> None:
        # SimpleQueue because its put is reentrant (see the module docstring).
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.RLock()
        self._accepting = True
        self._closing_outcome = (FinishReason.CANCELLED, "the runner is shut down")

    def post(self, command: Command) -> bool:
        """Queue a command; False once the inbox is closed."""
        with self._lock:
            if not self._accepting:
                return False
            self._queue.put(command)
            return True

    def wake(self) -> None:
        """Wake the engine even after close (shutdown uses it)."""
        self._queue.put(Wake())

    def close(self, outcome: tuple[FinishReason, str]) -> None:
        """Refuse every later post; refused generations end with `outcome`."""
        with self._lock:
            self._closing_outcome = outcome
            self._accepting = False

    @property
    def closing_outcome(self) -> tuple[FinishReason, str]:
        return self._closing_outcome

    def get(self, timeout: float) -> Command | None:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def take_queued(self) -> list[Command]:
        """The commands queued now, in order; later posts wait for the next call, so a
        callback that keeps posting cannot starve the running generations."""
        commands = []
        for _ in range(self._queue.qsize()):
            try:
                commands.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return commands
