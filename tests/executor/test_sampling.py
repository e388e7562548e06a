"""sample_rows and SessionSampler: each row drawn with its own policy (BEHAVIOURS: sampling)."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from cellbatch.executor.sampling import (
    GREEDY_ROW,
    SessionSampler,
    apply_penalties,
    sample_rows,
    token_logprobs,
)
from cellbatch.generation_config import SamplingParams
from cellbatch.types import InvalidArgumentError

# A 6-token distribution with distinct probabilities, deliberately not in token order.
PROBS = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
LOGITS = PROBS.log()
DRAWS = 4000


def _params(rows: list[tuple[float, float, float, float, float]]) -> torch.Tensor:
    """Rows of (temperature, top_p, top_k, min_p, coin)."""
    return torch.tensor(rows, dtype=torch.float32)


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def _draw_many(params_row: tuple[float, float, float, float], logits: torch.Tensor = LOGITS):
    """DRAWS samples of one policy (temperature, top_p, top_k, min_p), all in one call
    (one row per draw)."""
    coins = torch.from_numpy(np.random.default_rng(7).random(DRAWS)).float()
    params = torch.tensor(params_row).repeat(DRAWS, 1)
    params = torch.cat([params, coins.unsqueeze(1)], dim=1)
    return sample_rows(logits.repeat(DRAWS, 1), params)


def test_temperature_zero_is_argmax_whatever_the_coin() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = _params([(0.0, 0.5, 3.0, 0.0, coin) for coin in (0.0, 0.2, 0.5, 0.9, 0.999)])
    assert sample_rows(logits, params).tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_of_equal_maxima_at_a_real_vocabulary(dtype: torch.dtype) -> None:
    # bf16 logits of a 128,256-token vocabulary tie often: the first maximum is the token.
    logits = torch.zeros(4, 128256, dtype=dtype)
    for row, places in enumerate([(5, 9), (128255,), (77, 100000, 128255), (0, 1)]):
        logits[row, list(places)] = 3.0
    logits[3, 1] = float("nan")  # a NaN row's token is its NaN, as argmax has it
    tokens = sample_rows(logits, torch.tensor([GREEDY_ROW] * 4))
    assert tokens.tolist() == [5, 128255, 77, 1]


def test_greedy_tokens_without_the_models_ops_are_torch_max_indices() -> None:
    """A process without model code (one that runs programs) has no argmax_rows op and
    takes torch's max: the same tokens."""
    code = (
        "import torch\n"
        "from cellbatch.executor.sampling import greedy_tokens\n"
        "assert getattr(torch.ops.cellbatch, 'argmax_rows', None) is None\n"
        "x = torch.zeros(2, 40)\n"
        "x[0, [3, 9]] = 1.0\n"
        "x[1, [7, 30]] = float('nan')\n"
        "print(greedy_tokens(x).tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[3, 7]"


def test_full_distribution_samples_in_token_order() -> None:
    # Token order cumulative: 0.05, 0.35, 0.45, 0.70, 0.90, 1.00.
    coins = [0.0, 0.04, 0.06, 0.34, 0.36, 0.5, 0.71, 0.95, 0.9999]
    params = _params([(1.0, 1.0, 0.0, 0.0, coin) for coin in coins])
    tokens = sample_rows(LOGITS.repeat(len(coins), 1), params)
    assert tokens.tolist() == [0, 0, 1, 1, 2, 3, 4, 5, 5]


def test_empirical_frequencies_match_the_distribution() -> None:
    frequencies = _frequencies(_draw_many((1.0, 1.0, 0.0, 0.0)), 6)
    assert torch.allclose(frequencies, PROBS, atol=0.03)


def test_temperature_flattens_the_distribution() -> None:
    expected = torch.softmax(LOGITS / 2.0, dim=-1)
    frequencies = _frequencies(_draw_many((2.0, 1.0, 0.0, 0.0)), 6)
    assert torch.allclose(frequencies, expected, atol=0.03)


def test_top_k_keeps_only_the_k_most_likely_tokens() -> None:
    # Top 2: tokens 1 (0.30) and 3 (0.25), renormalised.
    frequencies = _frequencies(_draw_many((1.0, 1.0, 2.0, 0.0)), 6)
    expected = torch.zeros(6)
    expected[1], expected[3] = 0.30 / 0.55, 0.25 / 0.55
    assert torch.allclose(frequencies, expected, atol=0.03)


def test_top_k_wins_over_top_p() -> None:
    # top_p 0.3 alone would keep only token 1; top_k 3 keeps tokens 1, 3, 4.
    frequencies = _frequencies(_draw_many((1.0, 0.3, 3.0, 0.0)), 6)
    expected = torch.zeros(6)
    expected[[1, 3, 4]] = torch.tensor([0.30, 0.25, 0.20]) / 0.75
    assert torch.allclose(frequencies, expected, atol=0.03)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Descending: 1 (0.30), 3 (0.55), 4 (0.75): p = 0.6 needs tokens 1, 3 and 4.
    frequencies = _frequencies(_draw_many((1.0, 0.6, 0.0, 0.0)), 6)
    expected = torch.zeros(6)
    expected[[1, 3, 4]] = torch.tensor([0.30, 0.25, 0.20]) / 0.75
    assert torch.allclose(frequencies, expected, atol=0.03)


def test_top_k_at_or_above_vocab_keeps_everything() -> None:
    frequencies = _frequencies(_draw_many((1.0, 0.3, 6.0, 0.0)), 6)
    assert torch.allclose(frequencies, PROBS, atol=0.03)


def test_each_row_is_sampled_with_its_own_policy() -> None:
    # One call, four policies; coin 0.99 picks the last kept token in token order.
    params = _params(
        [
            (0.0, 1.0, 0.0, 0.0, 0.99),  # greedy: token 1
            (1.0, 1.0, 0.0, 0.0, 0.99),  # full distribution: token 5
            (1.0, 1.0, 2.0, 0.0, 0.99),  # top-2 {1, 3}: token 3
            (1.0, 0.3, 0.0, 0.0, 0.99),  # top-p 0.3 {1}: token 1
        ]
    )
    assert sample_rows(LOGITS.repeat(4, 1), params).tolist() == [1, 5, 3, 1]


def test_rows_do_not_depend_on_their_neighbours() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 300, generator=generator)
    params = torch.stack(
        [
            torch.tensor([0.0, 0.7, 1.3, 1.0] * 2),  # temperature
            torch.tensor([1.0, 0.9] * 4),  # top_p
            torch.tensor([0.0, 0.0, 5.0, 0.0, 40.0, 0.0, 0.0, 2.0]),  # top_k
            torch.tensor([0.0, 0.1, 0.0, 0.3] * 2),  # min_p
            torch.rand(8, generator=generator),  # coin
        ],
        dim=1,
    )
    together = sample_rows(logits, params)
    alone = [int(sample_rows(logits[i : i + 1], params[i : i + 1])[0]) for i in range(8)]
    assert together.tolist() == alone


