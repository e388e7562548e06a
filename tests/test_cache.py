"""CellCache, AttentionPlan and the KV pool under them (docs/design.md#cell-kv-cache-and-kv-pool;
BEHAVIOURS "Cell cache and KV pool")."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cellbatch.cache import AttentionPlan, CellCache
from cellbatch.kv_format import (
    dequantize_heads,
    quantize_heads,
    read_heads,
    store_heads,
)
from cellbatch.kv_pool import SCRATCH_CELL, KVPool
from cellbatch.types import InvalidArgumentError

# -- helpers -----------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These tensors are tiny: thread hand-offs would cost more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def step_positions(cache: CellCache, seq_ids: Sequence[int]) -> np.ndarray:
    """Each token's next position, counting earlier tokens of its sequence in the step."""
    taken: dict[int, int] = {}
    positions = []
    for seq in seq_ids:
        positions.append(cache.seq_length(seq) + taken.get(seq, 0))
        taken[seq] = taken.get(seq, 0) + 1
    return np.array(positions, dtype=np.int64)


def run_step(
    cache: CellCache, seq_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, AttentionPlan]:
    ids = np.array(seq_ids, dtype=np.int64)
    positions = step_positions(cache, seq_ids)
    assert cache.declare_step(ids)
    cells = cache.place_step(ids, positions)
    return ids, positions, cells, cache.attention_plan(ids, positions, cells)


def visible_cells(plan: AttentionPlan, window: int | None = None) -> list[list[int]]:
    """Per token (token-axis order), the cells it attends to, in key order; also checks
    that every token sits in exactly one group, once."""
    seen: list[list[int] | None] = [None] * plan.num_tokens
    for group in plan.groups:
        mask = group.mask(window)[:, 0]
        for g in range(group.rows.shape[0]):
            for q in range(group.rows.shape[1]):
                if not group.query_valid[g, q]:
                    continue
                row = int(group.rows[g, q])
                assert seen[row] is None, f"token {row} appears twice in the plan"
                seen[row] = group.cells[g][mask[g, q]].tolist()
    assert all(cells is not None for cells in seen), "a token is missing from the plan"
    return seen  # type: ignore[return-value]


def prefill(cache: CellCache, seq: int, count: int) -> np.ndarray:
    run_step(cache, [seq] * count)
    return cache.seq_cells(seq)


# -- attention pattern ---------------------------------------------------------------


def test_one_sequence_attends_only_its_own_prefix() -> None:
    cache = CellCache(16)
    seq = cache.seq_alloc()
    _, _, cells, plan = run_step(cache, [seq] * 4)
    assert visible_cells(plan) == [cells[: i + 1].tolist() for i in range(4)]
    _, _, decode_cells, plan = run_step(cache, [seq])
    assert visible_cells(plan) == [[*cells.tolist(), int(decode_cells[0])]]


def test_two_sequences_never_see_each_others_cells() -> None:
    cache = CellCache(16)
    a, b = cache.seq_alloc(), cache.seq_alloc()
    a_cells, b_cells = prefill(cache, a, 3), prefill(cache, b, 3)
    _, _, cells, plan = run_step(cache, [a, b])
    assert visible_cells(plan) == [
        [*a_cells.tolist(), int(cells[0])],
        [*b_cells.tolist(), int(cells[1])],
    ]


def test_prefill_of_several_sequences_in_one_step_keeps_them_apart() -> None:
    cache = CellCache(16)
    a, b = cache.seq_alloc(), cache.seq_alloc()
    _, positions, cells, plan = run_step(cache, [a, b, a, b, a])
    assert positions.tolist() == [0, 0, 1, 1, 2]
    seen = visible_cells(plan)
    a_cells, b_cells = cells[[0, 2, 4]].tolist(), cells[[1, 3]].tolist()
    assert seen == [a_cells[:1], b_cells[:1], a_cells[:2], b_cells[:2], a_cells[:3]]
    assert cache.seq_cells(a).tolist() == a_cells
    assert cache.seq_cells(b).tolist() == b_cells


def test_a_decode_and_a_prefill_share_one_step() -> None:
    cache = CellCache(16)
    a, b = cache.seq_alloc(), cache.seq_alloc()
    a_cells = prefill(cache, a, 3)
    _, _, cells, plan = run_step(cache, [a, b, b, b, b])
    assert plan.num_tokens == 5
    assert sorted(tuple(g.rows.shape) for g in plan.groups) == [(1, 1), (1, 4)]
    decode = next(g for g in plan.groups if g.rows.shape[1] == 1)
    assert decode.key_len.tolist() == [4]
    assert visible_cells(plan) == [
        [*a_cells.tolist(), int(cells[0])],
        *[cells[1 : 2 + i].tolist() for i in range(4)],
    ]


