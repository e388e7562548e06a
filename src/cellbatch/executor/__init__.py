"""Executors: what runs a packed step of many sessions through the model (docs/design.md#executors).

Owns: the `Executor` protocol, the one contract between the runner and anything
that computes tokens (the module executor, the program executor, test fakes).
Promises: every method is called on the runner's engine thread only, so an
executor needs no locking of its own.
Never: schedules work, keeps generation state or calls back into the runner.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cellbatch.generation_config import SamplingParams
from cellbatch.types import BatchInput, BatchOutput, KVUsage, SessionId


@runtime_checkable
class Executor(Protocol):
    """Sessions over a shared KV cache, and the forward that advances them.

    `execute` answers `outputs[i]` for `inputs[i]`: None exactly where the input
    asks for no output, else the session's next token (several only for a
    speculative executor: the accepted run, already fed, plus its next
    prediction). An input starting below the session's committed length rewinds
    the session to that start; one starting above it is an error. An exception
    means the whole batch failed; its message says why.
    """

    def initialize(self) -> None:
        """Load and allocate; raises on failure. Called once, before anything else."""

    def open_session(self) -> SessionId | None:
        """A new empty session, or None when no more sessions fit."""

    def close_session(self, sid: SessionId) -> None:
        """Release the session and its cells; unknown ids are ignored."""

    def clone(self, source: SessionId, upto: int) -> SessionId | None:
        """A new session holding `source`'s positions [0, upto); None if refused."""

    def truncate(self, sid: SessionId, length: int) -> None:
        """Drop the session's positions >= length (0: all of them), freeing the cells
        no other session shares; its sampling policy and random stream stay."""

    def set_sampling(self, sid: SessionId, params: SamplingParams, seed: int | None) -> None:
        """Install the policy of the session's next generation; None seeds randomly."""

    def set_adapter(self, sid: SessionId, adapter: int) -> None:
        """Install the LoRA adapter id of the session's next generation (0, NO_ADAPTER:
        the base model alone); InvalidArgumentError where it cannot run that adapter."""

    def execute(self, batch: BatchInput) -> BatchOutput:
        """Run one packed step; raises when the whole batch failed."""

    def kv_usage(self) -> KVUsage | None:
        """The KV cells right now; None when there is no cell limit (admission off)."""
