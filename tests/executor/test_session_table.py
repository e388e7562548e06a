"""SessionTable, PackedStep and select_rows (BEHAVIOURS: SessionTable, select_rows, sampling)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cellbatch.cache import CellCache
from cellbatch.executor.sampling import SessionSampler, sample_rows
from cellbatch.executor.session_table import PackedStep, SessionTable, select_rows
from cellbatch.types import (
    BatchInput,
    Input,
    InvalidArgumentError,
    OutOfResourcesError,
    SamplingParams,
)


def _table(max_sessions: int = 8, max_session_tokens: int = 64) -> SessionTable:
    return SessionTable(CellCache(256), max_sessions, max_session_tokens)


def _batch(*inputs: Input) -> BatchInput:
    return BatchInput(tuple(inputs))


def _prompt(
    sid: int,
    payload: list[int],
    offset: int = 0,
    size: int | None = None,
    position: int = 0,
    output: bool = True,
) -> Input:
    size = len(payload) - offset if size is None else size
    return Input(sid, output, offset, size, tuple(payload), position)


def _decode(sid: int, token: int, position: int) -> Input:
    return Input(sid, True, 0, 1, (token,), position)


def _run(table: SessionTable, batch: BatchInput) -> PackedStep:
    """Pack and commit a step the way an executor does: declare, then place its cells."""
    step = table.pack(batch)
    assert table.cache.declare_step(step.seq_ids)
    table.cache.place_step(step.seq_ids, step.positions)
    return step


# -- pack ------------------------------------------------------------------------------


def test_pack_lays_inputs_in_order_with_their_logits_rows() -> None:
    table = _table()
    a, b = table.open(), table.open()
    _run(table, _batch(_prompt(a, [5, 6, 7])))
    step = table.pack(
        _batch(
            _prompt(b, [10, 11, 12, 13], output=False),
            _decode(a, 8, position=3),
            _prompt(b, [14, 15], position=4),
        )
    )
    assert step.tokens.tolist() == [10, 11, 12, 13, 8, 14, 15]
    assert step.positions.tolist() == [0, 1, 2, 3, 3, 4, 5]
    seq_a, seq_b = table.seq_of(a), table.seq_of(b)
    assert step.seq_ids.tolist() == [seq_b] * 4 + [seq_a] + [seq_b] * 2
    assert step.logit_indices.tolist() == [-1, 4, 6]
    assert all(array.dtype == np.int64 for array in (step.tokens, step.positions, step.seq_ids))
    assert step.logit_indices.dtype == np.int64


def test_consecutive_chunks_of_one_prompt_abut() -> None:
    table = _table()
    sid = table.open()
    prompt = list(range(100, 110))
    chunks = [_prompt(sid, prompt, offset=o, size=4, output=False) for o in (0, 4)]
    step = _run(table, _batch(*chunks, _prompt(sid, prompt, offset=8, size=2)))
    assert step.positions.tolist() == list(range(10))
    assert step.tokens.tolist() == prompt
    assert step.logit_indices.tolist() == [-1, -1, 9]
    assert table.position(sid) == 10
    # The next turn continues from where the session stands: payload base + offset.
    step = _run(table, _batch(_prompt(sid, [1, 2, 3, 4], offset=1, size=3, position=9)))
    assert step.positions.tolist() == [10, 11, 12]
    assert step.tokens.tolist() == [2, 3, 4]


def test_a_start_below_the_session_length_rewinds_it() -> None:
    table = _table()
    sid = table.open()
    _run(table, _batch(_prompt(sid, [1, 2, 3, 4, 5, 6])))
    kept = table.cache.seq_cells(table.seq_of(sid))[:3]
    step = _run(table, _batch(_prompt(sid, [9, 9], position=3)))
    assert step.positions.tolist() == [3, 4]
    assert table.position(sid) == 5
    assert table.cache.seq_cells(table.seq_of(sid))[:3].tolist() == kept.tolist()
    assert table.cache.used_cells() == 5


@pytest.mark.parametrize(
    ("second", "problem"),
    [
        (_prompt(0, [1, 2], position=5), "continue where the session stands"),  # gap after 3
        (_prompt(0, [1, 2], position=2), "overlapping"),  # overlaps [0, 3) in the batch
    ],
)
def test_gap_and_overlap_within_a_batch_are_invalid(second: Input, problem: str) -> None:
    table = _table()
    assert table.open() == 0
    with pytest.raises(InvalidArgumentError, match=problem):
        table.pack(_batch(_prompt(0, [7, 8, 9]), second))


def test_a_gap_after_the_committed_length_is_invalid() -> None:
    table = _table()
    sid = table.open()
    _run(table, _batch(_prompt(sid, [1, 2, 3])))
    with pytest.raises(InvalidArgumentError, match="holds 3 positions"):
        table.pack(_batch(_decode(sid, 4, position=4)))


def test_rewind_to_zero_is_invalid_but_starting_an_empty_session_at_zero_is_not() -> None:
    table = _table()
    sid = table.open()
    _run(table, _batch(_prompt(sid, [1, 2, 3])))
    with pytest.raises(InvalidArgumentError, match="rewinds the session to 0"):
        table.pack(_batch(_prompt(sid, [4, 5])))
    assert table.position(sid) == 3
    empty_clone = table.clone(sid, 0)
    assert table.pack(_batch(_prompt(empty_clone, [4, 5]))).positions.tolist() == [0, 1]


def test_past_max_session_tokens_is_out_of_resources() -> None:
    table = _table(max_session_tokens=8)
    sid = table.open()
    _run(table, _batch(_prompt(sid, list(range(6)))))
    table.pack(_batch(_prompt(sid, [1, 2], position=6)))  # exactly 8 fits
    with pytest.raises(OutOfResourcesError, match="max_session_tokens=8"):
        table.pack(_batch(_prompt(sid, [1, 2, 3], position=6)))


@pytest.mark.parametrize(
    ("bad", "error", "problem"),
    [
        (_decode(99, 1, position=0), InvalidArgumentError, "not open"),
        (Input(1, True, 0, 0, (1, 2), 0), InvalidArgumentError, "at least one token"),
        (Input(1, True, 1, 2, (1, 2), 0), InvalidArgumentError, "at least one token"),
        (_prompt(1, [1, 2], position=4), InvalidArgumentError, "continue where"),
        (_prompt(1, [-1], position=2), InvalidArgumentError, "negative"),
        (_prompt(1, list(range(40)), position=2), OutOfResourcesError, "max_session_tokens"),
    ],
)
def test_a_refused_batch_changes_nothing(bad: Input, error: type, problem: str) -> None:
    table = _table(max_session_tokens=32)
    a, b = table.open(), table.open()
    _run(table, _batch(_prompt(a, [1, 2, 3, 4, 5]), _prompt(b, [6, 7])))
    cells_before = table.cache.seq_cells(table.seq_of(a)).tolist()
    # The first input is a valid rewind of a to 2; it must not happen when a later one fails.
    with pytest.raises(error, match=problem):
        table.pack(_batch(_prompt(a, [9], position=2), bad))
    assert table.position(a) == 5
    assert table.cache.seq_cells(table.seq_of(a)).tolist() == cells_before
    assert table.cache.used_cells() == 7


def test_an_empty_batch_is_invalid() -> None:
    with pytest.raises(InvalidArgumentError, match="no inputs"):
        _table().pack(_batch())


def test_pack_does_not_place_cells() -> None:
    table = _table()
    sid = table.open()
    table.pack(_batch(_prompt(sid, [1, 2, 3])))
    assert table.cache.used_cells() == 0
    assert table.position(sid) == 0


# -- sessions --------------------------------------------------------------------------


def test_sessions_are_bounded_and_clones_count() -> None:
    table = _table(max_sessions=2)
    sid = table.open()
    table.clone(sid, 0)
    with pytest.raises(OutOfResourcesError, match="max_sessions"):
        table.open()
    with pytest.raises(OutOfResourcesError, match="max_sessions"):
        table.clone(sid, 0)
    table.close(sid)
    table.open()
    assert len(table) == 2


def test_session_ids_are_never_reused_even_after_close() -> None:
    table = _table()
    first, second = table.open(), table.open()
    released_seqs = {table.seq_of(first), table.seq_of(second)}
    table.close(second)
    table.close(first)
    third = table.open()
    assert third > second
    assert table.seq_of(third) in released_seqs  # the cache's sequence id is recycled
    assert table.sessions() == [third]
    assert second not in table
    with pytest.raises(InvalidArgumentError, match="not open"):
        table.position(second)


def test_close_releases_the_cache_sequence_and_ignores_unknown_ids() -> None:
    table = _table()
    sid = table.open()
    seq = table.seq_of(sid)
    _run(table, _batch(_prompt(sid, [1, 2, 3, 4])))
    assert table.cache.used_cells() == 4
    table.close(sid)
    table.close(sid)
    table.close(12345)
    assert table.cache.used_cells() == 0
    assert len(table) == 0
    with pytest.raises(InvalidArgumentError):
        table.cache.seq_length(seq)  # the sequence itself is released, not just emptied


def test_clone_shares_the_source_prefix_without_copying() -> None:
    table = _table()
    source = table.open()
    _run(table, _batch(_prompt(source, [1, 2, 3, 4, 5])))
    clone = table.clone(source, 3)
    assert clone != source
    assert table.position(clone) == 3
    shared = table.cache.seq_cells(table.seq_of(source))[:3].tolist()
    assert table.cache.seq_cells(table.seq_of(clone)).tolist() == shared
    assert table.cache.used_cells() == 5
    # The clone grows on its own and keeps the shared cells after the source closes.
    _run(table, _batch(_prompt(clone, [8, 9], position=3)))
    table.close(source)
    assert table.position(clone) == 5
    assert table.cache.seq_cells(table.seq_of(clone))[:3].tolist() == shared


@pytest.mark.parametrize("upto", [-1, 6])
def test_a_clone_outside_the_source_is_refused(upto: int) -> None:
    table = _table()
    source = table.open()
    _run(table, _batch(_prompt(source, [1, 2, 3, 4, 5])))
    with pytest.raises(InvalidArgumentError, match=r"must be in \[0, 5\]"):
        table.clone(source, upto)
    assert len(table) == 1
    assert table.position(source) == 5
    with pytest.raises(InvalidArgumentError, match="not open"):
        table.clone(77, 0)


def test_constructor_rejects_non_positive_limits() -> None:
    with pytest.raises(InvalidArgumentError, match="max_sessions"):
        SessionTable(CellCache(8), 0, 8)
    with pytest.raises(InvalidArgumentError, match="max_session_tokens"):
        SessionTable(CellCache(8), 1, 0)


# -- sampling per session ----------------------------------------------------------------

VOCAB = 16


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def _draw(table: SessionTable, sids: list[int], logits: torch.Tensor) -> list[int]:
    """The tokens `table.sample` draws (one per output)."""
    outputs = table.sample(sids, logits)
    assert [output.sid for output in outputs] == sids
    return [output.tokens[0] for output in outputs]


def test_each_session_row_is_sampled_with_its_own_policy() -> None:
    table = _table()
    greedy, top2, unset = table.open(), table.open(), table.open()
    table.set_sampling(greedy, SamplingParams(), seed=1)
    table.set_sampling(top2, SamplingParams(temperature=5.0, top_k=2), seed=1)
    row = _logits(1)
    top_two = set(row[0].topk(2).indices.tolist())
    drawn = [_draw(table, [greedy, top2, unset], row.repeat(3, 1)) for _ in range(60)]
    argmax = int(row.argmax())
    assert all(tokens[0] == argmax and tokens[2] == argmax for tokens in drawn)
    assert {tokens[1] for tokens in drawn} == top_two


def test_session_draws_follow_its_seeded_coins() -> None:
    table = _table()
    sid = table.open()
    params = SamplingParams(temperature=1.0, top_p=0.9)
    table.set_sampling(sid, params, seed=11)
    logits = _logits(1)
    reference = SessionSampler(params, seed=11)
    for _ in range(10):
        expected = sample_rows(logits, torch.tensor([reference.next_row()]))
        assert _draw(table, [sid], logits) == expected.tolist()


def test_a_fixed_seed_gives_the_same_tokens_whatever_shares_the_batch() -> None:
    params = SamplingParams(temperature=1.2, top_p=0.95)
    logits = _logits(1, seed=3)

    alone = _table()
    sid = alone.open()
    alone.set_sampling(sid, params, seed=2024)
    solo = [_draw(alone, [sid], logits)[0] for _ in range(30)]

    crowded = _table()
    others = [crowded.open() for _ in range(3)]
    sid = crowded.open()
    crowded.set_sampling(sid, params, seed=2024)
    for index, other in enumerate(others):
        crowded.set_sampling(other, SamplingParams(temperature=1.0, top_k=index), seed=index)
    shared = []
    for step in range(30):
        sids = [*others[: step % 4], sid, *others[step % 4 :]]
        batch_logits = _logits(len(sids), seed=step + 100)
        batch_logits[sids.index(sid)] = logits[0]
        shared.append(_draw(crowded, sids, batch_logits)[sids.index(sid)])
    assert shared == solo
    assert len(set(solo)) > 1  # really sampled, not greedy


def test_set_sampling_reseeds_each_generation() -> None:
    table = _table()
    sid = table.open()
    params = SamplingParams(temperature=1.0)
    logits = _logits(1)
    table.set_sampling(sid, params, seed=5)
    first = [_draw(table, [sid], logits)[0] for _ in range(20)]
    table.set_sampling(sid, params, seed=5)
    assert [_draw(table, [sid], logits)[0] for _ in range(20)] == first


def test_sample_refuses_unknown_sessions_and_mismatched_logits() -> None:
    table = _table()
    sid = table.open()
    with pytest.raises(InvalidArgumentError, match="not open"):
        _draw(table, [sid + 1], _logits(1))
    with pytest.raises(InvalidArgumentError, match=r"shape \[2, vocab\]"):
        _draw(table, [sid, sid], _logits(1))
    with pytest.raises(InvalidArgumentError, match="not open"):
        table.set_sampling(sid + 1, SamplingParams(), seed=None)


# -- select_rows -------------------------------------------------------------------------


def _step_with_rows(logit_indices: list[int], tokens: int) -> PackedStep:
    zeros = np.zeros(tokens, dtype=np.int64)
    return PackedStep(zeros, zeros, zeros, np.asarray(logit_indices, dtype=np.int64))


def test_select_rows_keeps_only_the_slice_rows_relative_to_it() -> None:
    step = _step_with_rows([-1, 3, 9, -1, 12, 15], tokens=16)
    rows, inputs, scored = select_rows(step, 8, 8)
    assert rows.tolist() == [1, 4, 7]
    assert inputs.tolist() == [2, 4, 5]
    assert not scored.any()
    rows, inputs, _ = select_rows(step, 0, 4)
    assert rows.tolist() == [3]
    assert inputs.tolist() == [1]


def test_select_rows_without_wanted_rows_returns_the_slice_last_row() -> None:
    step = _step_with_rows([-1, 3, 15], tokens=16)
    rows, inputs, scored = select_rows(step, 4, 6)
    assert rows.tolist() == [5]
    assert inputs.tolist() == [-1]
    assert scored.tolist() == [False]


def test_select_rows_over_a_packed_batch() -> None:
    table = _table()
    a, b = table.open(), table.open()
    step = table.pack(_batch(_prompt(a, [1, 2, 3, 4, 5]), _prompt(b, [6, 7, 8], output=False)))
    assert select_rows(step, 0, 5)[0].tolist() == [4]
    assert select_rows(step, 5, 3)[1].tolist() == [-1]


@pytest.mark.parametrize(("offset", "length"), [(-1, 2), (0, 0), (10, 7)])
def test_select_rows_refuses_a_slice_outside_the_step(offset: int, length: int) -> None:
    with pytest.raises(InvalidArgumentError, match="select_rows"):
        select_rows(_step_with_rows([3], tokens=16), offset, length)
