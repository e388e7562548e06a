"""SessionTable, PackedStep and select_rows (BEHAVIOURS: SessionTable, select_rows, sampling)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cellbatch.cache import CellCache
from cellbatch.executor.packed_step import PackedStep, select_rows
from cellbatch.executor.sampling import SessionSampler, sample_rows, token_logprobs
from cellbatch.executor.session_table import SessionTable
from cellbatch.generation_config import Constraint, SamplingParams
from cellbatch.types import BatchInput, Input, InvalidArgumentError, OutOfResourcesError


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


def _draw_next(table: SessionTable, sids: list[int], logits: torch.Tensor) -> list[int]:
    """`_draw` after feeding each session one more token (0): each draw is its session's
    next token, so it takes the coin of the next index."""
    _run(table, _batch(*(_decode(sid, 0, table.position(sid)) for sid in sids)))
    return _draw(table, sids, logits)


def test_each_session_row_is_sampled_with_its_own_policy() -> None:
    table = _table()
    greedy, top2, unset = table.open(), table.open(), table.open()
    table.set_sampling(greedy, SamplingParams(), seed=1)
    table.set_sampling(top2, SamplingParams(temperature=5.0, top_k=2), seed=1)
    row = _logits(1)
    top_two = set(row[0].topk(2).indices.tolist())
    drawn = [_draw_next(table, [greedy, top2, unset], row.repeat(3, 1)) for _ in range(60)]
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
    for index in range(10):
        expected = sample_rows(logits, torch.tensor([reference.row(index)]))
        assert _draw_next(table, [sid], logits) == expected.tolist()


def test_a_fixed_seed_gives_the_same_tokens_whatever_shares_the_batch() -> None:
    params = SamplingParams(temperature=1.2, top_p=0.95)
    logits = _logits(1, seed=3)

    alone = _table()
    sid = alone.open()
    alone.set_sampling(sid, params, seed=2024)
    solo = [_draw_next(alone, [sid], logits)[0] for _ in range(30)]

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
        shared.append(_draw_next(crowded, sids, batch_logits)[sids.index(sid)])
    assert shared == solo
    assert len(set(solo)) > 1  # really sampled, not greedy


def test_set_sampling_reseeds_each_generation() -> None:
    table = _table()
    sid = table.open()
    params = SamplingParams(temperature=1.0)
    logits = _logits(1)
    table.set_sampling(sid, params, seed=5)
    first = [_draw_next(table, [sid], logits)[0] for _ in range(20)]
    table.set_sampling(sid, params, seed=5)
    assert [_draw_next(table, [sid], logits)[0] for _ in range(20)] == first


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


# -- penalties -----------------------------------------------------------------------------


def _peaked(**values: float) -> torch.Tensor:
    """One logits row: -1 everywhere but the given tokens (t3=2.0 puts 2.0 on token 3)."""
    row = torch.full((1, VOCAB), -1.0)
    for name, value in values.items():
        row[0, int(name[1:])] = value
    return row


def _greedy_with(table: SessionTable, sid: int, **penalties: float) -> None:
    table.set_sampling(sid, SamplingParams(**penalties), seed=0)


def test_repetition_penalty_divides_or_multiplies_context_logits_as_the_formula_says() -> None:
    table = _table()
    sid = table.open()
    _run(table, _batch(_prompt(sid, [3, 7, 3])))
    row = _peaked(t3=2.0, t5=1.6)
    _greedy_with(table, sid, repetition_penalty=1.2)  # 2.0 / 1.2 = 1.667 > 1.6
    assert _draw(table, [sid], row) == [3]
    _greedy_with(table, sid, repetition_penalty=1.3)  # 2.0 / 1.3 = 1.538 < 1.6
    assert _draw(table, [sid], row) == [5]
    _greedy_with(table, sid, repetition_penalty=0.5)  # below 1 favours repeats
    assert _draw(table, [sid], _peaked(t3=1.0, t5=1.6)) == [3]
    # A negative logit is multiplied: -0.5 * 1.3 = -0.65 falls below -0.6.
    negative = torch.full((1, VOCAB), -0.7)
    negative[0, 7], negative[0, 9] = -0.5, -0.6
    _greedy_with(table, sid, repetition_penalty=1.1)  # -0.55 stays above -0.6
    assert _draw(table, [sid], negative) == [7]
    _greedy_with(table, sid, repetition_penalty=1.3)
    assert _draw(table, [sid], negative) == [9]


def test_frequency_and_presence_penalties_count_only_this_generation_s_tokens() -> None:
    def generate(**penalties: float) -> list[int]:
        table = _table()
        sid = table.open()
        _run(table, _batch(_prompt(sid, [3, 3, 3])))  # the prompt's 3s do not count
        _greedy_with(table, sid, **penalties)
        tokens = []
        for position in range(3, 7):
            tokens += _draw(table, [sid], _peaked(t3=2.0, t5=1.6))
            _run(table, _batch(_decode(sid, tokens[-1], position)))
        return tokens

    # frequency 0.5: 3 (2.0), then 3 at 1.5 < 1.6: 5; 3 at 1.5 > 5 at 1.1: 3; 1.0 < 1.1: 5.
    assert generate(frequency_penalty=0.5) == [3, 5, 3, 5]
    # presence 0.5 counts each token once: 3, 5, then 3 (1.5) beats 5 (1.1) for good.
    assert generate(presence_penalty=0.5) == [3, 5, 3, 3]
    assert generate(presence_penalty=-0.5) == [3, 3, 3, 3]  # negative favours repeats


def test_a_new_generation_resets_the_counts_but_not_the_context() -> None:
    table = _table()
    sid = table.open()
    _run(table, _batch(_prompt(sid, [1, 2])))
    _greedy_with(table, sid, frequency_penalty=0.5)
    assert _draw(table, [sid], _peaked(t3=2.0, t5=1.6)) == [3]
    _run(table, _batch(_decode(sid, 3, 2)))
    assert _draw(table, [sid], _peaked(t3=2.0, t5=1.6)) == [5]
    _greedy_with(table, sid, frequency_penalty=0.5)  # the next turn: counts start again
    assert _draw(table, [sid], _peaked(t3=2.0, t5=1.6)) == [3]
    _greedy_with(table, sid, repetition_penalty=1.3)  # ... but 3 is in the context
    assert _draw(table, [sid], _peaked(t3=2.0, t5=1.6)) == [5]


def test_penalties_see_exactly_a_clone_s_prefix_and_a_truncated_context() -> None:
    table = _table()
    source = table.open()
    _run(table, _batch(_prompt(source, [3, 8, 8, 5])))
    clone = table.clone(source, 2)  # holds [3, 8]: 3 is repeated there, 5 is not
    both = _peaked(t3=2.0, t5=1.9)
    _greedy_with(table, clone, repetition_penalty=1.3)
    _greedy_with(table, source, repetition_penalty=1.3)
    assert _draw(table, [clone, source], both.repeat(2, 1)) == [5, 3]
    table.truncate(source, 3)  # source holds [3, 8, 8]: 5 is gone from its context
    assert _draw(table, [source], both) == [5]
    _run(table, _batch(_prompt(source, [9, 5], position=3)))  # fed again: penalised again
    assert _draw(table, [source], _peaked(t5=1.9, t7=1.6)) == [7]  # 1.9 / 1.3 < 1.6


def test_seeded_sampling_with_penalties_does_not_depend_on_the_batch() -> None:
    params = SamplingParams(
        temperature=0.9, top_p=0.95, repetition_penalty=1.4, frequency_penalty=0.6, min_p=0.05
    )
    row = _logits(1, seed=9)

    def generate(table: SessionTable, sid: int, others: list[int]) -> list[int]:
        table.set_sampling(sid, params, seed=77)
        _run(table, _batch(_prompt(sid, [1, 2, 3, 1]), *(_prompt(o, [o, 4]) for o in others)))
        tokens: list[int] = []
        for step in range(25):
            sids = [*others[: step % 3], sid, *others[step % 3 :]]
            logits = _logits(len(sids), seed=step)
            logits[sids.index(sid)] = row[0]
            tokens.append(_draw(table, sids, logits)[sids.index(sid)])
            cursor = {s: table.position(s) for s in sids}
            _run(
                table, _batch(*(_decode(s, tokens[-1] if s == sid else 0, cursor[s]) for s in sids))
            )
        return tokens

    alone = _table()
    solo = generate(alone, alone.open(), [])
    crowded = _table()
    others = [crowded.open() for _ in range(3)]
    crowded.set_sampling(others[0], SamplingParams(temperature=1.0, presence_penalty=1.0), 1)
    crowded.set_sampling(others[1], SamplingParams(repetition_penalty=2.0, logprobs=3), 2)
    assert generate(crowded, crowded.open(), others) == solo
    assert len(set(solo)) > 3  # sampled, and the penalties keep it from settling


# -- logprobs ------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits_only_for_the_sessions_that_ask() -> None:
    table = _table()
    plain, asking, penalised = table.open(), table.open(), table.open()
    _run(table, _batch(*(_prompt(sid, [3, 3]) for sid in (plain, asking, penalised))))
    table.set_sampling(asking, SamplingParams(logprobs=2), seed=0)
    table.set_sampling(penalised, SamplingParams(repetition_penalty=2.0, logprobs=0), seed=0)
    row = _peaked(t3=2.0, t5=1.6)
    outputs = table.sample([plain, asking, penalised], row.repeat(3, 1))
    assert outputs[0].logprobs == () and outputs[0].prompt_logprobs == ()
    raw = torch.log_softmax(row[0], dim=-1)
    (chosen,) = outputs[1].logprobs
    assert chosen.token == 3 and chosen.logprob == pytest.approx(raw[3].item(), abs=1e-6)
    assert [token for token, _ in chosen.top] == [3, 5]
    (chosen,) = outputs[2].logprobs  # penalised to 5, scored under the raw distribution
    assert chosen.token == 5 and chosen.top == ()
    assert chosen.logprob == pytest.approx(raw[5].item(), abs=1e-6)


# -- prompt logprobs -----------------------------------------------------------------------


def _position_logits(position: int) -> torch.Tensor:
    """The logits a fake model gives every session at `position`."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 + position))