def test_groups_pad_queries_and_keys_and_padded_queries_see_key_zero_only() -> None:
    cache = CellCache(32)
    a, b, c = cache.seq_alloc(), cache.seq_alloc(), cache.seq_alloc()
    prefill(cache, a, 5)
    ids, _, _, plan = run_step(cache, [a, a, b, c, b, b, b])
    (multi,) = [g for g in plan.groups if g.rows.shape[1] > 1]
    (single,) = [g for g in plan.groups if g.rows.shape[1] == 1]
    assert single.rows.tolist() == [[3]]
    assert multi.rows.shape == (2, 4)
    assert multi.query_valid.tolist() == [[True, True, False, False], [True] * 4]
    assert multi.query_pos.tolist() == [[5, 6, 0, 0], [0, 1, 2, 3]]
    assert multi.key_len.tolist() == [7, 4]
    assert multi.cells.shape == (2, 7)
    assert multi.cells[1, 4:].tolist() == [SCRATCH_CELL] * 3
    for row in multi.rows[0].tolist():  # padded queries point at a row of their sequence
        assert ids[row] == a
    for window in (None, 1, 2):
        mask = multi.mask(window)
        assert mask.shape == (2, 1, 4, 7)
        assert mask[0, 0, 2:].tolist() == [[True] + [False] * 6] * 2
        assert bool(mask.any(dim=-1).all()), "a query with no visible key breaks softmax"
        assert multi.mask(window) is mask  # cached per window
    with pytest.raises(InvalidArgumentError, match="window"):
        multi.mask(0)


def test_every_layer_of_a_step_uses_the_same_placement() -> None:
    cache = CellCache(32)
    pool = KVPool(num_layers=3, num_kv_heads=1, head_dim=1, capacity=32, initial_cells=2)
    a, b = cache.seq_alloc(), cache.seq_alloc()
    for seq_ids in ([a, a, a, b, b], [a, b], [b, b, a]):
        ids, positions, cells, plan = run_step(cache, seq_ids)
        pool.ensure(cache.high_water())
        for layer in range(3):
            value = torch.tensor(100.0 * layer + positions + 1000.0 * ids, dtype=torch.float32)
            pool.k[layer][cells] = value[:, None, None]
        for group in plan.groups:
            for layer in range(3):
                keys = pool.k[layer][group.cells][:, :, 0, 0]
                for g, length in enumerate(group.key_len.tolist()):
                    seq = int(ids[int(group.rows[g, 0])])
                    expected = 100.0 * layer + torch.arange(length) + 1000.0 * seq
                    assert torch.equal(keys[g, :length], expected)


def test_sliding_window_and_sequence_ownership_both_narrow_the_pattern() -> None:
    cache = CellCache(32)
    a = cache.seq_alloc()
    a_cells = prefill(cache, a, 6)
    b = cache.seq_clone(a, 3)
    _, _, b_own, _ = run_step(cache, [b, b])
    _, _, b_decode, plan = run_step(cache, [b])
    b_cells = [*a_cells[:3].tolist(), *b_own.tolist(), int(b_decode[0])]
    assert cache.seq_cells(b).tolist() == b_cells
    assert visible_cells(plan) == [b_cells]
    assert visible_cells(plan, window=3) == [b_cells[3:]]
    assert visible_cells(plan, window=4) == [b_cells[2:]]
    assert not set(visible_cells(plan)[0]) & set(a_cells[3:].tolist())


def test_the_window_bounds_each_query_by_its_own_position() -> None:
    cache = CellCache(16)
    seq = cache.seq_alloc()
    _, _, cells, plan = run_step(cache, [seq] * 6)
    c = cells.tolist()
    assert visible_cells(plan, window=2) == [c[max(0, i - 1) : i + 1] for i in range(6)]
    assert visible_cells(plan, window=1) == [[x] for x in c]


# -- capacity and placement -----------------------------------------------------------


