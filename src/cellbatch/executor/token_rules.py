"""One generation's token rules as tensors, built once when its policy is installed.

Owns: `TokenRules` (logit bias, allowed tokens, banned sequences and the tokens
min_tokens holds back, from `SamplingParams`) and `apply_token_rules`, which changes the
rows of a step's logits that have rules.
Promises: a rule changes only its own row; the index tensors are made once per policy,
so a step does no per-token Python (only a banned sequence longer than one token is
matched, per step, against what the generation produced).
Never: samples, or touches the raw logits (they give logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cellbatch.generation_config import SamplingParams
from cellbatch.types import Token


@dataclass(frozen=True)
class TokenRules:
    bias_ids: torch.Tensor | None  # int64 [n] and their biases float32 [n]
    biases: torch.Tensor | None
    allowed: torch.Tensor | None  # int64: the only tokens a draw may take
    always_banned: torch.Tensor | None  # the last tokens of one-token banned sequences
    held: torch.Tensor | None  # banned while fewer than min_tokens were produced
    min_tokens: int
    sequences: tuple[tuple[Token, ...], ...]  # banned sequences of two tokens or more

    @classmethod
    def of(cls, params: SamplingParams) -> TokenRules | None:
        """The rules of a policy; None when it has none."""
        if not params.restricted:
            return None
        ids = [token for token, _ in params.logit_bias]
        singles = sorted({s[0] for s in params.banned_sequences if len(s) == 1})
        held = sorted(params.min_tokens_held) if params.min_tokens else []
        return cls(
            bias_ids=_ids(ids),
            biases=torch.tensor([b for _, b in params.logit_bias]) if ids else None,
            allowed=_ids(sorted(params.allowed_tokens or ())),
            always_banned=_ids(singles),
            held=_ids(held),
            min_tokens=params.min_tokens,
            sequences=tuple(s for s in params.banned_sequences if len(s) > 1),
        )

    def apply(self, line: torch.Tensor, produced: np.ndarray) -> None:
        """Changes one logits row in place (on its device); `produced`: the generation's
        tokens so far."""
        device = line.device
        if self.bias_ids is not None and self.biases is not None:
            line.index_add_(0, self.bias_ids.to(device), self.biases.to(device, line.dtype))
        if self.allowed is not None:
            allowed = self.allowed.to(device)
            kept = line[allowed]
            line.fill_(float("-inf"))
            line[allowed] = kept
        if self.always_banned is not None:
            line[self.always_banned.to(device)] = float("-inf")
        if self.held is not None and len(produced) < self.min_tokens:
            line[self.held.to(device)] = float("-inf")
        completing = [
            sequence[-1]
            for sequence in self.sequences
            if len(produced) >= len(sequence) - 1
            and tuple(produced[len(produced) - len(sequence) + 1 :].tolist()) == sequence[:-1]
        ]
        if completing:
            line[torch.tensor(completing, device=device)] = float("-inf")


def apply_token_rules(
    drawn: torch.Tensor,
    raw: torch.Tensor,
    rows: Sequence[tuple[int, TokenRules, np.ndarray]],
) -> torch.Tensor:
    """`drawn` with each (row, rules, produced) applied (a float32 copy when `drawn` is
    still the raw logits)."""
    out = drawn.float().clone() if drawn is raw else drawn
    for row, rules, produced in rows:
        rules.apply(out[row], produced)
    return out


def _ids(tokens: Sequence[Token]) -> torch.Tensor | None:
    return torch.tensor(tokens, dtype=torch.long) if tokens else None