def _reference_token(
    logits: np.ndarray, temperature: float, top_p: float, top_k: int, min_p: float, coin: float
) -> int:
    """One row by the book, in float64: min_p first, then a sort for the kept set among
    what is left (renormalised), then walk token order."""
    if temperature == 0.0:
        return int(np.argmax(logits))
    scaled = (logits - logits.max()) / temperature
    probabilities = np.exp(scaled) / np.exp(scaled).sum()
    probabilities = np.where(probabilities >= min_p * probabilities.max(), probabilities, 0.0)
    probabilities /= probabilities.sum()
    by_rank = np.argsort(-probabilities, kind="stable")
    kept = np.ones(len(logits), dtype=bool)
    if 0 < top_k < len(logits):
        kept[:] = False
        kept[by_rank[:top_k]] = True
    elif top_k == 0 and top_p < 1.0:
        preceding = np.cumsum(probabilities[by_rank]) - probabilities[by_rank]
        kept[:] = False
        kept[by_rank[preceding < top_p]] = True
    cumulative = np.cumsum(np.where(kept, probabilities, 0.0))
    return int(np.searchsorted(cumulative, coin * cumulative[-1], side="right"))


def test_matches_a_per_row_reference_including_wide_nuclei() -> None:
    # Flat rows (scale 0.05) have nuclei of thousands of tokens: the candidate set must widen.
    rng = np.random.default_rng(5)
    vocab = 3000
    policies = [
        (0.0, 1.0, 0, 0.0),
        (1.0, 1.0, 0, 0.0),
        (0.7, 1.0, 1, 0.0),
        (1.0, 0.9, 5, 0.0),
        (1.5, 1.0, 300, 0.0),
        (1.0, 1.0, vocab, 0.0),
        (1.0, 0.5, 0, 0.0),
        (0.8, 0.9, 0, 0.0),
        (2.0, 0.99, 0, 0.0),
        (1.0, 1.0, 0, 0.5),
        (1.0, 0.8, 0, 0.2),
        (1.3, 1.0, 40, 0.1),
        (0.0, 1.0, 0, 0.9),
    ]
    rows, params = [], []
    for scale in (0.05, 1.0, 4.0):
        for temperature, top_p, top_k, min_p in policies:
            rows.append(rng.standard_normal(vocab) * scale)
            params.append((temperature, top_p, float(top_k), min_p, rng.random()))
    logits = np.stack(rows).astype(np.float32)
    tokens = sample_rows(torch.from_numpy(logits), torch.tensor(params)).tolist()
    expected = [
        _reference_token(row.astype(np.float64), t, p, int(k), m, float(np.float32(c)))
        for row, (t, p, k, m, c) in zip(logits, params, strict=True)
    ]
    assert tokens == expected


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability() -> None:
    # Top probability 0.30; min_p 0.5 keeps p >= 0.15: tokens 1, 3 and 4, renormalised.
    frequencies = _frequencies(_draw_many((1.0, 1.0, 0.0, 0.5)), 6)
    expected = torch.zeros(6)
    expected[[1, 3, 4]] = torch.tensor([0.30, 0.25, 0.20]) / 0.75
    assert torch.allclose(frequencies, expected, atol=0.03)
    # In token order the kept mass is 0.30 | 0.25 | 0.20: each coin lands where it says.
    coins = [0.0, 0.39, 0.41, 0.72, 0.74, 0.9999]
    params = _params([(1.0, 1.0, 0.0, 0.5, coin) for coin in coins])
    assert sample_rows(LOGITS.repeat(len(coins), 1), params).tolist() == [1, 1, 3, 3, 4, 4]