def _execute(table: SessionTable, batch: BatchInput, slice_tokens: int = 64) -> list:
    """What an executor does: pack, then per slice score the scored rows and sample the
    output rows, with logits from `_position_logits`."""
    step = _run(table, batch)
    outputs: list = [None] * len(batch.inputs)
    for offset in range(0, step.num_tokens, slice_tokens):
        length = min(slice_tokens, step.num_tokens - offset)
        picked = select_rows(step, offset, length)
        positions = step.positions[picked.rows + offset].tolist()
        logits = torch.stack([_position_logits(p) for p in positions])
        if picked.scored.any():
            rows = picked.rows[picked.scored] + offset
            table.score(step, rows, logits[torch.from_numpy(picked.scored)])
        wanted = picked.inputs >= 0
        indices = picked.inputs[wanted].tolist()
        sids = [batch.inputs[i].sid for i in indices]
        for index, output in zip(indices, table.sample(sids, logits[wanted]), strict=True):
            outputs[index] = output
    return outputs


def _expected_prompt_logprobs(tokens: list[int], first: int, top: int) -> list:
    """Entries for tokens[first:]: None for the first, then each from the row before."""
    return [None] + [
        token_logprobs(_position_logits(p - 1)[None], [tokens[p]], [top])[0]
        for p in range(first + 1, len(tokens))
    ]


