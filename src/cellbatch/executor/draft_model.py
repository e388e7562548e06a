"""A draft model: a smaller model with the same tokenizer proposes the drafts
(docs/design.md#speculative-decoding).

Owns: the draft model's own executor (its own cell cache and KV pool), a draft session
per target session that has speculated, and how far each draft session agrees with its
target (`_valid`: the leading positions it holds with the target's tokens).
Promises: the draft sessions follow the target's: a rewind or truncation of the target
drops what the draft held beyond it, a clone shares the source's draft cells up to the
clone's boundary, a close frees them. A proposal catches every requesting session up on
what its target holds (the whole context the first time), then drafts greedily, all
requesting sessions in one packed forward per drafted position. A draft step that
fails (its cells run out, say) drops every draft session and proposes nothing: the
target decodes without drafts and never sees the failure.
Never: touches the target's cells, or samples anything but the draft's own argmax.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from cellbatch.executor.cell_executor import CellExecutor
from cellbatch.executor.drafting import Draft, DraftRequest
from cellbatch.types import BatchInput, Input, SessionId, Token

log = logging.getLogger(__name__)


class ModelDrafter:
    """Drafts with `executor`'s model, greedily (its sessions have no sampling policy)."""

    method = "draft_model"

    def __init__(self, executor: CellExecutor) -> None:
        self.executor = executor
        self._sessions: dict[SessionId, SessionId] = {}  # target session -> draft session
        self._valid: dict[SessionId, int] = {}  # target session -> positions that agree
        self._ahead: dict[SessionId, Draft] = {}  # drafts fed after the valid positions
        self._failed = False

    def initialize(self) -> None:
        self.executor.initialize()

    # -- following the target ----------------------------------------------------------

    def forget(self, sid: SessionId, length: int) -> None:
        """Drops the draft's positions from `length` on (its cells too, at once)."""
        draft = self._sessions.get(sid)
        if draft is None:
            return
        if length < self._valid[sid]:
            self._valid[sid] = length
            self._ahead.pop(sid, None)
        if self.executor.position(draft) > length:
            self.executor.truncate(draft, length)
            self._ahead.pop(sid, None)

    def accepted(self, sid: SessionId, length: int) -> None:
        """The drafts fed ahead of the valid positions are the target's tokens up to
        `length` now (the accepted ones are exactly those drafts)."""
        if sid in self._valid:
            ahead = self._ahead.pop(sid, ())
            self._valid[sid] = min(self._valid[sid] + len(ahead), length)

    def clone(self, source: SessionId, clone: SessionId, upto: int) -> None:
        draft = self._sessions.get(source)
        if draft is None:
            return
        shared = min(upto, self._valid[source])
        copied = self.executor.clone(draft, shared)
        if copied is not None:
            self._sessions[clone], self._valid[clone] = copied, shared

    def close(self, sid: SessionId) -> None:
        draft = self._sessions.pop(sid, None)
        self._valid.pop(sid, None)
        self._ahead.pop(sid, None)
        if draft is not None:
            self.executor.close_session(draft)

    # -- drafting ------------------------------------------------------------------------

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        try:
            return self._propose(requests)
        except Exception:
            if not self._failed:
                log.exception("the draft model failed; its sessions start over")
                self._failed = True
            for sid in list(self._sessions):
                self.close(sid)
            return [() for _ in requests]

    def _propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        catch_up: list[tuple[int, Input]] = []
        for index, request in enumerate(requests):
            draft = self._session(request.sid)
            if draft is None:
                continue
            held = self.executor.position(draft)
            # Feed what the target holds beyond what agrees, always at least its last token.
            start = min(self._valid[request.sid], len(request.context) - 1)
            if held > start:
                self.executor.truncate(draft, start)
            feed = tuple(int(token) for token in request.context[start:])
            catch_up.append((index, Input(draft, True, 0, len(feed), feed, start)))
        drafts: list[list[Token]] = [[] for _ in requests]
        # Position by position: one packed forward over every session still drafting.
        pending = catch_up
        while pending:
            outputs = self.executor.execute(BatchInput(tuple(inp for _, inp in pending)))
            following = []
            for (index, inp), output in zip(pending, outputs.outputs, strict=True):
                assert output is not None
                token = output.tokens[0]
                drafts[index].append(token)
                if len(drafts[index]) < requests[index].limit:
                    end = inp.start + inp.size
                    following.append((index, Input(inp.sid, True, 0, 1, (token,), end)))
            pending = following
        for index, request in enumerate(requests):
            if request.sid in self._valid:
                self._valid[request.sid] = len(request.context)
                self._ahead[request.sid] = tuple(drafts[index][:-1])  # fed; the last is not
        return [tuple(draft) for draft in drafts]

    def _session(self, sid: SessionId) -> SessionId | None:
        """The target session's draft session, opened on its first draft (None: the
        draft executor has no session free; the target decodes without drafts)."""
        draft = self._sessions.get(sid)
        if draft is None:
            draft = self.executor.open_session()
            if draft is None:
                return None
            self._sessions[sid], self._valid[sid] = draft, 0
        return draft