def test_min_p_applies_after_temperature_and_before_top_p() -> None:
    # Temperature 2 flattens the row: p ~ sqrt(PROBS), top sqrt(0.30); min_p 0.5 then keeps
    # tokens with sqrt(p_i / 0.30) >= 0.5, i.e. PROBS >= 0.075: all but token 0.
    flat = torch.softmax(LOGITS / 2.0, dim=-1)
    expected = torch.where(PROBS >= 0.075, flat, 0.0)
    frequencies = _frequencies(_draw_many((2.0, 1.0, 0.0, 0.5)), 6)
    assert torch.allclose(frequencies, expected / expected.sum(), atol=0.03)
    # min_p 0.75 at temperature 1 keeps tokens 1 and 3 (0.30, 0.25); top_p 0.5 of that
    # renormalised pair (0.545, 0.455) keeps only token 1, which alone reaches 0.5.
    frequencies = _frequencies(_draw_many((1.0, 0.5, 0.0, 0.75)), 6)
    assert frequencies[1].item() == 1.0


def test_min_p_one_keeps_only_the_most_likely_and_greedy_ignores_it() -> None:
    params = _params([(1.0, 1.0, 0.0, 1.0, 0.99), (0.0, 1.0, 0.0, 0.9, 0.5)])
    assert sample_rows(LOGITS.repeat(2, 1), params).tolist() == [1, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_work(dtype: torch.dtype) -> None:
    logits = LOGITS.to(dtype)
    assert sample_rows(logits.repeat(2, 1), _params([GREEDY_ROW, GREEDY_ROW])).tolist() == [1, 1]
    frequencies = _frequencies(_draw_many((1.0, 1.0, 0.0, 0.0), logits), 6)
    assert torch.allclose(frequencies, PROBS, atol=0.03)


def test_coin_rounded_to_one_stays_on_a_kept_token() -> None:
    # 1 - 1e-9 is 1.0 in float32; the draw must still be the last kept token, not past it.
    params = torch.tensor([[1.0, 1.0, 2.0, 0.0, 1.0 - 1e-9], [1.0, 1.0, 0.0, 0.0, 1.0 - 1e-9]])
    assert sample_rows(LOGITS.repeat(2, 1), params).tolist() == [3, 5]


def test_tiny_temperature_is_near_greedy_not_nan() -> None:
    params = _params([(1e-6, 1.0, 0.0, 0.0, 0.5), (1e-6, 0.5, 0.0, 0.0, 0.5)])
    assert sample_rows(LOGITS.repeat(2, 1), params).tolist() == [1, 1]


def test_malformed_shapes_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="params must be"):
        sample_rows(torch.zeros(2, 5), torch.zeros(2, 3))
    with pytest.raises(InvalidArgumentError, match="logits must be"):
        sample_rows(torch.zeros(5), torch.zeros(1, 5))


