"""Sessions over cache sequences: what every executor shares (DESIGN §6).

Owns: the map from session ids to `CellCache` sequences and each session's
sampling policy; `pack`, which lays a batch onto one token axis; `select_rows`,
the logits rows a forward over one slice of that axis must return; `sample`,
which draws every output row with its own session's policy in one call.
Promises: session ids are issued monotonically and never reused (cache sequence
ids may be); sessions are bounded by `max_sessions` (clones count) and each by
`max_session_tokens`; `pack` either succeeds or raises having changed nothing.
Never: places cells or runs the model (the executor declares and places each
slice); keeps tokens, which live in the cache as K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cellbatch.cache import CellCache
from cellbatch.executor.sampling import GREEDY_ROW, NUM_PARAMS, SessionSampler, sample_rows
from cellbatch.types import (
    MAX_POSITION,
    BatchInput,
    InvalidArgumentError,
    OutOfResourcesError,
    SamplingParams,
    SessionId,
    Token,
)


@dataclass
class PackedStep:
    """One batch on one token axis, inputs in order (all numpy int64).

    tokens/positions/seq_ids have one entry per token; logit_indices has one per
    input: the token-axis row of its last token where it produces output, else -1.
    """

    tokens: np.ndarray
    positions: np.ndarray
    seq_ids: np.ndarray
    logit_indices: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class _Session:
    seq: int
    sampler: SessionSampler | None = None  # None: no generation installed yet; samples greedily


class SessionTable:
    """Sessions, their cache sequences and sampling policies; packs batches."""

    def __init__(self, cache: CellCache, max_sessions: int, max_session_tokens: int) -> None:
        if max_sessions < 1:
            raise InvalidArgumentError(f"max_sessions must be >= 1, got {max_sessions}")
        if not 1 <= max_session_tokens <= MAX_POSITION + 1:
            raise InvalidArgumentError(
                f"max_session_tokens must be in [1, {MAX_POSITION + 1}], got {max_session_tokens}"
            )
        self.cache = cache
        self.max_sessions = max_sessions
        self.max_session_tokens = max_session_tokens
        self._sessions: dict[SessionId, _Session] = {}
        self._next_sid: SessionId = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, sid: object) -> bool:
        return sid in self._sessions

    def sessions(self) -> list[SessionId]:
        """Open session ids, oldest first."""
        return list(self._sessions)

    def open(self) -> SessionId:
        """A new empty session; OutOfResourcesError at `max_sessions`."""
        self._check_capacity()
        return self._publish(self.cache.seq_alloc())

    def close(self, sid: SessionId) -> None:
        """Release the session and its cache sequence; unknown ids are ignored."""
        session = self._sessions.pop(sid, None)
        if session is not None:
            self.cache.seq_release(session.seq)

    def clone(self, sid: SessionId, upto: int) -> SessionId:
        """A new session sharing `sid`'s positions [0, upto), with no sampling policy."""
        source = self._session(sid)
        length = self.cache.seq_length(source.seq)
        if not 0 <= upto <= length:
            raise InvalidArgumentError(
                f"clone of session {sid} up to {upto}: the boundary must be in [0, {length}] "
                "(only positions the source already holds can be shared)"
            )
        self._check_capacity()
        return self._publish(self.cache.seq_clone(source.seq, upto))

    def truncate(self, sid: SessionId, length: int) -> None:
        """Drop the session's positions >= `length`; cells it shares stay with the other
        owners. Its sampling policy (and the policy's random stream) stays."""
        seq = self._session(sid).seq
        held = self.cache.seq_length(seq)
        if not 0 <= length <= held:
            raise InvalidArgumentError(
                f"truncate session {sid} to {length}: it holds {held} positions; the length "
                f"must be in [0, {held}]"
            )
        self.cache.seq_rewind(seq, length)

    def set_sampling(self, sid: SessionId, params: SamplingParams, seed: int | None) -> None:
        """Install a generation's policy; its coins restart from `seed` (None: random)."""
        self._session(sid).sampler = SessionSampler(params, seed)

    def position(self, sid: SessionId) -> int:
        """The session's committed length: the next position it would write."""
        return self.cache.seq_length(self._session(sid).seq)

    def seq_of(self, sid: SessionId) -> int:
        """The cache sequence id holding the session."""
        return self._session(sid).seq

    def pack(self, batch: BatchInput) -> PackedStep:
        """Lay `batch` onto one token axis, checking every input before rewinding any.

        A start below the session's committed length rewinds it to that start (the
        first input of that session in the batch only; never to 0 of a non-empty one);
        a start above it is a gap. Later inputs of a session must abut the earlier.
        """
        if not batch.inputs:
            raise InvalidArgumentError("pack: the batch has no inputs")
        # Where each sequence stands mid-batch: the cache still holds the state
        # before this step, so the batch's own writes are tracked here.
        cursor: dict[int, int] = {}
        rewinds: list[tuple[int, int]] = []
        seqs: list[int] = []
        starts: list[int] = []
        sizes: list[int] = []
        pieces: list[Sequence[Token]] = []
        for index, item in enumerate(batch.inputs):
            session = self._sessions.get(item.sid)
            if session is None:
                raise InvalidArgumentError(
                    f"pack: input {index} names session {item.sid}, which is not open"
                )
            if item.size < 1 or item.offset < 0 or item.offset + item.size > len(item.payload):
                raise InvalidArgumentError(
                    f"pack: input {index} (session {item.sid}) asks for payload"
                    f"[{item.offset}:{item.offset + item.size}] of a {len(item.payload)}-token "
                    "payload; a slice must hold at least one token of its payload"
                )
            start = item.start
            if start < 0:
                raise InvalidArgumentError(
                    f"pack: input {index} (session {item.sid}) starts at negative position {start}"
                )
            first_for_seq = session.seq not in cursor
            at = cursor[session.seq] if not first_for_seq else self.cache.seq_length(session.seq)
            if start > at:
                raise InvalidArgumentError(
                    f"pack: input {index} (session {item.sid}) starts at {start} but the session "
                    f"holds {at} positions; inputs must continue where the session stands"
                )
            if start < at:
                if not first_for_seq:
                    raise InvalidArgumentError(
                        f"pack: input {index} (session {item.sid}) starts at {start}, overlapping "
                        f"the same session's earlier input in this batch, which ends at {at}"
                    )
                if start == 0:
                    raise InvalidArgumentError(
                        f"pack: input {index} (session {item.sid}) rewinds the session to 0; "
                        "close it and open a new one to start over"
                    )
                rewinds.append((session.seq, start))
            end = start + item.size
            if end > self.max_session_tokens:
                raise OutOfResourcesError(
                    f"pack: input {index} (session {item.sid}) reaches {end} tokens, above "
                    f"max_session_tokens={self.max_session_tokens}"
                )
            cursor[session.seq] = end
            seqs.append(session.seq)
            starts.append(start)
            sizes.append(item.size)
            pieces.append(item.tokens)

        tokens = np.concatenate([np.asarray(piece, dtype=np.int64) for piece in pieces])
        if tokens.min() < 0:
            raise InvalidArgumentError("pack: tokens must be >= 0, the batch holds a negative one")
        size_array = np.asarray(sizes, dtype=np.int64)
        ends = np.cumsum(size_array)
        # Each token's position is its input's start plus its index within the input.
        positions = np.repeat(np.asarray(starts, dtype=np.int64) - (ends - size_array), size_array)
        positions += np.arange(len(tokens), dtype=np.int64)
        produces = np.fromiter((item.produce_output for item in batch.inputs), bool, len(sizes))

        for seq, start in rewinds:
            self.cache.seq_rewind(seq, start)
        return PackedStep(
            tokens=tokens,
            positions=positions,
            seq_ids=np.repeat(np.asarray(seqs, dtype=np.int64), size_array),
            logit_indices=np.where(produces, ends - 1, -1),
        )

    def sample(self, sids: Sequence[SessionId], logits: torch.Tensor) -> list[Token]:
        """Draw row i of `logits` [R, V] with session `sids[i]`'s policy, all in one call.

        A session without an installed policy samples greedily.
        """
        if logits.dim() != 2 or logits.shape[0] != len(sids):
            raise InvalidArgumentError(
                f"sample: {len(sids)} sessions need logits of shape [{len(sids)}, vocab], "
                f"got {tuple(logits.shape)}"
            )
        params = np.empty((len(sids), NUM_PARAMS), dtype=np.float32)
        for row, sid in enumerate(sids):
            sampler = self._session(sid).sampler
            params[row] = GREEDY_ROW if sampler is None else sampler.next_row()
        return sample_rows(logits, torch.from_numpy(params)).tolist()

    def _session(self, sid: SessionId) -> _Session:
        session = self._sessions.get(sid)
        if session is None:
            raise InvalidArgumentError(f"session {sid} is not open")
        return session

    def _check_capacity(self) -> None:
        if len(self._sessions) >= self.max_sessions:
            raise OutOfResourcesError(
                f"all {self.max_sessions} sessions are open (clones count); "
                "close one or raise max_sessions"
            )

    def _publish(self, seq: int) -> SessionId:
        sid = self._next_sid
        self._next_sid += 1
        self._sessions[sid] = _Session(seq)
        return sid


def select_rows(step: PackedStep, offset: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The logits rows a forward over step tokens [offset, offset + length) must return.

    Returns (rows, input_indices), int64 arrays of equal length: rows are relative to
    the slice (what the forward indexes its own hidden states with), in input order,
    and input_indices says which input each belongs to. A slice with no wanted row
    returns its last row with input index -1, so every forward yields some logits.
    """
    if offset < 0 or length < 1 or offset + length > step.num_tokens:
        raise InvalidArgumentError(
            f"select_rows: slice [{offset}, {offset + length}) is not a non-empty part of a "
            f"{step.num_tokens}-token step"
        )
    wanted = (step.logit_indices >= offset) & (step.logit_indices < offset + length)
    inputs = np.flatnonzero(wanted)
    if inputs.size == 0:
        return np.array([length - 1], dtype=np.int64), np.array([-1], dtype=np.int64)
    return step.logit_indices[inputs] - offset, inputs.astype(np.int64)