def test_declaring_more_tokens_than_free_cells_is_refused_and_changes_nothing() -> None:
    cache = CellCache(4)
    a = cache.seq_alloc()
    prefill(cache, a, 3)
    assert cache.declare_step(np.array([a]))
    assert not cache.declare_step(np.array([a, a]))
    assert cache.free_cells() == 1 and cache.seq_length(a) == 3
    cells = cache.place_step(np.array([a]), np.array([3]))  # the earlier declaration holds
    assert cells.tolist() == [4] and cache.free_cells() == 0
    assert not cache.declare_step(np.array([a]))


def test_place_requires_a_matching_declaration_and_consumes_it() -> None:
    cache = CellCache(8)
    a, b = cache.seq_alloc(), cache.seq_alloc()
    with pytest.raises(InvalidArgumentError, match="declare"):
        cache.place_step(np.array([a]), np.array([0]))
    assert cache.declare_step(np.array([a]))
    with pytest.raises(InvalidArgumentError, match="declared"):
        cache.place_step(np.array([b]), np.array([0]))
    cache.place_step(np.array([a]), np.array([0]))
    with pytest.raises(InvalidArgumentError, match="declare"):
        cache.place_step(np.array([a]), np.array([1]))
    assert cache.used_cells() == 1


@pytest.mark.parametrize(
    ("seq_ids", "positions", "named"),
    [
        ([0], [2], "position 2"),  # already held
        ([0], [4], "position 4"),  # a gap
        ([0, 0], [4, 3], "position 4"),  # out of order within the step
        ([1, 0, 0], [0, 3, 3], "position 3"),  # repeated within the step
    ],
)
def test_a_wrong_position_is_refused_and_the_declaration_stays_usable(
    seq_ids: list[int], positions: list[int], named: str
) -> None:
    cache = CellCache(16)
    a, b = cache.seq_alloc(), cache.seq_alloc()
    prefill(cache, a, 3)
    before = (cache.free_cells(), cache.seq_cells(a).tolist(), cache.seq_length(b))
    assert cache.declare_step(np.array(seq_ids))
    with pytest.raises(InvalidArgumentError, match=f"sequence 0.*{named}"):
        cache.place_step(np.array(seq_ids), np.array(positions))
    assert (cache.free_cells(), cache.seq_cells(a).tolist(), cache.seq_length(b)) == before
    cells = cache.place_step(np.array(seq_ids), step_positions(cache, seq_ids))
    assert len(cells) == len(seq_ids)


def test_unknown_sequences_and_bad_boundaries_are_named() -> None:
    cache = CellCache(8)
    a = cache.seq_alloc()
    prefill(cache, a, 2)
    with pytest.raises(InvalidArgumentError, match="sequences \\[5\\]"):
        cache.declare_step(np.array([a, 5]))
    with pytest.raises(InvalidArgumentError, match="sequence 3"):
        cache.seq_length(3)
    with pytest.raises(InvalidArgumentError, match="upto <= 2"):
        cache.seq_clone(a, 3)
    with pytest.raises(InvalidArgumentError, match="< 0"):
        cache.seq_rewind(a, -1)
    with pytest.raises(InvalidArgumentError, match="positive"):
        CellCache(0)


def test_cells_are_handed_out_lowest_first_and_never_the_scratch_cell() -> None:
    cache = CellCache(6)
    a, b = cache.seq_alloc(), cache.seq_alloc()
    assert prefill(cache, a, 4).tolist() == [1, 2, 3, 4]
    assert cache.high_water() == 5
    cache.seq_rewind(a, 1)
    _, _, cells, _ = run_step(cache, [b, b, b, b, b])
    assert cells.tolist() == [2, 3, 4, 5, 6]
    assert cache.free_cells() == 0 and cache.high_water() == 7


# -- clones, rewinds, ids -----------------------------------------------------------------


def test_clone_shares_cells_without_copying() -> None:
    cache = CellCache(16)
    a = cache.seq_alloc()
    a_cells = prefill(cache, a, 5)
    b = cache.seq_clone(a, 5)
    assert cache.seq_cells(b).tolist() == a_cells.tolist()
    assert cache.used_cells() == 5 and cache.seq_length(b) == 5


def test_freeing_the_source_keeps_the_clones_cells() -> None:
    cache = CellCache(16)
    a = cache.seq_alloc()
    a_cells = prefill(cache, a, 5)
    b = cache.seq_clone(a, 5)
    cache.seq_release(a)
    assert cache.used_cells() == 5
    assert cache.cell_positions(a_cells).tolist() == [0, 1, 2, 3, 4]
    _, _, cells, plan = run_step(cache, [b])
    assert cells.tolist() == [6]
    assert visible_cells(plan) == [[*a_cells.tolist(), 6]]


