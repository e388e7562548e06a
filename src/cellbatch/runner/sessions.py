"""The runner's book of open sessions (engine thread only).

Owns: the engine-side record (`SessionRecord`) of every session open on the executor,
the snapshot cache, and the executor calls that open, copy, truncate and close sessions.
Promises: a state is in the book iff its executor session is open; a copy shares
the source's cells for the tokens the source holds and feeds the rest later; a
session whose face closed it stays open while waiting submissions still start from
it, and the last of them takes it over instead of copying it; a submission whose
prompt matches a snapshot starts from its cells whenever the snapshot holds a session
(copied, or taken over when no session is free); every session opened
is counted once, and every refused request from a caller (a submission that waits
for a session is not refused), as events recorded in the ledger it is given.
Never: ends generations or touches the scheduler (the runner loop does); holds the
metrics or their lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from cellbatch.executor import Executor
from cellbatch.runner.generation import (
    MIXED_ADAPTERS,
    ContextSource,
    Generation,
    SessionRecord,
)
from cellbatch.runner.metrics_ledger import (
    MetricsLedger,
    PrefixCacheHit,
    SessionOpened,
    SessionRefused,
)
from cellbatch.runner.snapshots import SnapshotCache
from cellbatch.types import SessionId

log = logging.getLogger(__name__)


class SessionBook:
    def __init__(
        self,
        executor: Executor,
        ledger: MetricsLedger,
        snapshots: int = 0,
    ) -> None:
        self._executor = executor
        self._ledger = ledger
        self._states: dict[SessionId, SessionRecord] = {}
        # Finished submissions kept for their prefix; 0 entries: the cache is off.
        self._snapshots = SnapshotCache(snapshots)

    def __len__(self) -> int:
        return len(self._states)

    def get(self, sid: SessionId) -> SessionRecord | None:
        return self._states.get(sid)

    def states(self) -> Iterable[SessionRecord]:
        return list(self._states.values())

    def open(self) -> SessionRecord | None:
        """A new empty session; None when the executor has no room."""
        return self._add(self._executor.open_session(), 0, ())

    def copy(self, source: SessionRecord, upto: int) -> SessionRecord | None:
        """A new session holding `source`'s first `upto` context tokens, sharing the
        cells `source` has for them; None when the executor refuses."""
        shared = min(upto, source.computed)
        state = self._add(self._executor.clone(source.sid, shared), shared, source.context[:upto])
        if state is not None:
            state.committed = min(upto, source.committed)
            state.adapter = source.adapter  # what its shared cells were computed under
        return state

    def count(self, state: SessionRecord | None) -> SessionRecord | None:
        """Count a caller's request for a session as granted or refused."""
        self._ledger.record(SessionRefused() if state is None else SessionOpened())
        return state

    def for_submission(self, generation: Generation) -> SessionRecord | None:
        """The session a submission runs on (opened, copied from its source, or its
        closed source taken over); None when the executor has no session free."""
        start = generation.start
        assert start is not None
        source = start.source
        if source is None:
            state = self._from_snapshot(generation)
            if state is None:
                state = self.open()
                while state is None and (oldest := self._snapshots.pop_oldest()) is not None:
                    self.close(oldest)  # a snapshot gives its session slot to live work
                    state = self.open()
                self._count_granted(state)
        elif source.close_requested and source.clone_waiters == 1 and source.active is None:
            state = self._take_over(source, start.upto)
        else:
            state = self._count_granted(self.copy(source, start.upto))
        if state is not None:
            self.release_source(generation)
        return state

    def _count_granted(self, state: SessionRecord | None) -> SessionRecord | None:
        """Count a session opened for a submission (one still waiting is not refused)."""
        if state is not None:
            self.count(state)
        return state

    def finished(self, state: SessionRecord, reusable: bool) -> None:
        """A submission's session after its generation: kept as a snapshot of what its
        cells hold when the cache is on and the session is `reusable`, else closed."""
        unkeyable = state.adapter == MIXED_ADAPTERS
        if not reusable or self._snapshots.capacity == 0 or state.computed == 0 or unkeyable:
            self.close(state)
            return
        del state.context[state.computed :]
        state.committed = state.computed
        for evicted in self._snapshots.keep(state):
            self.close(evicted)

    def _from_snapshot(self, generation: Generation) -> SessionRecord | None:
        """The snapshot sharing the longest prefix with the prompt, copied or taken
        over (a take-over opens no session and counts none); the generation then feeds
        only the rest."""
        sampling = generation.config.sampling
        if sampling.prompt_logprobs is not None or sampling.pooling is not None:
            return None  # every prompt token must run through the model, scored or pooled
        found = self._snapshots.longest_prefix(generation.delta, generation.adapter_id)
        if found is None:
            return None
        snapshot, matched = found
        state = self.copy(snapshot, matched)
        # No session free for the copy: the other snapshots give their slots, oldest
        # first (the match is the most recently used: it stays); when it is the last,
        # the submission takes it over. With every slot busy (as many streaming
        # clients as sessions) a finished request's session is what the next one finds.
        while state is None and len(self._snapshots) > 1:
            oldest = self._snapshots.pop_oldest()
            assert oldest is not None and oldest is not snapshot
            self.close(oldest)
            state = self.copy(snapshot, matched)
        if state is None:
            self._snapshots.remove(snapshot)
            state = self._take_over(snapshot, matched)
        else:
            self.count(state)
        generation.delta = generation.delta[matched:]
        generation.metrics.cached_tokens = matched
        self._ledger.record(PrefixCacheHit(matched))
        return state

    def hold_source(self, generation: Generation) -> None:
        """A waiting submission needs its source until it has its own session."""
        start = generation.start
        if start is not None and start.source is not None:
            start.source.clone_waiters += 1
            generation.queued_on_source = True

    def release_source(self, generation: Generation) -> None:
        """The submission no longer needs its source: the source closes if its face
        asked for that and no other submission waits on it."""
        if not generation.queued_on_source:
            return
        generation.queued_on_source = False
        source = _source_of(generation.start)
        source.clone_waiters -= 1
        if source.clone_waiters == 0 and source.close_requested:
            self.close(source)

    def close_when_free(self, state: SessionRecord) -> None:
        """The face closed the session: close it now, or once no waiting submission
        starts from it."""
        state.close_requested = True
        if state.clone_waiters == 0:
            self.close(state)

    def close(self, state: SessionRecord) -> None:
        if state.closed:
            return
        self._snapshots.remove(state)
        state.closed = True
        self._states.pop(state.sid, None)
        try:
            self._executor.close_session(state.sid)
        except Exception:
            log.exception("executor.close_session(%d) raised", state.sid)

    def reclaim(self, state: SessionRecord) -> None:
        """Free an idle session's cells for others: a snapshot goes (it exists only
        for its cells), any other session keeps its context to feed again later."""
        if state in self._snapshots:
            self.close(state)
        else:
            self.drop_cells(state)

    def drop_cells(self, state: SessionRecord, length: int = 0) -> None:
        """Keep only the session's first `length` positions in cells (cells it shares
        stay with the other owners); its next turn feeds the rest again."""
        self._executor.truncate(state.sid, length)
        state.computed = length

    def idle_victim(
        self, is_running: Callable[[Generation], bool], exclude: SessionRecord | None
    ) -> SessionRecord | None:
        """The session whose cells go first: the least recently used snapshot, else the
        least recently used session holding cells with no running generation, that no
        waiting submission starts from."""
        oldest = self._snapshots.oldest()
        if oldest is not None and oldest is not exclude:
            return oldest
        candidates = [
            state
            for state in self._states.values()
            if state.computed > 0
            and state is not exclude
            and state.clone_waiters == 0
            and (state.active is None or not is_running(state.active))
        ]
        return min(candidates, key=lambda state: state.last_used, default=None)

    def _take_over(self, source: SessionRecord, upto: int) -> SessionRecord:
        if upto < source.computed:
            self.drop_cells(source, upto)
        del source.context[upto:]
        source.committed = min(source.committed, upto)
        source.close_requested = False
        return source

    def _add(
        self, sid: SessionId | None, computed: int, context: Iterable[int]
    ) -> SessionRecord | None:
        if sid is None:
            return None
        state = SessionRecord(sid, list(context), computed)
        self._states[sid] = state
        return state


def _source_of(start: ContextSource | None) -> SessionRecord:
    assert start is not None and start.source is not None
    return start.source
