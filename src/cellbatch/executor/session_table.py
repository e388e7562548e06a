"""Sessions over cache sequences: what every executor shares (docs/design.md#sessiontable).

Owns: the map from session ids to `CellCache` sequences, each session's sampling
policy, its LoRA adapter, its pooler (`executor/pooling.py`) and the token ids it was fed;
`pack`, which lays a batch onto one token axis (a `PackedStep`); `sample`, which draws
every output row with its own session's policy in one call (`executor/row_policies.py`
applies the policies to the rows and gives the logprobs asked for) and keeps a verified
run's drafts while they equal the draws; and `score`, which gathers a generation's
prompt logprobs across its chunks.
Promises: session ids are issued monotonically and never reused (cache sequence
ids may be); sessions are bounded by `max_sessions` (clones count) and each by
`max_session_tokens`; `pack` either succeeds or raises having changed nothing but
its record of the tokens past the session's cells. Penalties see exactly the
tokens the session's cells hold (a clone its prefix, a truncated or rewound
session what is left), plus what the step feeds. A row's token and logprobs depend
only on its own session, never on the rest of the step.
Never: places cells or runs the model (the executor declares and places each
slice); keeps vocabulary-sized state between steps, except one logits row per
session whose prompt is being scored across chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from cellbatch.cache import CellCache
from cellbatch.constraint import ConstraintCompiler, ConstraintMatcher
from cellbatch.executor.packed_step import PackedStep
from cellbatch.executor.pooling import Pooler, plan_pooling
from cellbatch.executor.prompt_scores import PromptScores, plan_scoring
from cellbatch.executor.row_policies import apply_policies, kept_logprobs
from cellbatch.executor.sampling import SessionSampler, sample_rows
from cellbatch.executor.token_rules import TokenRules
from cellbatch.generation_config import SamplingParams
from cellbatch.types import (
    MAX_POSITION,
    NO_ADAPTER,
    BatchInput,
    InvalidArgumentError,
    OutOfResourcesError,
    Output,
    SessionId,
    Token,
    TokenLogprob,
)


@dataclass
class _Session:
    seq: int
    sampler: SessionSampler | None = None  # None: no generation installed yet; samples greedily
    # history[p]: the token id at position p, for the positions the session's cells hold
    # (the cache's length of `seq` says how many) and what the step being run feeds: the
    # context penalties count over, drafts are looked up in, and prompt logprobs score.
    history: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    generated_from: int | None = None  # the position of the generation's first sampled token
    prompt: PromptScores | None = None  # while the generation's prompt is being scored
    matcher: ConstraintMatcher | None = None  # the generation's constraint, where it has one
    rules: TokenRules | None = None  # the generation's token rules, where it has any
    adapter: int = NO_ADAPTER  # the generation's LoRA adapter id
    pooler: Pooler | None = None  # a pooling generation's hidden states so far

    def produced(self, fed: int) -> np.ndarray:
        """The tokens the generation has produced before position `fed` (its draws fed
        back)."""
        start = self.generated_from if self.generated_from is not None else fed
        return self.history[start:fed]

    def record(self, start: int, tokens: np.ndarray, capacity: int) -> None:
        end = start + len(tokens)
        if end > len(self.history):
            grown = np.zeros(min(max(end, 2 * len(self.history), 64), capacity), dtype=np.int64)
            grown[:start] = self.history[:start]
            self.history = grown
        self.history[start:end] = tokens


class SessionTable:
    """Sessions, their cache sequences, sampling policies and fed tokens; packs batches."""

    def __init__(
        self,
        cache: CellCache,
        max_sessions: int,
        max_session_tokens: int,
        constraints: ConstraintCompiler | None = None,
    ) -> None:
        if max_sessions < 1:
            raise InvalidArgumentError(f"max_sessions must be >= 1, got {max_sessions}")
        if not 1 <= max_session_tokens <= MAX_POSITION + 1:
            raise InvalidArgumentError(
                f"max_session_tokens must be in [1, {MAX_POSITION + 1}], got {max_session_tokens}"
            )
        self.cache = cache
        self.max_sessions = max_sessions
        self.max_session_tokens = max_session_tokens
        self.constraints = constraints  # None: no tokenizer, so constraints are refused
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
        """A new session sharing `sid`'s positions [0, upto), with no sampling policy
        (penalties then see that prefix as its context)."""
        source = self._session(sid)
        length = self.cache.seq_length(source.seq)
        if not 0 <= upto <= length:
            raise InvalidArgumentError(
                f"clone of session {sid} up to {upto}: the boundary must be in [0, {length}] "
                "(only positions the source already holds can be shared)"
            )
        self._check_capacity()
        clone = self._publish(self.cache.seq_clone(source.seq, upto))
        self._sessions[clone].record(0, source.history[:upto], self.max_session_tokens)
        return clone

    def truncate(self, sid: SessionId, length: int) -> None:
        """Drop the session's positions >= `length`; cells it shares stay with the other
        owners. Its sampling policy (and the policy's random stream) stays, and so do the
        prompt logprobs its generation gathered: a replay (preemption) feeds the same
        tokens again, and they are not scored twice. Penalties count exactly what the
        session holds, so the dropped tokens count again once fed again."""
        session = self._session(sid)
        seq = session.seq
        held = self.cache.seq_length(seq)
        if not 0 <= length <= held:
            raise InvalidArgumentError(
                f"truncate session {sid} to {length}: it holds {held} positions; the length "
                f"must be in [0, {held}]"
            )
        self.cache.seq_rewind(seq, length)

    def set_sampling(self, sid: SessionId, params: SamplingParams, seed: int | None) -> None:
        """Install a generation's policy; its coins restart from `seed` (None: random).
        Its presence and frequency penalties count from its first sampled token; its
        prompt logprobs (when asked) gather from its next input on. A constraint starts
        its matcher afresh (InvalidArgumentError when it does not compile, or when there is
        no tokenizer to compile it for)."""
        session = self._session(sid)
        matcher = None
        if params.constraint is not None:
            if self.constraints is None:
                raise InvalidArgumentError(
                    "this model has no tokenizer, so a constraint cannot be compiled for it; "
                    "load a model with its tokenizer files"
                )
            matcher = self.constraints.matcher(params.constraint)
        session.matcher = matcher
        session.rules = TokenRules.of(params)
        session.sampler = SessionSampler(params, seed)
        session.generated_from = None
        session.prompt = (
            None if params.prompt_logprobs is None else PromptScores(params.prompt_logprobs)
        )
        session.pooler = None if params.pooling is None else Pooler(params.pooling)

    def history(self, sid: SessionId, upto: int) -> np.ndarray:
        """The token ids of the session's positions [0, upto) (a view: do not change)."""
        session = self._session(sid)
        upto = min(upto, self.cache.seq_length(session.seq))
        return session.history[:upto]

    def allowed(self, sid: SessionId, draft: Sequence[Token]) -> tuple[Token, ...]:
        """The longest prefix of `draft` the session's constraint allows after what it
        has drawn (all of it without a constraint)."""
        matcher = self._session(sid).matcher
        if matcher is None or not draft:
            return tuple(draft)
        return tuple(draft[: matcher.allowed_prefix(draft)])

    def set_adapter(self, sid: SessionId, adapter: int) -> None:
        """The LoRA adapter id the session's tokens run with from its next input on
        (NO_ADAPTER: the base model alone). A clone starts without one."""
        self._session(sid).adapter = adapter

    def position(self, sid: SessionId) -> int:
        """The session's committed length: the next position it would write."""
        return self.cache.seq_length(self._session(sid).seq)

    def seq_of(self, sid: SessionId) -> int:
        """The cache sequence id holding the session."""
        return self._session(sid).seq

    def pack(self, batch: BatchInput, drafts: Sequence[int] | None = None) -> PackedStep:
        """Lay `batch` onto one token axis, checking every input before rewinding any.

        A start below the session's committed length rewinds it to that start (the
        first input of that session in the batch only; never to 0 of a non-empty one);
        a start above it is a gap. Later inputs of a session must abut the earlier.
        A session scoring its prompt gets `score_ranges` for the rows whose logits
        give entries it lacks. `drafts[i]` > 0: the last drafts[i] tokens of output-
        producing input i are drafts to verify (each of them, and the token before
        them, gets an output row).
        """
        if not batch.inputs:
            raise InvalidArgumentError("pack: the batch has no inputs")
        if drafts is not None:
            for index, (item, count) in enumerate(zip(batch.inputs, drafts, strict=True)):
                if count and not (item.produce_output and 0 < count < item.size):
                    raise InvalidArgumentError(
                        f"pack: input {index} (session {item.sid}) verifies {count} drafts "
                        f"of its {item.size} tokens; drafts end an output-producing input "
                        "and leave at least one token before them"
                    )
        # Where each sequence stands mid-batch: the cache still holds the state
        # before this step, so the batch's own writes are tracked here.
        cursor: dict[int, int] = {}
        rewinds: list[tuple[int, int]] = []
        sessions: list[_Session] = []
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
            sessions.append(session)
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
        adapters = None
        if any(session.adapter != NO_ADAPTER for session in sessions):
            ids = np.asarray([session.adapter for session in sessions], dtype=np.int64)
            adapters = np.repeat(ids, size_array)
        poolers = [session.pooler for session in sessions]
        samples = produces & np.fromiter((p is None for p in poolers), bool, len(sizes))

        for seq, start in rewinds:
            self.cache.seq_rewind(seq, start)
        for session, start, size, end in zip(sessions, starts, sizes, ends.tolist(), strict=True):
            session.record(start, tokens[end - size : end], self.max_session_tokens)
        return PackedStep(
            tokens=tokens,
            positions=positions,
            seq_ids=np.repeat(np.asarray([s.seq for s in sessions], dtype=np.int64), size_array),
            logit_indices=np.where(samples, ends - 1, -1),
            score_ranges=plan_scoring(
                [session.prompt for session in sessions],
                [session.seq for session in sessions],
                starts,
                sizes,
                produces,
                ends,
            ),
            drafts=np.asarray(drafts, dtype=np.int64) if drafts and any(drafts) else None,
            adapters=adapters,
            pooling=plan_pooling(poolers, starts, sizes, produces, ends),
        )

    def sample(
        self,
        sids: Sequence[SessionId],
        logits: torch.Tensor,
        drafts: Sequence[Sequence[Token]] | None = None,
    ) -> list[Output]:
        """Draw each session's next token with its own policy, every row in one call.

        Without `drafts`, row i of `logits` [R, V] is the logits of the last token
        session `sids[i]` fed in this step. With them, session i owns 1 + len(drafts[i])
        consecutive rows: those of its last fed tokens, the token before its drafts and
        then each draft (the drafts are the last tokens it fed). Each row is drawn as
        one-at-a-time decoding would draw the token at its position: that token's coin,
        penalties and token rules over the context before it, the constraint's mask
        after the drafts before it. A session keeps its drafts while they equal its own
        draws, and returns those and the draw after them (`Output.drafted`: how many
        drafts it verified); the cells of the drafts it did not keep are rewound.

        Penalties change the rows of the sessions that use them first, then token rules
        (logit bias, allowed tokens, banned sequences, min_tokens), then constraints
        mask theirs (and take the kept tokens); the logprobs (where a policy asks) come
        from the raw rows. A generation's first output carries its prompt logprobs when
        its policy asks. A session without an installed policy samples greedily.
        """
        counts = [1] * len(sids) if drafts is None else [1 + len(d) for d in drafts]
        if logits.dim() != 2 or logits.shape[0] != sum(counts) or len(counts) != len(sids):
            raise InvalidArgumentError(
                f"sample: {len(sids)} sessions drawing {sum(counts)} rows need logits of "
                f"shape [{sum(counts)}, vocab], got {tuple(logits.shape)}"
            )
        sessions = [self._session(sid) for sid in sids]
        # Per row: its session, and the position of the token it draws (the session's
        # rows end where its cells end once the step is placed).
        owners: list[_Session] = []
        targets: list[int] = []
        firsts: list[int] = []
        for session, count in zip(sessions, counts, strict=True):
            first = self.cache.seq_length(session.seq) - count + 1
            if session.generated_from is None:
                session.generated_from = first
            firsts.append(first)
            owners.extend([session] * count)
            targets.extend(range(first, first + count))
        drawn, params = apply_policies(logits, owners, targets, sessions, counts, drafts)
        tokens = sample_rows(drawn, torch.from_numpy(params)).tolist()
        kept_counts = []
        row = 0
        for index, (session, count) in enumerate(zip(sessions, counts, strict=True)):
            draws = tokens[row : row + count]
            kept = 1
            while kept < count and draws[kept - 1] == drafts[index][kept - 1]:  # type: ignore[index]
                kept += 1
            kept_counts.append(kept)
            if kept < count:  # the rejected drafts' cells
                self.cache.seq_rewind(session.seq, firsts[index] + kept - 1)
            matcher = session.matcher
            if matcher is not None:
                matcher.rollback(count - 1)  # the drafts its masks consumed
                for token in draws[:kept]:
                    matcher.consume(token)
            row += count
        logprobs = kept_logprobs(logits, sessions, counts, kept_counts, tokens)
        outputs = []
        row = 0
        for index, (sid, session, count) in enumerate(zip(sids, sessions, counts, strict=True)):
            kept = kept_counts[index]
            outputs.append(
                Output(
                    sid,
                    tuple(tokens[row : row + kept]),
                    logprobs.get(index, ()),
                    self._prompt_scores(session, firsts[index]),
                    drafted=count - 1,
                )
            )
            row += count
        return outputs

    @staticmethod
    def _prompt_scores(session: _Session, first: int) -> tuple[TokenLogprob | None, ...]:
        """The generation's prompt logprobs, on its first output only (`first`: where the
        output's first token goes)."""
        if session.prompt is None:
            return ()
        session.prompt.reach(first - 1, session.history)
        scores, session.prompt = tuple(session.prompt.entries), None
        return scores

    def score(self, step: PackedStep, rows: np.ndarray, logits: torch.Tensor) -> None:
        """Gather prompt logprobs from the logits [len(rows), V] of `step`'s token-axis
        `rows` (ascending, within its score_ranges): the logits of a session's position
        q score its token at q + 1. An executor calls it for each slice's scored rows
        before sampling that slice."""
        seqs = step.seq_ids[rows]
        scoring = {s.seq: s for s in self._sessions.values() if s.prompt is not None}
        for seq in dict.fromkeys(seqs.tolist()):
            session = scoring.get(seq)
            if session is None or session.prompt is None:
                raise InvalidArgumentError(
                    f"score: rows of cache sequence {seq}, whose session scores no prompt; "
                    "pass only the rows select_rows marks as scored"
                )
            mine = np.flatnonzero(seqs == seq)
            session.prompt.add(
                step.positions[rows[mine]],
                logits[torch.from_numpy(mine).to(logits.device)],
                session.history,
                self.cache.seq_length(seq),
            )

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
