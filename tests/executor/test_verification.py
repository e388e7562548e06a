"""SessionTable.sample with drafts: a verified run keeps exactly the tokens one-at-a-time
decoding draws (greedy and seeded sampling, penalties, token rules, logprobs), and the
rejected drafts' cells are rewound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cellbatch.cache import CellCache
from cellbatch.executor.packed_step import PackedStep, select_rows
from cellbatch.executor.session_table import SessionTable
from cellbatch.generation_config import SamplingParams
from cellbatch.types import BatchInput, Input, Output

VOCAB = 24
PROMPT = [1, 2, 3, 4, 5, 6]


def _table() -> SessionTable:
    return SessionTable(CellCache(512), 4, 128)


def _run(table: SessionTable, inputs: list[Input], drafts: list[int] | None = None) -> PackedStep:
    step = table.pack(BatchInput(tuple(inputs)), drafts)
    assert table.cache.declare_step(step.seq_ids)
    table.cache.place_step(step.seq_ids, step.positions)
    return step


def _logits(position: int) -> torch.Tensor:
    """A fake model whose logits depend on the position they predict from."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(500 + position)) * 2


def _decoded(
    params: SamplingParams, seed: int, steps: int
) -> tuple[list[Output], SessionTable, int]:
    """A session's outputs decoding one token a step, its table and its id."""
    table = _table()
    sid = table.open()
    table.set_sampling(sid, params, seed)
    _run(table, [Input(sid, True, 0, len(PROMPT), tuple(PROMPT), 0)])
    outputs = [table.sample([sid], _logits(len(PROMPT) - 1)[None])[0]]
    for _ in range(steps - 1):
        position = table.position(sid)
        _run(table, [Input(sid, True, 0, 1, outputs[-1].tokens, position)])
        outputs.append(table.sample([sid], _logits(position)[None])[0])
    return outputs, table, sid


def _one_at_a_time(params: SamplingParams, seed: int, steps: int) -> list[Output]:
    """The session's outputs decoding one token a step."""
    return _decoded(params, seed, steps)[0]


def _verified(
    params: SamplingParams, seed: int, drafts: list[int], first_steps: int = 1
) -> tuple[list[Output], SessionTable, int]:
    """Decode `first_steps` tokens one at a time, then verify `drafts` after the last."""
    outputs, table, sid = _decoded(params, seed, first_steps)
    start = table.position(sid)
    payload = (*outputs[-1].tokens, *drafts)
    step = _run(table, [Input(sid, True, 0, len(payload), payload, start)], [len(drafts)])
    rows = select_rows(step, 0, step.num_tokens)
    assert rows.rows.tolist() == list(range(len(payload)))  # every row is an output row
    logits = torch.stack([_logits(start + i) for i in range(len(payload))])
    outputs.append(table.sample([sid], logits, [tuple(drafts)])[0])
    return outputs, table, sid


POLICIES = {
    "greedy": SamplingParams(),
    "sampled": SamplingParams(temperature=0.8, top_p=0.9),
    "penalised": SamplingParams(
        temperature=0.8, top_k=8, repetition_penalty=1.6, frequency_penalty=0.9
    ),
    "ruled": SamplingParams(
        temperature=0.8, logit_bias=((3, 4.0),), banned_sequences=((3, 3),), logprobs=2
    ),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("wrong_at", [0, 2, 3, None])
def test_a_verified_run_keeps_what_one_at_a_time_decoding_draws(
    policy: str, wrong_at: int | None
) -> None:
    params = POLICIES[policy]
    reference = _one_at_a_time(params, seed=9, steps=8)
    tokens = [output.tokens[0] for output in reference]
    drafts = tokens[2:6]  # what follows tokens[1], the pending token, right
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % VOCAB
    outputs, table, sid = _verified(params, 9, drafts, first_steps=2)
    kept = 4 if wrong_at is None else wrong_at
    run = outputs[-1]
    assert run.drafted == 4
    assert list(run.tokens) == tokens[2 : 2 + kept + 1]
    assert run.logprobs == tuple(
        lp for output in reference[2 : 2 + kept + 1] for lp in output.logprobs
    )
    # The session holds the prompt, the two tokens decoded and the drafts it kept.
    assert table.position(sid) == len(PROMPT) + 2 + kept
    assert table.history(sid, 64).tolist() == [*PROMPT, *tokens[: 2 + kept]]


def test_the_next_step_continues_after_a_partly_rejected_run() -> None:
    params = POLICIES["sampled"]
    reference = [output.tokens[0] for output in _one_at_a_time(params, seed=4, steps=9)]
    drafts = [*reference[2:4], (reference[4] + 1) % VOCAB, 0]
    outputs, table, sid = _verified(params, 4, drafts, first_steps=2)
    assert list(outputs[-1].tokens) == reference[2:5]
    position = table.position(sid)
    _run(table, [Input(sid, True, 0, 1, (reference[4],), position)])
    nxt = table.sample([sid], _logits(position)[None])[0]
    assert nxt.tokens[0] == reference[5]


def test_drafts_must_end_an_output_producing_input() -> None:
    table = _table()
    sid = table.open()
    with pytest.raises(ValueError, match="drafts end an output-producing input"):
        table.pack(BatchInput((Input(sid, False, 0, 3, (1, 2, 3), 0),)), [2])
    with pytest.raises(ValueError, match="at least one token before them"):
        table.pack(BatchInput((Input(sid, True, 0, 2, (1, 2), 0),)), [2])


def test_a_verified_run_beside_other_sessions_changes_nothing_for_them() -> None:
    table = _table()
    a, b = table.open(), table.open()
    for sid in (a, b):
        table.set_sampling(sid, SamplingParams(temperature=0.8), seed=sid)
    _run(table, [Input(s, True, 0, len(PROMPT), tuple(PROMPT), 0) for s in (a, b)])
    first = table.sample([a, b], torch.stack([_logits(5), _logits(5)]))
    step = _run(
        table,
        [
            Input(a, True, 0, 3, (first[0].tokens[0], 7, 8), 6),
            Input(b, True, 0, 1, first[1].tokens, 6),
        ],
        [2, 0],
    )
    rows = select_rows(step, 0, step.num_tokens)
    assert rows.inputs.tolist() == [0, 0, 0, 1]
    logits = torch.stack([_logits(6), _logits(7), _logits(8), _logits(6)])
    out_a, out_b = table.sample([a, b], logits, [(7, 8), ()])
    assert out_b.drafted == 0 and len(out_b.tokens) == 1
    assert out_a.drafted == 2 and 1 <= len(out_a.tokens) <= 3
    assert table.position(b) == 7
    assert table.position(a) == 6 + len(out_a.tokens)


def test_select_rows_cuts_a_verified_run_across_slices() -> None:
    step = PackedStep(
        tokens=np.zeros(6, np.int64),
        positions=np.arange(6, dtype=np.int64),
        seq_ids=np.zeros(6, np.int64),
        logit_indices=np.array([5], np.int64),
        drafts=np.array([3], np.int64),
    )
    assert select_rows(step, 0, 4).rows.tolist() == [2, 3]
    assert select_rows(step, 4, 2).rows.tolist() == [0, 1]
    assert select_rows(step, 4, 2).inputs.tolist() == [0, 0]
