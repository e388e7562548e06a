"""Per-row token sampling for a packed step (docs/design.md#sampling-and-batch-invariance).

Owns: `sample_rows`, which draws one token per logits row with that row's own
policy in a single vectorised call; `apply_penalties`, the repetition, presence
and frequency penalties on logits rows; `token_logprobs`, the raw log-probabilities
reported for chosen tokens; and `SessionSampler`, one generation's policy plus its
coins, one per token it draws, each a function of the seed and the token's index.
Promises: greedy rows (temperature 0) are the exact argmax of the logits they are
given; other rows sample softmax(logits / temperature) in float32, first without
the tokens min_p drops (probability below min_p times the most likely token's),
then restricted by top-k (when top_k > 0, which wins over top-p) or else by top-p
(when top_p < 1) among what is left, by inverse CDF with the row's coin over the
kept tokens *in token order*. A row's token, penalised logits and logprobs depend
only on its own logits and its own params, so a seeded session gets the same
tokens whatever else shares the batch. It runs where the logits are (a GPU's too):
which rows take which draw is read from `params` where they are (the host), so no
choice waits for the device, and a step whose every row is greedy runs one argmax.
Never: draws randomness itself (coins are inputs), loops over rows in Python
(except to build the reported logprob values).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from cellbatch.generation_config import MAX_LOGPROBS, SamplingParams
from cellbatch.types import InvalidArgumentError, TokenLogprob

PARAM_TEMPERATURE = 0
PARAM_TOP_P = 1
PARAM_TOP_K = 2
PARAM_MIN_P = 3
PARAM_COIN = 4
NUM_PARAMS = 5

# Top-p looks for its nucleus among this many most likely tokens first, then a
# widening factor more each round until the whole vocabulary.
_NUCLEUS_CANDIDATES = 256
_NUCLEUS_WIDENING = 16

# log_softmax runs over this many rows at a time: each slice is a [rows, vocab] float32 copy.
_LOGPROB_ROWS = 64

ParamsRow = tuple[float, float, float, float, float]

# The params row of a session without a policy: greedy (min_p and the coin are unused).
GREEDY_ROW: ParamsRow = (0.0, 1.0, 0.0, 0.0, 0.0)


_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment
_TO_UNIT = 2.0**-53


def _mix64(value: int) -> int:
    """SplitMix64's output function: a bijection on 64-bit integers that spreads every
    input bit over the output (Steele, Lea and Flood, 2014)."""
    value &= _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index (a NaN wins), `logits.max(dim=-1).indices`: through
    `cellbatch::argmax_rows` where the model's ops defined it (on the CPU its compiled
    kernel is several times faster than torch's max with indices), else torch's max. The
    op is looked up, not imported: the executor runs programs without model code."""
    argmax_rows = getattr(torch.ops.cellbatch, "argmax_rows", None)
    tokens: torch.Tensor = (
        logits.max(dim=-1).indices if argmax_rows is None else argmax_rows(logits)
    )
    return tokens