@pytest.mark.parametrize("chunk", [3, 7, 10])
@pytest.mark.parametrize("slice_tokens", [2, 5, 64])
def test_prompt_logprobs_gather_across_chunks_steps_and_slices(chunk: int, slice_tokens: int):
    table = _table()
    sid, other = table.open(), table.open()
    table.set_sampling(sid, SamplingParams(prompt_logprobs=3), seed=0)
    prompt = [5, 9, 2, 14, 7, 7, 1, 0, 11, 6]
    for offset in range(0, 10, chunk):
        last = offset + chunk >= 10
        size = min(chunk, 10 - offset)
        # A neighbour in every step shares the slices.
        out = _execute(
            table,
            _batch(
                _prompt(other, [4, 4], position=table.position(other)),
                _prompt(sid, prompt, offset, size, output=last),
            ),
            slice_tokens,
        )[1]
    assert out.prompt_logprobs == tuple(_expected_prompt_logprobs(prompt, 0, 3))
    assert out.logprobs == ()
    # Decodes of the same generation score nothing more.
    step = table.pack(_batch(_decode(sid, out.tokens[0], 10)))
    assert step.score_ranges is None


def test_prompt_chunks_sharing_a_step_score_each_other() -> None:
    table = _table()
    sid, other = table.open(), table.open()
    table.set_sampling(sid, SamplingParams(prompt_logprobs=0), seed=0)
    prompt = list(range(8))
    batch = _batch(
        _prompt(sid, prompt, 0, 3, output=False),
        _prompt(other, [1, 2, 3]),
        _prompt(sid, prompt, 3, 5),
    )
    # Every row of the session's chunks but the output row, which samples.
    assert table.pack(batch).score_ranges.tolist() == [[0, 3], [0, 0], [6, 10]]
    table.truncate(sid, 0)
    table.truncate(other, 0)
    table = _table()
    sid, other = table.open(), table.open()
    table.set_sampling(sid, SamplingParams(prompt_logprobs=0), seed=0)
    out = _execute(table, batch, slice_tokens=4)[2]
    assert out.prompt_logprobs == tuple(_expected_prompt_logprobs(prompt, 0, 0))