def test_a_clone_can_share_a_prefix_only() -> None:
    cache = CellCache(16)
    a = cache.seq_alloc()
    a_cells = prefill(cache, a, 5)
    b = cache.seq_clone(a, 2)
    assert cache.seq_length(b) == 2
    _, _, cells, plan = run_step(cache, [b, a])
    assert cells.tolist() == [6, 7]
    assert visible_cells(plan) == [[*a_cells[:2].tolist(), 6], [*a_cells.tolist(), 7]]
    empty = cache.seq_clone(a, 0)
    assert cache.seq_length(empty) == 0
    cache.seq_release(a)
    assert cache.used_cells() == 3


def test_a_cell_is_freed_when_its_last_owner_goes() -> None:
    cache = CellCache(16)
    a = cache.seq_alloc()
    cells = prefill(cache, a, 4)
    b, c = cache.seq_clone(a, 4), cache.seq_clone(a, 2)
    cache.seq_release(a)
    assert cache.used_cells() == 4
    cache.seq_release(b)
    assert cache.used_cells() == 2
    assert cache.cell_positions(cells).tolist() == [0, 1, -1, -1]
    cache.seq_release(c)
    assert cache.used_cells() == 0 and cache.free_cells() == 16


def test_rewind_frees_exactly_the_positions_from_p() -> None:
    cache = CellCache(16)
    a = cache.seq_alloc()
    cells = prefill(cache, a, 6)
    b = cache.seq_clone(a, 5)
    cache.seq_rewind(a, 3)
    assert cache.seq_length(a) == 3 and cache.seq_cells(a).tolist() == cells[:3].tolist()
    assert cache.used_cells() == 5  # b still holds positions 3 and 4
    assert cache.cell_positions(cells).tolist() == [0, 1, 2, 3, 4, -1]
    cache.seq_rewind(b, 3)
    assert cache.used_cells() == 3
    cache.seq_rewind(a, 10)  # beyond its length: nothing to drop
    assert cache.seq_length(a) == 3


def test_refilling_holes_keeps_the_pattern_defined_by_positions() -> None:
    cache = CellCache(16)
    a, b = cache.seq_alloc(), cache.seq_alloc()
    assert prefill(cache, a, 4).tolist() == [1, 2, 3, 4]
    assert prefill(cache, b, 2).tolist() == [5, 6]
    cache.seq_rewind(a, 1)
    _, _, _, plan = run_step(cache, [b])
    assert cache.seq_cells(b).tolist() == [5, 6, 2]  # not in cell order
    assert visible_cells(plan) == [[5, 6, 2]]
    assert visible_cells(plan, window=2) == [[6, 2]]
    _, _, _, plan = run_step(cache, [a, a, a])
    assert cache.seq_cells(a).tolist() == [1, 3, 4, 7]
    assert visible_cells(plan, window=2) == [[1, 3], [3, 4], [4, 7]]


def test_sequence_ids_are_reused_after_release_lowest_first() -> None:
    cache = CellCache(8)
    assert [cache.seq_alloc() for _ in range(4)] == [0, 1, 2, 3]
    cache.seq_release(2)
    cache.seq_release(1)
    assert [cache.seq_alloc(), cache.seq_alloc(), cache.seq_alloc()] == [1, 2, 4]
    assert cache.seq_clone(0, 0) == 5


def test_more_than_1024_live_sequences() -> None:
    count = 1100
    cache = CellCache(3 * count)
    seqs = [cache.seq_alloc() for _ in range(count)]
    assert seqs == list(range(count))
    run_step(cache, seqs)
    clones = [cache.seq_clone(seq, 1) for seq in seqs[:50]]
    _, _, cells, plan = run_step(cache, seqs + clones)
    assert cache.live_sequences() == count + 50
    assert cache.used_cells() == 2 * count + 50
    (group,) = plan.groups
    assert group.rows.shape == (count + 50, 1)
    assert group.cells[count + 7].tolist() == [8, int(cells[count + 7])]