def sample_rows(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of `logits` [R, V]; returns int64 [R].

    `params` [R, 5] holds each row's (temperature, top_p, top_k, min_p, coin), coin in
    [0, 1). Any float logits dtype works (bf16/fp16 are widened to float32). Penalties
    are not applied here: pass logits that `apply_penalties` already changed.
    """
    if logits.dim() != 2:
        raise InvalidArgumentError(
            f"logits must be [rows, vocab], got shape {tuple(logits.shape)}; "
            "select the rows to sample before calling sample_rows"
        )
    if tuple(params.shape) != (logits.shape[0], NUM_PARAMS):
        raise InvalidArgumentError(
            f"params must be [{logits.shape[0]}, {NUM_PARAMS}] (temperature, top_p, top_k, min_p, "
            f"coin) for {logits.shape[0]} logits rows, got shape {tuple(params.shape)}"
        )
    # Which rows take which draw is decided where `params` are (the host's, normally), so
    # logits on a GPU are never waited for to choose; every row greedy is one argmax.
    chooser = params.float()
    tokens = greedy_tokens(logits)
    stochastic = chooser[:, PARAM_TEMPERATURE] > 0.0
    if not bool(stochastic.any()):
        return tokens
    logits = logits.float()
    params = params.to(device=logits.device, dtype=torch.float32)
    vocab = logits.shape[1]
    top_k = chooser[:, PARAM_TOP_K]
    # top_k >= vocab keeps everything, and still wins over top-p.
    by_top_k = stochastic & (top_k > 0) & (top_k < vocab)
    by_top_p = stochastic & (top_k == 0) & (chooser[:, PARAM_TOP_P] < 1.0)
    by_full = stochastic & ~by_top_k & ~by_top_p
    for selected, draw in ((by_full, _draw_full), (by_top_k, _draw_top_k), (by_top_p, _draw_top_p)):
        rows = torch.nonzero(selected).squeeze(1).to(logits.device)
        if rows.numel() > 0:
            row_params = params.index_select(0, rows)
            tokens[rows] = draw(_scaled(logits.index_select(0, rows), row_params), row_params)
    return tokens


def _scaled(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """log-probabilities up to a constant: (logits - row max) / temperature, max 0, with
    the tokens min_p drops at -inf.

    Shifting first keeps a tiny temperature from overflowing to inf. A token's
    probability relative to the most likely one is exp(scaled), so min_p drops
    scaled < log(min_p). Rows without min_p skip that pass.
    """
    temperature = params[:, PARAM_TEMPERATURE : PARAM_TEMPERATURE + 1]
    scaled = (logits - logits.amax(dim=-1, keepdim=True)).div_(temperature)
    min_p = params[:, PARAM_MIN_P]
    rows = torch.nonzero(min_p > 0.0).squeeze(1)
    if rows.numel() > 0:
        part = scaled.index_select(0, rows)
        floor = min_p.index_select(0, rows).log().unsqueeze(1)
        scaled[rows] = part.masked_fill_(part < floor, float("-inf"))
    return scaled


def _draw_full(scaled: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over the whole vocabulary, in token order."""
    cumulative = torch.softmax(scaled, dim=-1).cumsum_(dim=-1)
    return _inverse_cdf(cumulative, params[:, PARAM_COIN])


def _draw_top_k(scaled: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Among each row's top_k tokens, renormalised (their weights need no softmax)."""
    top_k = params[:, PARAM_TOP_K].long()
    values, indices = scaled.topk(min(int(top_k.max()), scaled.shape[1]), dim=-1)
    in_top = torch.arange(values.shape[1], device=values.device) < top_k.unsqueeze(1)
    return _draw_among(indices, values.exp_().mul_(in_top), params[:, PARAM_COIN])


def _draw_top_p(scaled: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Among each row's nucleus: the smallest most-likely set whose mass reaches top_p.

    A token stays while the mass before it is still short of p, so the most likely
    token always stays. A full sort of the vocabulary is slow on CPU and a nucleus is
    usually small, so candidates come from `topk`, widened only for the rows whose
    candidates do not reach p yet (the last width is the whole vocabulary).
    """
    vocab = scaled.shape[1]
    log_total = torch.logsumexp(scaled, dim=-1, keepdim=True)
    tokens = torch.empty(len(scaled), dtype=torch.long, device=scaled.device)
    pending = torch.arange(len(scaled), device=scaled.device)
    width = min(_NUCLEUS_CANDIDATES, vocab)
    while pending.numel() > 0:
        values, indices = scaled.index_select(0, pending).topk(width, dim=-1)
        probabilities = values.sub_(log_total.index_select(0, pending)).exp_()
        cumulative = probabilities.cumsum(dim=-1)
        top_p = params.index_select(0, pending)[:, PARAM_TOP_P : PARAM_TOP_P + 1]
        done = (cumulative[:, -1:] >= top_p).squeeze(1) | (width == vocab)
        in_nucleus = (cumulative - probabilities)[done] < top_p[done]
        in_nucleus[:, 0] = True  # a top_p that float32 rounds to 0 still keeps one token
        tokens[pending[done]] = _draw_among(
            indices[done],
            probabilities[done].mul_(in_nucleus),
            params.index_select(0, pending[done])[:, PARAM_COIN],
        )
        pending = pending[~done]
        width = min(width * _NUCLEUS_WIDENING, vocab)
    return tokens


def _draw_among(indices: torch.Tensor, weights: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over candidate tokens `indices` [S, W] with `weights` (0: dropped),
    walked in token order."""
    order = indices.argsort(dim=-1)
    cumulative = weights.gather(1, order).cumsum_(dim=-1)
    return indices.gather(1, order).gather(1, _inverse_cdf(cumulative, coins).unsqueeze(1))[:, 0]


def _inverse_cdf(cumulative: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative weight exceeds coin * total weight.

    That index always has a non-zero weight (the cumulative sum only rises there).
    The target stays strictly below the total, so rounding (a float32 coin of 1.0)
    still lands on the last weighted index rather than past the end.
    """
    total = cumulative[:, -1:]
    target = torch.minimum(
        coins.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total))
    )
    return torch.searchsorted(cumulative, target, right=True).squeeze(1)


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    counts: torch.Tensor,
    penalties: torch.Tensor,
) -> torch.Tensor:
    """Penalised float32 copy of `logits` [P, V].

    (`rows[i]`, `tokens[i]`) are the distinct (row, token) pairs of each row's session
    context (prompt included); `counts[i]` says how often the row's generation
    generated that token (they are in its context too); `penalties` [P, 3] holds each
    row's (repetition, presence, frequency). A context token's logit l becomes
    l / repetition if l > 0 else l * repetition, then loses frequency * count, then
    presence * (count > 0). Every other logit is unchanged, so the work is per context
    token, not per vocabulary entry.
    """
    penalised = logits.float().clone()
    values = penalised[rows, tokens]
    repetition, presence, frequency = penalties.index_select(0, rows).unbind(dim=1)
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = values - frequency * counts
    values = values - presence * (counts > 0)
    penalised[rows, tokens] = values
    return penalised


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], tops: Sequence[int]
) -> list[TokenLogprob]:
    """Row i's raw log-probability of `tokens[i]`, with its `tops[i]` most likely tokens.

    The log-probabilities are float32 log_softmax of the logits as given, computed
    `_LOGPROB_ROWS` rows at a time to bound the copy. The candidates always come from a
    top-`MAX_LOGPROBS` of the row, cut to `tops[i]`, so ties break the same way whatever
    the other rows ask.
    """
    if logits.dim() != 2 or not len(tokens) == len(tops) == logits.shape[0]:
        raise InvalidArgumentError(
            f"token_logprobs: {len(tokens)} tokens and {len(tops)} top counts for logits of "
            f"shape {tuple(logits.shape)}; give one token and one count per logits row"
        )
    width = min(MAX_LOGPROBS, logits.shape[1])
    found: list[TokenLogprob] = []
    for begin in range(0, logits.shape[0], _LOGPROB_ROWS):
        end = begin + _LOGPROB_ROWS
        logprobs = logits[begin:end].float().log_softmax(dim=-1)
        chosen = torch.as_tensor(tokens[begin:end], dtype=torch.long, device=logprobs.device)
        values = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        wanted = tops[begin:end]
        if max(wanted) > 0:
            top_values, top_tokens = logprobs.topk(width, dim=-1)
            top_pairs = [
                list(zip(row_tokens, row_values, strict=True))
                for row_tokens, row_values in zip(
                    top_tokens.tolist(), top_values.tolist(), strict=True
                )
            ]
        else:
            top_pairs = [[] for _ in wanted]
        found.extend(
            TokenLogprob(int(token), value, tuple(pairs[:top]))
            for token, value, pairs, top in zip(
                chosen.tolist(), values, top_pairs, wanted, strict=True
            )
        )
    return found


class SessionSampler:
    """One generation's sampling policy and its coins.

    The coin of the generation's i-th token is a function of (seed, i) alone
    (`coin(i)`): the same seed gives the same coins whatever else shares the batch,
    however the tokens are grouped into steps (a speculative step draws several
    positions at once) and however often a preempted generation replays its context.
    Seed None draws a nondeterministic seed.
    """

    def __init__(self, params: SamplingParams, seed: int | None) -> None:
        if seed is not None and seed < 0:
            raise InvalidArgumentError(f"seed must be >= 0 or None (nondeterministic), got {seed}")
        self.params = params
        self.seed = seed
        self._key = _mix64(secrets.randbits(64) if seed is None else seed)

    def coin(self, index: int) -> float:
        """The uniform draw in [0, 1) of the generation's `index`-th token (from 0):
        SplitMix64's output for counter `index` of this seed's stream, 53 bits."""
        return (_mix64(self._key + (index + 1) * _GOLDEN_GAMMA) >> 11) * _TO_UNIT

    def row(self, index: int) -> ParamsRow:
        """The `sample_rows` params row of the generation's `index`-th token."""
        return (
            float(self.params.temperature),
            float(self.params.top_p),
            float(self.params.top_k),
            float(self.params.min_p),
            self.coin(index),
        )

    def penalty_row(self) -> tuple[float, float, float]:
        """The `apply_penalties` row of this policy: (repetition, presence, frequency)."""
        return (
            float(self.params.repetition_penalty),
            float(self.params.presence_penalty),
            float(self.params.frequency_penalty),
        )
