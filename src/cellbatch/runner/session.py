"""Session: a caller's face for one conversation.

Owns: nothing of the engine's; it holds the session's engine-side state (read
only), the inbox it posts to, and the runner's defaults for new generations.
Promises: thread-safe; every request (a turn, a prefill turn, a clone, a close)
is a typed command posted to the inbox; closing never waits; errors never raise
here, they come back as `failed` generations or None clones.
Never: reaches into the runner or the executor.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

from cellbatch.generation_config import GenConfig
from cellbatch.runner.commands import (
    CancelGeneration,
    CloneSession,
    CloseSession,
    Inbox,
    StartGeneration,
)
from cellbatch.runner.generation import (
    AdapterLookup,
    Generation,
    GenerationKind,
    SessionRecord,
    SettledCallback,
    UpdateCallback,
)
from cellbatch.runner.handle import GenerationHandle
from cellbatch.text_stream import Detokenizer
from cellbatch.types import FinishReason, SessionId, Token


@dataclass(frozen=True)
class TurnDefaults:
    """What a runner fills in for every generation: its stop tokens (for a
    `GenConfig` whose `stop_tokens` is None), its tokenizer (text, stop strings) and
    the LoRA adapters a config may name."""

    stop_tokens: frozenset[Token] = frozenset()
    tokenizer: Detokenizer | None = None
    adapters: AdapterLookup | None = None


def start_generation(
    generation: Generation,
    delta: Sequence[Token],
    inbox: Inbox | None,
    defaults: TurnDefaults,
) -> GenerationHandle:
    """Check a generation's input, bind its handle and post it; a refused post
    settles it at once (on this thread)."""
    generation.prepare(delta, defaults.stop_tokens, defaults.tokenizer, defaults.adapters)
    generation.handle._bind(
        generation, None if inbox is None else partial(inbox.post, CancelGeneration(generation))
    )
    if inbox is None or not inbox.post(StartGeneration(generation)):
        reason, error = (
            inbox.closing_outcome
            if inbox is not None
            else (FinishReason.FAILED, "session is not initialized")
        )
        generation.settle(reason, error)
    return generation.handle


class Session:
    """One conversation: its context persists across turns.

    A default-constructed Session is not opened; get real ones from
    `Runner.open_session_async()` or `Session.clone_async()`. Closing (by
    `close()`, leaving a `with` block, or dropping the last reference) queues the
    close and never waits; the active generation then ends `cancelled`.
    """

    def __init__(self) -> None:
        self._inbox: Inbox | None = None
        self._state: SessionRecord | None = None
        self._defaults = TurnDefaults()
        self._closer: weakref.finalize[[Inbox, SessionRecord], Session] | None = None
        self._closed = False

    @classmethod
    def _bind(cls, inbox: Inbox, state: SessionRecord, defaults: TurnDefaults) -> Session:
        session = cls()
        session._inbox, session._state, session._defaults = inbox, state, defaults
        # The finalizer holds the inbox and the state, never the Session itself.
        session._closer = weakref.finalize(session, _post_close, inbox, state)
        session._closer.atexit = False
        return session

    @property
    def id(self) -> SessionId | None:
        """The executor's id for this session (None for a session never opened)."""
        return None if self._state is None else self._state.sid

    def is_open(self) -> bool:
        return self._state is not None and not self._closed and not self._state.closed

    def position(self) -> int:
        """Committed context length: tokens the model has consumed for this session.
        Unfed tokens (see `unfed()`) are not counted."""
        return 0 if self._state is None else self._state.committed

    def unfed(self) -> tuple[Token, ...]:
        """Context tokens not fed to the model yet (usually the last generated
        token); the next turn feeds them before its delta."""
        return () if self._state is None else self._state.unfed()

    def generate_async(
        self,
        delta: Sequence[Token],
        config: GenConfig | None = None,
        on_update: UpdateCallback | None = None,
        on_settled: SettledCallback | None = None,
        *,
        adapter: str | None = None,
    ) -> GenerationHandle:
        """Start a turn: feed `delta` (after any unfed tokens), then generate.

        An empty delta is fine on a session that holds context: the turn then
        generates from where the context ends (after a prefill turn, say).
        `on_update(update)` and `on_settled(handle)` run on the engine thread; a
        raising on_update fails only this generation. Errors never raise here:
        they come back as a `failed` generation with a message. On a session
        that was never opened, or is closed, the handle settles before this
        returns (and the callbacks run on this thread). `adapter` (or the config's)
        names the LoRA adapter the turn runs with; the session's earlier cells stay as
        their turns computed them.
        """
        config = config if config is not None else GenConfig()
        if adapter is not None:
            config = replace(config, adapter=adapter)
        generation = Generation(config, on_update, on_settled, state=self._state)
        return self._start(generation, delta)

    def prefill_async(
        self,
        delta: Sequence[Token],
        on_settled: SettledCallback | None = None,
        *,
        adapter: str | None = None,
    ) -> GenerationHandle:
        """Start a prefill turn: feed `delta` (after any unfed tokens) and generate
        nothing. The handle settles `token_limit` with no tokens once the model has
        consumed the delta; then `position()` counts it, `clone_async` can share it,
        and `generate_async([])` on the session or a clone generates from it. `adapter`
        names the LoRA adapter the delta runs through."""
        # max_new_tokens=1 sizes the position checks: the last position fed is that of
        # the delta's last token, as for a one-token generation.
        generation = Generation(
            GenConfig(max_new_tokens=1, adapter=adapter),
            None,
            on_settled,
            kind=GenerationKind.PREFILL,
            state=self._state,
        )
        return self._start(generation, delta)

    def _start(self, generation: Generation, delta: Sequence[Token]) -> GenerationHandle:
        if self._state is not None and (self._closed or self._state.closed):
            generation.handle._bind(generation, None)
            generation.settle(FinishReason.CANCELLED, "session is closed")
            return generation.handle
        inbox = self._inbox if self._state is not None else None
        return start_generation(generation, delta, inbox, self._defaults)

    def clone_async(self, upto: int) -> concurrent.futures.Future[Session | None]:
        """A new idle session holding this one's committed prefix [0, upto), with
        no sampling policy. None when refused: upto < 0 or > position(), a
        poisoned or closed source, no clone support or no capacity. A clone
        queued before this session's close still runs."""
        future: concurrent.futures.Future[Session | None] = concurrent.futures.Future()
        if (
            self._inbox is None
            or self._state is None
            or not self.is_open()
            or not isinstance(upto, int)
            or upto < 0
            or not self._inbox.post(CloneSession(self._state, upto, future))
        ):
            future.set_result(None)
        return future

    def close(self) -> None:
        """Queue the close and return at once; idempotent."""
        self._closed = True
        if self._closer is not None:
            self._closer()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _post_close(inbox: Inbox, state: SessionRecord) -> None:
    inbox.post(CloseSession(state))
