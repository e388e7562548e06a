"""Executors: what runs a packed step of many sessions through the model (DESIGN §6).

Owns: the `Executor` protocol, the one contract between the runner and anything
that computes tokens (the module executor, the program executor, test fakes).
Promises: every method is called on the runner's engine thread only, so an
executor needs no locking of its own.
Never: schedules work, keeps generation state or calls back into the runner.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cellbatch.types import BatchInput, BatchOutput, SamplingParams, SessionId


@runtime_checkable
class Executor(Protocol):
    """Sessions over a shared KV cache, and the forward that advances them.

    `execute` answers `outputs[i]` for `inputs[i]`: None exactly where the input
    asks for no output, else the session's next token (several only for a
    speculative executor: the accepted run, already fed, plus its next
    prediction). An input starting below the session's committed length rewinds
    the session to that start; one starting above it is an error. None (or an
    exception) means the whole batch failed. An executor may also carry a
    `last_error: str` attribute saying why its last batch failed.
    """

    def initialize(self) -> None:
        """Load and allocate; raises on failure. Called once, before anything else."""

    def open_session(self) -> SessionId | None:
        """A new empty session, or None when no more sessions fit."""

    def close_session(self, sid: SessionId) -> None:
        """Release the session and its cells; unknown ids are ignored."""

    def clone(self, source: SessionId, upto: int) -> SessionId | None:
        """A new session holding `source`'s positions [0, upto); None if refused."""

    def set_sampling(self, sid: SessionId, params: SamplingParams, seed: int | None) -> None:
        """Install the policy of the session's next generation; None seeds randomly."""

    def preferred_batch_tokens(self) -> int:
        """The step width the executor runs best at (a hint for the scheduler)."""

    def execute(self, batch: BatchInput) -> BatchOutput | None:
        """Run one packed step; None (or an exception) fails the whole batch."""

    def free_cells(self) -> int | None:
        """KV cells free right now; None when there is no cell limit (admission off)."""