def test_clear_returns_every_cell_and_sequence() -> None:
    cache = CellCache(16)
    a = cache.seq_alloc()
    prefill(cache, a, 5)
    cache.seq_clone(a, 3)
    assert cache.declare_step(np.array([a]))
    cache.clear()
    assert cache.free_cells() == 16 and cache.used_cells() == 0
    assert cache.live_sequences() == 0
    with pytest.raises(InvalidArgumentError):
        cache.seq_length(1)
    with pytest.raises(InvalidArgumentError, match="declare"):
        cache.place_step(np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert cache.seq_alloc() == 0
    assert prefill(cache, 0, 2).tolist() == [1, 2]


def test_attention_plan_checks_it_follows_the_placed_step() -> None:
    cache = CellCache(8)
    a = cache.seq_alloc()
    ids, positions, cells, _ = run_step(cache, [a, a])
    with pytest.raises(InvalidArgumentError, match="place_step"):
        cache.attention_plan(ids, positions + 1, cells)
    with pytest.raises(InvalidArgumentError, match="place_step"):
        cache.attention_plan(ids, positions, np.array([SCRATCH_CELL, 2]))


def test_plan_of_32_long_decodes_in_a_full_pool_gathers_each_own_cells() -> None:
    cache = CellCache(65536)
    seqs = [cache.seq_alloc() for _ in range(32)]
    for _ in range(8):  # interleaved chunks scatter each sequence's cells over the pool
        run_step(cache, np.repeat(seqs, 255).tolist())
    run_step(cache, np.repeat(seqs, 7).tolist())
    ids, positions, cells, _ = run_step(cache, seqs)
    assert cache.used_cells() == 32 * 2048 and cache.free_cells() == 65536 - 32 * 2048
    plan = cache.attention_plan(ids, positions, cells)
    assert plan.groups[0].cells.shape == (32, 2048)
    for row, seq in enumerate(seqs):
        assert plan.groups[0].cells[row].tolist() == cache.seq_cells(seq).tolist()


# -- int8 heads, and a plan over a small pool ----------------------------------------


def test_int8_heads_round_trip_within_half_a_step_of_their_own_scale() -> None:
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(50, 4, 32, generator=generator) * torch.rand(50, 4, 1, generator=generator)
    values[7, 2] = 0  # an all-zero head: scale 0, codes 0
    rows = quantize_heads(values)
    assert rows.shape == (50, 4, 36) and rows.dtype == torch.int8
    back = dequantize_heads(rows, torch.float32)
    step = values.abs().amax(dim=-1, keepdim=True) / 127
    assert ((back - values).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(back[7, 2], torch.zeros(32))
    # The largest value of each head is held exactly at code +-127.
    assert rows[..., :32].abs().amax(dim=-1)[values.abs().amax(dim=-1) > 0].eq(127).all()


def test_a_plan_gathers_real_and_scratch_cells_from_a_small_pool() -> None:
    cache = CellCache(1000)
    pool = KVPool(1, 1, 2, capacity=1000, initial_cells=2)
    a, b = cache.seq_alloc(), cache.seq_alloc()
    prefill(cache, a, 3)
    _, _, _, plan = run_step(cache, [a, b])
    pool.ensure(cache.high_water())
    assert pool.rows == 8
    gathered = pool.k[0][plan.groups[0].cells]
    assert gathered.shape == (2, 4, 1, 2)
    assert plan.groups[0].cells[1].tolist() == [5, SCRATCH_CELL, SCRATCH_CELL, SCRATCH_CELL]


# -- random histories against naive references --------------------------------------------


class NaiveCells:
    """Reference bookkeeping: a plain list of cells per sequence (index = position), and
    the definition of visibility (docs/design.md#cell-kv-cache-and-kv-pool) over every
    occupied cell."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.seqs: dict[int, list[int]] = {}

    def cell_position(self) -> dict[int, int]:
        positions: dict[int, int] = {}
        for cells in self.seqs.values():
            for position, cell in enumerate(cells):
                assert positions.setdefault(cell, position) == position
        return positions

    def free(self) -> int:
        return self.capacity - len(self.cell_position())

    def next_id(self) -> int:
        return min(set(range(len(self.seqs) + 1)) - set(self.seqs))

    def lowest_free(self, count: int) -> list[int]:
        occupied = self.cell_position()
        return [c for c in range(1, self.capacity + 1) if c not in occupied][:count]

    def visible(self, seq: int, position: int, window: int | None) -> list[int]:
        owned = set(self.seqs[seq])
        seen = [
            (cell_pos, cell)
            for cell, cell_pos in self.cell_position().items()
            if cell in owned
            and cell_pos <= position
            and (window is None or cell_pos > position - window)
        ]
        return [cell for _, cell in sorted(seen)]


class HistoryObserver:
    def opened(self, seq: int) -> None: ...
    def cloned(self, src: int, seq: int, upto: int) -> None: ...
    def rewound(self, seq: int, position: int) -> None: ...
    def stepped(
        self,
        cache: CellCache,
        naive: NaiveCells,
        ids: np.ndarray,
        positions: np.ndarray,
        cells: np.ndarray,
    ) -> None: ...


def run_history(ops: list[tuple], capacity: int, observer: HistoryObserver) -> CellCache:
    """Drives a CellCache and a NaiveCells through the same history and compares the
    bookkeeping after every operation; `observer` sees every step."""
    cache = CellCache(capacity)
    naive = NaiveCells(capacity)
    for op in ops:
        live = sorted(naive.seqs)
        kind = op[0]
        if kind == "open":
            seq = cache.seq_alloc()
            assert seq == naive.next_id()
            naive.seqs[seq] = []
            observer.opened(seq)
        elif not live:
            continue
        elif kind == "close":
            seq = live[op[1] % len(live)]
            cache.seq_release(seq)
            del naive.seqs[seq]
        elif kind == "clone":
            src = live[op[1] % len(live)]
            upto = op[2] % (len(naive.seqs[src]) + 1)
            seq = cache.seq_clone(src, upto)
            assert seq == naive.next_id()
            naive.seqs[seq] = naive.seqs[src][:upto]
            observer.cloned(src, seq, upto)
        elif kind == "rewind":
            seq = live[op[1] % len(live)]
            position = op[2] % (len(naive.seqs[seq]) + 2)
            cache.seq_rewind(seq, position)
            del naive.seqs[seq][position:]
            observer.rewound(seq, position)
        else:
            _, picks, interleave, wrong_shift = op
            counts = {live[i % len(live)]: n for i, n in picks}
            if interleave:
                order = [s for k in range(max(counts.values())) for s, n in counts.items() if k < n]
            else:
                order = [s for s, n in counts.items() for _ in range(n)]
            ids = np.array(order, dtype=np.int64)
            positions = step_positions(cache, order)
            free_before = naive.free()
            if not cache.declare_step(ids):
                assert len(ids) > free_before
            else:
                assert len(ids) <= free_before
                if wrong_shift:
                    wrong = positions.copy()
                    wrong[0] += wrong_shift
                    with pytest.raises(InvalidArgumentError, match=f"sequence {order[0]}"):
                        cache.place_step(ids, wrong)
                cells = cache.place_step(ids, positions)
                assert cells.tolist() == naive.lowest_free(len(ids))
                for seq, cell in zip(order, cells.tolist(), strict=True):
                    naive.seqs[seq].append(cell)
                observer.stepped(cache, naive, ids, positions, cells)
        assert cache.free_cells() == naive.free()
        assert cache.used_cells() == capacity - naive.free()
        for seq, cells in naive.seqs.items():
            assert cache.seq_cells(seq).tolist() == cells
    return cache


def history_ops(max_seq_tokens: int) -> st.SearchStrategy[list[tuple]]:
    index = st.integers(0, 50)
    step = st.tuples(
        st.just("step"),
        st.lists(st.tuples(index, st.integers(1, max_seq_tokens)), min_size=1, max_size=4),
        st.booleans(),
        st.sampled_from([0, 0, -1, 1]),
    )
    other = st.one_of(
        st.just(("open",)),
        st.tuples(st.just("close"), index),
        st.tuples(st.just("clone"), index, index),
        st.tuples(st.just("rewind"), index, index),
    )
    # Histories start with a few open sequences; steps are half of what follows.
    return st.builds(
        lambda opens, rest: [("open",)] * opens + rest,
        st.integers(1, 3),
        st.lists(st.one_of(step, other), min_size=8, max_size=40),
    )


class PatternChecker(HistoryObserver):
    def stepped(
        self,
        cache: CellCache,
        naive: NaiveCells,
        ids: np.ndarray,
        positions: np.ndarray,
        cells: np.ndarray,
    ) -> None:
        plan = cache.attention_plan(ids, positions, cells)
        assert plan.num_tokens == len(ids)
        for group in plan.groups:
            for g, row in enumerate(group.rows[:, 0].tolist()):
                assert int(group.key_len[g]) == len(naive.seqs[int(ids[row])])
        for window in (None, 1, 3):
            expected = [
                naive.visible(seq, position, window)
                for seq, position in zip(ids.tolist(), positions.tolist(), strict=True)
            ]
            assert visible_cells(plan, window) == expected


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=history_ops(max_seq_tokens=6))
def test_random_histories_match_a_naive_reference(ops: list[tuple]) -> None:
    run_history(ops, capacity=24, observer=PatternChecker())


class ContiguousAttention(HistoryObserver):
    """Writes random K/V into a KVPool at the placed cells and checks attention through
    the plan against attention over a contiguous K/V list per sequence (of the values the
    pool holds: an int8 pool's dequantised ones)."""

    heads, head_dim, layers = 2, 4, 2

    def __init__(self, capacity: int, seed: int, dtype: torch.dtype = torch.float32) -> None:
        self.pool = KVPool(
            self.layers, self.heads, self.head_dim, capacity, dtype=dtype, initial_cells=2
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.kv: dict[int, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def opened(self, seq: int) -> None:
        self.kv[seq] = [[] for _ in range(self.layers)]

    def cloned(self, src: int, seq: int, upto: int) -> None:
        self.kv[seq] = [layer[:upto] for layer in self.kv[src]]

    def rewound(self, seq: int, position: int) -> None:
        for layer in self.kv[seq]:
            del layer[position:]

    def stepped(
        self,
        cache: CellCache,
        naive: NaiveCells,
        ids: np.ndarray,
        positions: np.ndarray,
        cells: np.ndarray,
    ) -> None:
        shape = (len(ids), self.heads, self.head_dim)
        self.pool.ensure(cache.high_water())
        queries = torch.randn(shape, generator=self.generator)
        for layer in range(self.layers):
            keys, values = (
                read_heads(
                    store_heads(torch.randn(shape, generator=self.generator), self.pool.dtype),
                    torch.float32,
                )
                for _ in range(2)
            )
            self.pool.k[layer][torch.from_numpy(cells)] = store_heads(keys, self.pool.dtype)
            self.pool.v[layer][torch.from_numpy(cells)] = store_heads(values, self.pool.dtype)
            for i, (seq, position) in enumerate(zip(ids.tolist(), positions.tolist(), strict=True)):
                assert len(self.kv[seq][layer]) == position
                self.kv[seq][layer].append((keys[i], values[i]))
        plan = cache.attention_plan(ids, positions, cells)
        for layer in range(self.layers):
            for window in (None, 2):
                got = self.plan_attention(plan, layer, queries, window)
                for i, (seq, position) in enumerate(
                    zip(ids.tolist(), positions.tolist(), strict=True)
                ):
                    start = 0 if window is None else max(0, position - window + 1)
                    history = self.kv[seq][layer][start : position + 1]
                    expected = self.contiguous_attention(queries[i], history)
                    torch.testing.assert_close(got[i], expected, rtol=1e-5, atol=1e-5)

    def plan_attention(
        self, plan: AttentionPlan, layer: int, queries: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        out = torch.full_like(queries, float("nan"))
        for group in plan.groups:
            keys = read_heads(self.pool.k[layer][group.cells], torch.float32)  # [G, Tk, H, D]
            values = read_heads(self.pool.v[layer][group.cells], torch.float32)
            scores = torch.einsum("gqhd,gkhd->ghqk", queries[group.rows], keys)
            scores = scores / math.sqrt(self.head_dim)
            scores = scores.masked_fill(~group.mask(window), float("-inf"))
            attended = torch.einsum("ghqk,gkhd->gqhd", scores.softmax(-1), values)
            out[group.rows[group.query_valid]] = attended[group.query_valid]
        return out

    def contiguous_attention(
        self, query: torch.Tensor, history: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        keys = torch.stack([k for k, _ in history])  # [T, H, D]
        values = torch.stack([v for _, v in history])
        weights = (torch.einsum("hd,thd->ht", query, keys) / math.sqrt(self.head_dim)).softmax(-1)
        return torch.einsum("ht,thd->hd", weights, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=history_ops(max_seq_tokens=5), seed=st.integers(0, 2**16))
def test_attention_over_cells_equals_attention_over_a_contiguous_cache(
    dtype: torch.dtype, ops: list[tuple], seed: int
) -> None:
    run_history(ops, capacity=32, observer=ContiguousAttention(32, seed, dtype))
