"""Each output row's sampling policy, applied to a step's logits (docs/design.md#sessiontable).

Owns: `apply_policies`, which turns a step's raw logits rows into the rows to draw from
and their `sample_rows` params: each row's coin, then its session's penalties over the
context before the row's position, its token rules, then its constraint's mask (a row
after drafts masked with those drafts consumed); `kept_logprobs`, the logprobs of the
tokens a step keeps, from the raw rows; and `RowSession`, what both read of a row's
session (the session table's record of it).
Promises: a row's params, drawn logits and logprobs depend only on its own session and
the position it draws, never on the rest of the step; penalties count exactly the
session's tokens before that position, and its generation's among them; the raw logits
are never changed (they give logprobs, and the constraint falls back to them where the
token rules leave nothing it allows).
Never: draws tokens, changes a session (except that its constraint's matcher consumes
the drafts its masks follow: the caller rolls them back), or keeps anything between
calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from cellbatch.constraint import ConstraintMatcher, MaskSource, mask_rows
from cellbatch.executor.sampling import (
    GREEDY_ROW,
    NUM_PARAMS,
    SessionSampler,
    apply_penalties,
    token_logprobs,
)
from cellbatch.executor.token_rules import TokenRules, apply_token_rules
from cellbatch.types import Token, TokenLogprob


class RowSession(Protocol):
    """What drawing a row reads of the session that owns it."""

    @property
    def sampler(self) -> SessionSampler | None:
        """The generation's policy; None: greedy."""

    @property
    def generated_from(self) -> int | None:
        """The position of the generation's first sampled token."""

    @property
    def history(self) -> np.ndarray:
        """The token id at each position the session holds or the step feeds."""

    @property
    def matcher(self) -> ConstraintMatcher | None:
        """The generation's constraint, where it has one."""

    @property
    def rules(self) -> TokenRules | None:
        """The generation's token rules, where it has any."""

    def produced(self, fed: int) -> np.ndarray:
        """The tokens the generation has produced before position `fed`."""


class _AfterDraft:
    """A constraint's mask for the row after a draft, in a verified run: the draft is
    consumed first (`mask_rows` fills the rows in order, so the matcher has consumed the
    drafts before this one already); `SessionTable.sample` rolls them back after."""

    def __init__(self, matcher: ConstraintMatcher, draft: Token) -> None:
        self._matcher, self._draft = matcher, draft

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.consume(self._draft)
        self._matcher.fill(bitmask, row)


def apply_policies(
    logits: torch.Tensor,
    owners: Sequence[RowSession],
    targets: Sequence[int],
    sessions: Sequence[RowSession],
    counts: Sequence[int],
    drafts: Sequence[Sequence[Token]] | None,
) -> tuple[torch.Tensor, np.ndarray]:
    """The rows to draw from (penalties, token rules, constraints applied) and their
    `sample_rows` params, row r drawing its owner's token at position targets[r].

    `sessions[i]` owns `counts[i]` consecutive rows (`owners` names each row's): its
    first, then one after each of `drafts[i]`."""
    params = np.empty((len(owners), NUM_PARAMS), dtype=np.float32)
    penalised: list[int] = []
    for row, (session, target) in enumerate(zip(owners, targets, strict=True)):
        sampler = session.sampler
        if sampler is None:
            params[row] = GREEDY_ROW
            continue
        assert session.generated_from is not None
        # The coin of the generation's token at this position, whatever step draws it.
        params[row] = sampler.row(target - session.generated_from)
        if sampler.params.penalised:
            penalised.append(row)
    drawn = _penalise(logits, owners, targets, penalised) if penalised else logits
    restricted = [
        (row, session.rules, session.produced(target))
        for row, (session, target) in enumerate(zip(owners, targets, strict=True))
        if session.rules is not None
    ]
    if restricted:
        drawn = apply_token_rules(drawn, logits, restricted)
    constrained: list[tuple[int, MaskSource]] = []
    row = 0
    for index, (session, count) in enumerate(zip(sessions, counts, strict=True)):
        if session.matcher is not None:
            constrained.append((row, session.matcher))
            for draft in drafts[index] if drafts is not None else ():
                row += 1
                constrained.append((row, _AfterDraft(session.matcher, draft)))
        row += count if session.matcher is None else 1
    if constrained:
        # Where the token rules leave nothing the constraint allows, the constraint wins.
        drawn = mask_rows(
            drawn,
            [row for row, _ in constrained],
            [source for _, source in constrained],
            fallback=logits if restricted else None,
        )
    return drawn, params


def kept_logprobs(
    logits: torch.Tensor,
    sessions: Sequence[RowSession],
    counts: Sequence[int],
    kept: Sequence[int],
    tokens: Sequence[Token],
) -> dict[int, tuple[TokenLogprob, ...]]:
    """Per session whose policy asks, its kept tokens' logprobs from their raw rows
    (one call for all of them)."""
    rows: list[int] = []
    tops: list[int] = []
    asking: list[int] = []
    row = 0
    for index, session in enumerate(sessions):
        sampler = session.sampler
        if sampler is not None and sampler.params.logprobs is not None:
            asking.append(index)
            rows.extend(range(row, row + kept[index]))
            tops.extend([sampler.params.logprobs] * kept[index])
        row += counts[index]
    if not asking:
        return {}
    found = iter(
        token_logprobs(
            logits.index_select(0, torch.tensor(rows, device=logits.device)),
            [tokens[row] for row in rows],
            tops,
        )
    )
    return {index: tuple(next(found) for _ in range(kept[index])) for index in asking}


def _penalise(
    logits: torch.Tensor,
    sessions: Sequence[RowSession],
    fed: Sequence[int],
    rows: Sequence[int],
) -> torch.Tensor:
    """A float32 copy of `logits` whose `rows` carry their sessions' penalties over
    their context before position fed[row] and their generation's tokens there (the
    raw rows stay for logprobs)."""
    vocab = logits.shape[1]
    # One key per (penalised row, token): row * vocab + token.
    context = np.concatenate(
        [p * vocab + sessions[r].history[: fed[r]] for p, r in enumerate(rows)]
    )
    generated = np.concatenate(
        [p * vocab + sessions[r].produced(fed[r]) for p, r in enumerate(rows)]
    )
    pairs = np.unique(context)
    repeated, times = np.unique(generated, return_counts=True)
    counts = np.zeros(len(pairs), dtype=np.float32)
    counts[np.searchsorted(pairs, repeated)] = times  # generated tokens are context
    device = logits.device
    penalties = torch.tensor(
        [sessions[r].sampler.penalty_row() for r in rows],  # type: ignore[union-attr]
        dtype=torch.float32,
        device=device,
    )
    picked = torch.tensor(rows, device=device)
    penalised = apply_penalties(
        logits.index_select(0, picked),
        torch.from_numpy(pairs // vocab).to(device),
        torch.from_numpy(pairs % vocab).to(device),
        torch.from_numpy(counts).to(device),
        penalties,
    )
    return logits.float().index_copy(0, picked, penalised)