def test_only_sessions_that_ask_get_scored_rows() -> None:
    table = _table()
    a, b = table.open(), table.open()
    table.set_sampling(a, SamplingParams(temperature=1.0, logprobs=5), seed=0)
    step = table.pack(_batch(_prompt(a, [1, 2, 3]), _prompt(b, [4, 5])))
    assert step.score_ranges is None
    assert select_rows(step, 0, 5).rows.tolist() == [2, 4]


def test_a_replayed_prompt_keeps_its_entries_once() -> None:
    table = _table()
    sid = table.open()
    table.set_sampling(sid, SamplingParams(prompt_logprobs=2), seed=0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    _execute(table, _batch(_prompt(sid, prompt, 0, 4, output=False)))
    table.truncate(sid, 1)  # preempted: the runner feeds the rest again
    replay = _batch(_prompt(sid, prompt, 1, 3, output=False), _prompt(sid, prompt, 4, 4))
    step = table.pack(replay)
    # Rows 0-2 of the replay scored positions 2-4, which have entries: none again.
    assert step.score_ranges.tolist() == [[0, 0], [3, 6]]
    table.truncate(sid, 1)
    out = _execute(table, replay)[1]
    assert out.prompt_logprobs == tuple(_expected_prompt_logprobs(prompt, 0, 2))


def test_a_clone_s_prompt_logprobs_start_after_the_shared_prefix() -> None:
    table = _table()
    source = table.open()
    prompt = [8, 6, 7, 5, 3, 0, 9]
    _execute(table, _batch(_prompt(source, prompt, 0, 4)))
    clone = table.clone(source, 4)
    table.set_sampling(clone, SamplingParams(prompt_logprobs=1), seed=0)
    out = _execute(table, _batch(_prompt(clone, prompt, 4, 3)))[0]
    # Position 4 follows logits the clone never computed: None, then scored.
    assert out.prompt_logprobs == tuple(_expected_prompt_logprobs(prompt, 4, 1))
    assert len(out.prompt_logprobs) == 3 and out.prompt_logprobs[0] is None


def test_a_one_token_prompt_chunk_after_a_pending_row_is_scored() -> None:
    table = _table()
    sid = table.open()
    table.set_sampling(sid, SamplingParams(prompt_logprobs=4), seed=0)
    prompt = [2, 7, 1]
    _execute(table, _batch(_prompt(sid, prompt, 0, 2, output=False)))
    out = _execute(table, _batch(_prompt(sid, prompt, 2, 1)))[0]  # no scored row at all
    assert out.prompt_logprobs == tuple(_expected_prompt_logprobs(prompt, 0, 4))


def test_a_constraint_without_a_compiler_is_refused_naming_why() -> None:
    table = _table()
    sid = table.open()
    with pytest.raises(InvalidArgumentError, match="no tokenizer"):
        table.set_sampling(sid, SamplingParams(constraint=Constraint.regex("a+")), seed=1)
    logits = torch.zeros(1, 8)
    logits[0, 5] = 1.0
    assert table.sample([sid], logits)[0].tokens == (5,)  # still greedy, unconstrained
