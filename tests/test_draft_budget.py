"""DraftBudget: drafts only where they raise the expected tokens per second."""

from __future__ import annotations

import pytest

from cellbatch.generation_config import GenConfig
from cellbatch.runner.draft_budget import DraftBudget
from cellbatch.runner.generation import Generation, GenerationKind
from cellbatch.speculative import SpeculativeConfig

K = 4


def _generations(count: int, max_new: int = 100) -> list[Generation]:
    return [
        Generation(GenConfig(max_new_tokens=max_new), None, None, kind=GenerationKind.TURN)
        for _ in range(count)
    ]


def _budget(**config: object) -> DraftBudget:
    budget = DraftBudget(SpeculativeConfig("ngram", num_speculative_tokens=K, **config))  # type: ignore[arg-type]
    # Up to 40 rows a row costs 3% of a one-row step (reading the weights dominates);
    # beyond, the step is compute-bound: a row costs 0.8 of what a token of a 40-row
    # step does.
    for width in (1, 2, 8, 16, 32, 40):
        budget.observe(width, 0.010 * (1 + 0.03 * (width - 1)))
    forty = 0.010 * (1 + 0.03 * 39)
    budget.observe(256, forty * (1 + 0.8 * 216 / 40))
    return budget


def test_a_single_stream_drafts_as_far_as_acceptance_pays() -> None:
    budget = _budget()
    (one,) = _generations(1)
    assert budget.grant([one], 1, 500) == [K]  # the prior (1 in 2 kept) pays at 3% a row
    for _ in range(20):  # its drafts are all rejected
        budget.verified(one, K, 0)
    assert budget.grant([one], 1, 500) == [0]
    for _ in range(20):
        budget.verified(one, K, K)
    assert budget.grant([one], 1, 500) == [K]


def test_many_decoding_sessions_draft_only_near_certain_runs() -> None:
    budget = _budget()
    sessions = _generations(40)
    grants = budget.grant(sessions, 40, 500)
    assert grants == [0] * 40  # the prior's 1 in 2 kept does not pay a compute-bound row
    for _ in range(30):
        budget.verified(sessions[0], K, K)  # one session always right
    grants = budget.grant(sessions, 40, 500)
    assert grants[0] > 0 and grants[1:] == [0] * 39


def test_grants_fit_the_spare_tokens_and_the_token_budget() -> None:
    budget = _budget()
    sessions = _generations(3)
    assert sum(budget.grant(sessions, 3, 5)) == 5
    short = _generations(1, max_new=3)[0]
    short.metrics.generated_tokens = 1
    assert budget.grant([short], 1, 500) == [1]  # two tokens left: one draft and its draw
    short.metrics.generated_tokens = 2
    assert budget.grant([short], 1, 500) == [0]


def test_disable_by_batch_size_turns_drafts_off_at_that_many_decodes() -> None:
    budget = _budget(disable_by_batch_size=2)
    assert budget.grant(_generations(1), 1, 500) == [K]
    assert budget.grant(_generations(2), 2, 500) == [0, 0]


def test_a_generation_backed_off_is_tried_again_later() -> None:
    budget = _budget()
    (one,) = _generations(1)
    for _ in range(20):
        budget.verified(one, K, 0)
    steps = 0
    while budget.grant([one], 1, 500) == [0]:
        steps += 1
        assert steps < 500, "never tried again"
    assert steps > 0


def test_step_time_is_interpolated_between_widths_observed() -> None:
    budget = DraftBudget(SpeculativeConfig("ngram"))
    assert budget.time(1) == 1.0  # before any step: the prior, in one-token steps
    budget.observe(4, 0.02)
    budget.observe(12, 0.06)
    assert budget.time(8) == pytest.approx(0.04)
    assert budget.time(4) == 0.02
    assert 0.0 < budget.time(1) < 0.02 < budget.time(20)


def test_a_stream_reads_its_own_step_times_not_a_batchs() -> None:
    """Drafts of one stream are nearly free beside its weights; rows of more sessions
    are not: a width costs what steps of the same base took."""
    budget = DraftBudget(SpeculativeConfig("ngram", num_speculative_tokens=K))
    for width in (2, 4, 6):  # two sessions and their drafts: every row costs
        budget.observe(width, 0.010 * width, base=2)
    budget.observe(1, 0.010, base=1)
    budget.observe(3, 0.0102, base=1)
    (one,) = _generations(1)
    for _ in range(20):
        budget.verified(one, K, K - 1)
    assert budget.grant([one], 1, 500) == [K]
    assert budget.time(4, base=2) == pytest.approx(0.040)


def test_a_width_the_model_rules_out_is_measured_again() -> None:
    budget = DraftBudget(SpeculativeConfig("ngram", num_speculative_tokens=K))
    budget.observe(1, 0.010, base=1)
    budget.observe(2, 0.500, base=1)  # one slow step: drafts look ruinous
    (one,) = _generations(1)
    grants = [budget.grant([one], 1, 500)[0] for _ in range(32)]
    assert grants.count(0) >= 30 and max(grants) > 0