def test_a_fixed_seed_repeats_its_coins_and_tokens() -> None:
    policy = SamplingParams(temperature=0.8, top_p=0.9)
    first, second = SessionSampler(policy, seed=42), SessionSampler(policy, seed=42)
    coins = [first.coin(index) for index in range(20)]
    assert coins == [second.coin(index) for index in range(20)]
    assert all(0.0 <= coin < 1.0 for coin in coins)
    assert len(set(coins)) == 20
    other = SessionSampler(policy, seed=43)
    assert [other.coin(index) for index in range(20)] != coins


def test_a_coin_depends_only_on_the_seed_and_the_index() -> None:
    """Any order of asking gives each index its coin: a speculative step draws several
    positions at once, a preempted generation asks again for indices it passed."""
    sampler = SessionSampler(SamplingParams(temperature=1.0), seed=7)
    forward = [sampler.coin(index) for index in range(64)]
    assert [sampler.coin(index) for index in reversed(range(64))] == forward[::-1]
    assert SessionSampler(SamplingParams(temperature=1.0), seed=7).coin(31) == forward[31]


def test_coins_are_uniform() -> None:
    sampler = SessionSampler(SamplingParams(temperature=1.0), seed=3)
    coins = np.array([sampler.coin(index) for index in range(20_000)])
    histogram, _ = np.histogram(coins, bins=10, range=(0.0, 1.0))
    assert np.all(np.abs(histogram / len(coins) - 0.1) < 0.01)
    pairs = np.corrcoef(coins[:-1], coins[1:])[0, 1]
    assert abs(pairs) < 0.03  # consecutive indices are not correlated


def test_no_seed_is_nondeterministic() -> None:
    policy = SamplingParams(temperature=1.0)
    draws = {SessionSampler(policy, seed=None).coin(0) for _ in range(5)}
    assert len(draws) == 5


def test_row_carries_the_policy_and_the_coin_of_its_index() -> None:
    sampler = SessionSampler(
        SamplingParams(temperature=0.7, top_p=0.8, top_k=12, min_p=0.05), seed=0
    )
    assert sampler.row(5) == pytest.approx((0.7, 0.8, 12.0, 0.05, sampler.coin(5)))
    assert sampler.params.top_k == 12


def test_negative_seed_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="seed"):
        SessionSampler(SamplingParams(), seed=-1)


# -- SamplingParams ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("min_p", -0.1, "min_p must be in [0, 1]"),
        ("min_p", 1.5, "min_p must be in [0, 1]"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", -3.0, "frequency_penalty must be in [-2, 2]"),
        ("frequency_penalty", float("nan"), "frequency_penalty must be in [-2, 2]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
        ("repetition_penalty", float("inf"), "repetition_penalty must be a finite number > 0"),
        ("logprobs", 21, "logprobs must be None (not asked) or an integer in [0, 20]"),
        ("logprobs", -1, "logprobs must be None"),
        ("logprobs", True, "logprobs must be None"),
        ("prompt_logprobs", 2.0, "prompt_logprobs must be None"),
    ],
)
def test_bad_sampling_params_are_refused_with_the_range(field: str, value: object, says: str):
    with pytest.raises(InvalidArgumentError, match=re.escape(says)):
        SamplingParams(**{field: value})


def test_penalised_says_whether_any_penalty_is_on() -> None:
    assert not SamplingParams(temperature=1.0, min_p=0.1, logprobs=3).penalised
    assert SamplingParams(repetition_penalty=1.1).penalised
    assert SamplingParams(presence_penalty=-0.5).penalised
    assert SamplingParams(frequency_penalty=0.5).penalised
    assert SamplingParams(logprobs=0, prompt_logprobs=20).prompt_logprobs == 20


# -- penalties -----------------------------------------------------------------------------


