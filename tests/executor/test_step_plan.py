"""plan_slices and pick_width: how a packed step is cut into forwards."""

from __future__ import annotations

import pytest

from cellbatch.executor.step_plan import Slice, pick_width, plan_slices
from cellbatch.types import InvalidArgumentError


def _covers(slices: list[Slice], total: int) -> bool:
    offset = 0
    for piece in slices:
        if piece.offset != offset:
            return False
        offset += piece.length
    return offset == total


def test_a_step_within_the_limit_is_one_wide_forward() -> None:
    assert plan_slices(33, 544, 2) == [Slice(0, 33, wide=True)]


def test_a_long_step_is_cut_at_max_batch_tokens() -> None:
    assert plan_slices(600, 256, 2) == [
        Slice(0, 256, True),
        Slice(256, 256, True),
        Slice(512, 88, True),
    ]


def test_a_short_step_runs_as_one_token_decode_forwards() -> None:
    assert plan_slices(3, 256, 4) == [Slice(0, 1, False), Slice(1, 1, False), Slice(2, 1, False)]


def test_a_single_token_is_never_wide() -> None:
    assert plan_slices(1, 256, 1) == [Slice(0, 1, wide=False)]


def test_a_short_tail_borrows_from_the_slice_before_it() -> None:
    # 257 = 256 + 1 would end in a decode forward; 255 + 2 keeps both wide.
    assert plan_slices(257, 256, 2) == [Slice(0, 255, True), Slice(255, 2, True)]


def test_a_tail_that_cannot_borrow_runs_as_decodes() -> None:
    # Borrowing 3 would leave the first piece at 2 tokens, below the wide minimum 4.
    assert plan_slices(6, 5, 4) == [Slice(0, 5, True), Slice(5, 1, False)]


@pytest.mark.parametrize(
    ("total", "max_step", "min_prefill"),
    [(0, 4, 2), (1, 1, 1), (17, 4, 3), (100, 7, 7), (545, 544, 64), (1000, 33, 2), (9, 3, 8)],
)
def test_slices_cover_the_step_within_the_limits(total: int, max_step: int, min_prefill: int):
    slices = plan_slices(total, max_step, min_prefill)
    assert _covers(slices, total)
    for piece in slices:
        assert 1 <= piece.length <= max_step
        if piece.wide:
            assert piece.length >= max(min_prefill, 2)
        else:
            assert piece.length == 1


@pytest.mark.parametrize(
    ("args", "named"),
    [((-1, 4, 2), "total"), ((4, 0, 2), "max_batch_tokens"), ((4, 4, 0), "min_prefill_tokens")],
)
def test_bad_arguments_are_refused(args: tuple[int, int, int], named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        plan_slices(*args)


def test_pick_width_takes_the_narrowest_that_holds_the_slice() -> None:
    widths = (64, 1, 8, 32)
    assert pick_width(1, widths) == 1
    assert pick_width(2, widths) == 8
    assert pick_width(8, widths) == 8
    assert pick_width(33, iter(widths)) == 64


def test_pick_width_refuses_a_slice_nothing_holds() -> None:
    with pytest.raises(InvalidArgumentError, match=r"no static width holds 65 tokens"):
        pick_width(65, [1, 8, 64])
    with pytest.raises(InvalidArgumentError, match="at least one token"):
        pick_width(0, [1, 8])
