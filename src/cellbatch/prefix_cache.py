"""Reuse of prompt prefixes through session cloning.

Owns: a caller-owned LRU of idle *snapshot* sessions, each keyed by the exact
token history it holds, and the sessions themselves (it closes the ones it
evicts or drops).
Promises: `lookup` hands back a fresh clone holding the longest cached prefix
of a request, capped one token short so that the request's last token always
runs through the model (its logits give the first new token); candidates are
tried longest first, then most recently used, each at most once, and a refused
clone moves on to the next snapshot; nothing is evicted or leaked when every
clone is refused. `insert` evicts least-recently-used entries only after a
successful insert.
Never: runs on the engine thread. `lookup` and `PromptCapture.collect` wait for
the engine, so call them from client threads, not from generation callbacks.

Typical use for one request with prompt `tokens`:

    hit = cache.lookup(tokens)
    session = hit.session if hit else runner.open_session_async().result()
    reused = hit.matched if hit else 0
    capture = cache.capture_prompt(session, tokens, on_update=my_callback)
    handle = session.generate_async(tokens[reused:], config, on_update=capture.on_update)
    handle.wait()
    capture.collect()  # the prompt's snapshot joins the cache
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from cellbatch.runner import Session, UpdateCallback
from cellbatch.types import GenerationUpdate, InvalidArgumentError, Token


@dataclass(frozen=True)
class PrefixHit:
    session: Session  # a new session holding the request's first `matched` tokens
    matched: int


@dataclass(frozen=True)
class _Snapshot:
    tokens: np.ndarray  # int64 copy of the key, for fast prefix comparison
    session: Session


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two token arrays share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """LRU of idle snapshot sessions keyed by their exact token history. Thread-safe."""

    def __init__(self, max_entries: int) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries <= 0:
            raise InvalidArgumentError(
                f"max_entries must be a positive integer, got {max_entries!r}"
            )
        self.max_entries = max_entries
        self._lock = threading.Lock()
        # Least recently used first.
        self._entries: OrderedDict[tuple[Token, ...], _Snapshot] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> list[tuple[Token, ...]]:
        """Cached histories, least recently used first."""
        with self._lock:
            return list(self._entries)

    def lookup(self, tokens: Sequence[Token], timeout: float | None = None) -> PrefixHit | None:
        """A clone holding the longest cached prefix of `tokens` (at most
        len(tokens) - 1 of them), or None when nothing matches or every matching
        snapshot refused to be cloned. `timeout` bounds each clone's wait."""
        request = np.asarray(tokens, dtype=np.int64)
        limit = len(request) - 1
        if limit < 1:
            return None
        with self._lock:
            candidates = []
            for recency, (key, snapshot) in enumerate(self._entries.items()):
                matched = min(common_prefix_length(snapshot.tokens, request), limit)
                if matched > 0:
                    candidates.append((matched, recency, key, snapshot.session))
        # Longest first; among equals, the most recently used first.
        candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
        for matched, _, key, snapshot in candidates:
            try:
                clone = snapshot.clone_async(matched).result(timeout)
            except Exception:
                clone = None  # an executor error or a timeout counts as a refusal
            if clone is None:
                continue  # the next snapshot, not a shorter boundary of this one
            with self._lock:
                if key in self._entries:
                    self._entries.move_to_end(key)
            return PrefixHit(clone, matched)
        return None

    def insert(self, tokens: Sequence[Token], session: Session) -> bool:
        """Cache `session` as the snapshot of `tokens` (it must hold exactly them).
        False for a duplicate: the cached entry becomes most recent and `session`
        is closed. Entries beyond `max_entries` are evicted (and closed), least
        recently used first."""
        key = tuple(int(t) for t in tokens)
        if session.position() != len(key) or session.unfed():
            raise InvalidArgumentError(
                f"a snapshot must hold exactly its tokens: the session holds "
                f"{session.position()} committed and {len(session.unfed())} unfed tokens, "
                f"but {len(key)} tokens were given; insert an idle clone taken at the "
                "prompt boundary (see capture_prompt)"
            )
        evicted: list[_Snapshot] = []
        with self._lock:
            existing = self._entries.get(key)
            if existing is not None:
                self._entries.move_to_end(key)
            else:
                self._entries[key] = _Snapshot(np.asarray(key, dtype=np.int64), session)
                while len(self._entries) > self.max_entries:
                    evicted.append(self._entries.popitem(last=False)[1])
        if existing is not None:
            if existing.session is not session:
                session.close()
            return False
        for snapshot in evicted:
            snapshot.session.close()
        return True

    def capture_prompt(
        self,
        session: Session,
        tokens: Sequence[Token],
        on_update: UpdateCallback | None = None,
    ) -> PromptCapture:
        """Arrange for a snapshot of `session` at the end of the prompt `tokens`
        (the session's whole context once the turn's delta is fed). Pass the
        returned capture's `on_update` to `generate_async`; call `collect()` once
        the generation has settled."""
        if len(tokens) < session.position() + len(session.unfed()):
            raise InvalidArgumentError(
                f"tokens ({len(tokens)}) must be the session's whole context after the "
                f"delta, but the session already holds "
                f"{session.position() + len(session.unfed())}"
            )
        return PromptCapture(self, session, tuple(int(t) for t in tokens), on_update)

    def clear(self) -> None:
        """Drop every entry and close its snapshot."""
        with self._lock:
            snapshots = list(self._entries.values())
            self._entries.clear()
        for snapshot in snapshots:
            snapshot.session.close()


class PromptCapture:
    """Takes a snapshot clone at the prompt boundary, then hands it to the cache once."""

    def __init__(
        self,
        cache: PrefixCache,
        session: Session,
        tokens: tuple[Token, ...],
        user_callback: UpdateCallback | None,
    ) -> None:
        self._cache = cache
        self._session: Session | None = session
        self._tokens = tokens
        self._user_callback = user_callback
        self._snapshot: Future[Session | None] | None = None
        self._collected = False
        self._lock = threading.Lock()

    def on_update(self, update: GenerationUpdate) -> None:
        """The generation's callback. On the first update with tokens the prompt
        has been consumed and nothing decoded yet: the clone queued here runs
        before the next forward, so it copies exactly the prompt. The user's
        callback runs afterwards and its exceptions propagate."""
        if self._session is not None and update.tokens:
            self._snapshot = self._session.clone_async(len(self._tokens))
            self._session = None  # at most one snapshot; no reference kept to the session
        if self._user_callback is not None:
            self._user_callback(update)

    def collect(self, timeout: float | None = None) -> bool:
        """Insert the snapshot into the cache; True if it joined. At most once:
        later calls return False."""
        with self._lock:
            if self._collected or self._snapshot is None:
                return False
            self._collected = True
            future, self._snapshot = self._snapshot, None
        try:
            snapshot = future.result(timeout)
        except Exception:
            return False
        if snapshot is None:
            return False
        return self._cache.insert(self._tokens, snapshot)