def test_penalties_follow_their_formulas_exactly() -> None:
    logits = torch.tensor([[2.0, -1.5, 0.7, -0.2, 3.0, 0.0], [1.0, -1.0, 0.5, 0.25, -2.0, 4.0]])
    context = torch.tensor(
        [[True, True, False, True, True, False], [False, True, True, False, True, True]]
    )
    counts = torch.tensor([[0.0, 2.0, 0.0, 1.0, 3.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0, 2.0]])
    penalties = torch.tensor([[1.3, 0.5, 0.4], [0.8, -0.25, 1.5]])  # repetition, presence, freq
    rows, tokens = context.nonzero(as_tuple=True)
    got = apply_penalties(logits, rows, tokens, counts[rows, tokens], penalties)

    expected = logits.numpy().copy()
    for row in range(2):
        repetition, presence, frequency = penalties[row].numpy()
        for token in range(6):
            value = expected[row, token]
            if context[row, token]:
                value = value / repetition if value > 0 else value * repetition
            value -= frequency * counts[row, token].numpy()
            value -= presence * np.float32(counts[row, token] > 0)
            expected[row, token] = value
    assert torch.equal(got, torch.from_numpy(expected))
    # Repetition above 1 lowers a repeated token's logit whatever its sign; a token
    # outside the context and never generated keeps its logit bit for bit.
    assert got[0, 0] == torch.tensor(2.0) / torch.tensor(1.3) < logits[0, 0]
    assert got[0, 3] < logits[0, 3]
    assert got[0, 2] == logits[0, 2] and got[1, 0] == logits[1, 0]
    assert torch.equal(logits[0], torch.tensor([2.0, -1.5, 0.7, -0.2, 3.0, 0.0]))  # a copy


def test_neutral_penalties_leave_the_logits_bit_identical() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    context = torch.rand(3, 50, generator=torch.Generator().manual_seed(5)) > 0.5
    rows, tokens = context.nonzero(as_tuple=True)
    counts = torch.full((len(rows),), 2.0)
    penalties = torch.tensor([[1.0, 0.0, 0.0]]).repeat(3, 1)
    assert torch.equal(apply_penalties(logits, rows, tokens, counts, penalties), logits)


# -- logprobs ------------------------------------------------------------------------------


def test_token_logprobs_are_the_raw_log_softmax_with_the_top_tokens_sorted() -> None:
    logits = torch.randn(150, 300, generator=torch.Generator().manual_seed(6)) * 3
    tokens = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    tops = [row % 21 for row in range(150)]
    found = token_logprobs(logits, tokens, tops)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert len(found) == 150
    for row, entry in enumerate(found):
        assert entry.token == tokens[row]
        assert entry.logprob == pytest.approx(reference[row, tokens[row]].item(), abs=1e-5)
        assert len(entry.top) == tops[row]
        expected = reference[row].topk(tops[row])
        assert [token for token, _ in entry.top] == expected.indices.tolist()
        assert [value for _, value in entry.top] == pytest.approx(
            expected.values.tolist(), abs=1e-5
        )


def test_token_logprobs_of_a_row_do_not_depend_on_the_other_rows() -> None:
    logits = torch.randn(100, 64, generator=torch.Generator().manual_seed(8))
    logits[:, 3] = logits[:, 5]  # ties in the top lists break the same way alone
    tokens = list(range(100))
    tokens = [token % 64 for token in tokens]
    tops = [20 if row % 3 else 1 for row in range(100)]
    together = token_logprobs(logits, tokens, tops)
    alone = [
        token_logprobs(logits[i : i + 1], tokens[i : i + 1], tops[i : i + 1])[0] for i in range(100)
    ]
    assert together == alone


def test_token_logprobs_widen_half_precision_and_cap_the_top_at_the_vocabulary() -> None:
    logits = LOGITS.to(torch.bfloat16).unsqueeze(0)
    (entry,) = token_logprobs(logits, [1], [20])
    assert entry.logprob == pytest.approx(torch.log_softmax(logits.float(), -1)[0, 1].item())
    ranked = [token for token, _ in entry.top]
    assert ranked[:3] == [1, 3, 4] and sorted(ranked) == list(range(6))  # all 6 tokens
    with pytest.raises(InvalidArgumentError, match="one token and one count per logits row"):
        token_logprobs(logits, [1, 2], [0, 0])
