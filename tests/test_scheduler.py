"""DecodeFirstScheduler: the behaviours of BEHAVIOURS.md "Scheduler", plus random
operation sequences checked against a simple model and a concurrent run."""

from __future__ import annotations

import itertools
import random
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from cellbatch.scheduler import DecodeFirstScheduler, Scheduler
from cellbatch.types import Input, InvalidArgumentError, Task


def decode(tid: int, sid: int) -> Task:
    return Task(tid, Input(sid, True, 0, 1, (7,), 0), is_decode=True)


def chunk(tid: int, sid: int, size: int, offset: int = 0, output: bool = False) -> Task:
    payload = tuple(range(offset + size))
    return Task(tid, Input(sid, output, offset, size, payload, 0), is_decode=False)


def tids(batch: Sequence[Task]) -> list[int]:
    return [task.tid for task in batch]


def sids(batch: Sequence[Task]) -> list[int]:
    return [task.sid for task in batch]


def ids(tasks: Sequence[Task]) -> list[int]:
    """Object identities: the scheduler hands back the very tasks it was given."""
    return [id(task) for task in tasks]


def one_chunk_per_batch() -> DecodeFirstScheduler:
    """Budget 20, one decode, chunks up to 19: two chunks of 19 never share a batch."""
    return DecodeFirstScheduler.create(20, 1, 19)


# --- create ---------------------------------------------------------------------


def test_create_defaults() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert (
        scheduler.max_batch_tokens,
        scheduler.max_decode_sequences,
        scheduler.max_prefill_chunk,
    ) == (544, 32, 256)
    assert isinstance(scheduler, Scheduler)


@pytest.mark.parametrize(
    "limits", [(0, 32, 256), (544, 0, 256), (544, 32, 0), (-1, 32, 256), (544, 32, -5)]
)
def test_create_refuses_non_positive_limits(limits: tuple[int, int, int]) -> None:
    with pytest.raises(InvalidArgumentError, match="must be a positive integer"):
        DecodeFirstScheduler.create(*limits)


@pytest.mark.parametrize("limits", [(32, 32, 1), (32, 33, 1)])
def test_create_refuses_decodes_at_or_above_budget(limits: tuple[int, int, int]) -> None:
    with pytest.raises(InvalidArgumentError, match="must be below max_batch_tokens"):
        DecodeFirstScheduler.create(*limits)


def test_create_needs_a_full_chunk_to_fit_beside_full_decodes() -> None:
    scheduler = DecodeFirstScheduler.create(288, 32, 256)
    assert scheduler.max_batch_tokens == 288
    with pytest.raises(
        InvalidArgumentError, match=r"at most .* = 255.*raise max_batch_tokens to 288"
    ):
        DecodeFirstScheduler.create(287, 32, 256)


def test_create_accepts_a_huge_budget() -> None:
    scheduler = DecodeFirstScheduler.create(10**12, 32, 256)
    assert scheduler.submit([chunk(1, 1, 256)])
    assert tids(scheduler.get_work()) == [1]


def test_limits_are_read_only() -> None:
    scheduler = DecodeFirstScheduler.create()
    with pytest.raises(AttributeError):
        scheduler.max_prefill_chunk = 1  # type: ignore[misc]


# --- submit ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        chunk(9, 2, 0),
        Task(9, Input(2, True, 0, 0, (), 0), is_decode=True),
        Task(9, Input(2, True, 0, 2, (1, 2), 0), is_decode=True),
        chunk(9, 2, 257),
    ],
    ids=["empty-chunk", "empty-decode", "wide-decode", "chunk-above-chunk-size"],
)
def test_submit_refuses_malformed_task_and_queues_nothing(bad: Task) -> None:
    scheduler = DecodeFirstScheduler.create()
    assert not scheduler.submit([chunk(1, 1, 4), decode(2, 3), bad])
    assert not scheduler.has_work()
    assert scheduler.get_work() == []


def test_submit_accepts_chunk_of_exactly_the_chunk_size() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert scheduler.submit([chunk(1, 1, 256)])
    assert tids(scheduler.get_work()) == [1]


def test_submit_refuses_tid_already_queued() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert scheduler.submit([chunk(1, 1, 4)])
    assert not scheduler.submit([chunk(2, 2, 4), decode(1, 3)])
    assert tids(scheduler.get_work()) == [1]
    assert not scheduler.has_work()


def test_submit_refuses_tid_repeated_within_one_call() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert not scheduler.submit([chunk(1, 1, 4), chunk(1, 2, 4)])
    assert not scheduler.has_work()


def test_tid_is_free_again_once_dispatched() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert scheduler.submit([decode(1, 1)])
    assert tids(scheduler.get_work()) == [1]
    assert scheduler.submit([decode(1, 1)])
    assert tids(scheduler.get_work()) == [1]


def test_tid_is_free_again_once_cancelled() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert scheduler.submit([decode(1, 1)])
    scheduler.cancel(1)
    assert scheduler.submit([decode(1, 2)])
    assert sids(scheduler.get_work()) == [2]


def test_payloads_pass_through_untouched_and_batch_keeps_task_order() -> None:
    scheduler = DecodeFirstScheduler.create()
    payload = [5, 6, 7, 8]
    tasks = [
        Task(1, Input(1, False, 1, 2, payload, 40), is_decode=False),
        Task(2, Input(2, True, 0, 3, payload, 0), is_decode=False),
        decode(3, 3),
        decode(4, 4),
    ]
    assert scheduler.submit(tasks)
    batch = scheduler.get_work()
    assert ids(batch) == ids(tasks[2:] + tasks[:2])
    assert batch[2].input.payload is payload
    assert batch[2].input == Input(1, False, 1, 2, payload, 40)
    assert payload == [5, 6, 7, 8]


def test_one_token_prompt_chunk_is_not_a_decode() -> None:
    scheduler = DecodeFirstScheduler.create(20, 1, 19)
    assert scheduler.submit([chunk(1, 1, 1, output=True), decode(2, 2)])
    batch = scheduler.get_work()
    assert tids(batch) == [2, 1]
    assert [task.is_decode for task in batch] == [True, False]


# --- decodes ----------------------------------------------------------------------


def test_decodes_in_arrival_order_up_to_the_cap() -> None:
    scheduler = DecodeFirstScheduler.create(544, 4, 256)
    assert scheduler.submit([decode(tid, sid=tid) for tid in range(6)])
    assert tids(scheduler.get_work()) == [0, 1, 2, 3]
    assert tids(scheduler.get_work()) == [4, 5]


def test_decodes_stay_fifo_across_drain_and_refill() -> None:
    scheduler = DecodeFirstScheduler.create(544, 4, 256)
    assert scheduler.submit([decode(tid, sid=tid) for tid in range(6)])
    scheduler.get_work()
    assert scheduler.submit([decode(tid, sid=tid) for tid in range(6, 9)])
    assert tids(scheduler.get_work()) == [4, 5, 6, 7]
    assert tids(scheduler.get_work()) == [8]


def test_decodes_go_ahead_of_earlier_prefill() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert scheduler.submit([chunk(1, 1, 100), chunk(2, 2, 100)])
    assert scheduler.submit([decode(3, 3), decode(4, 4)])
    assert tids(scheduler.get_work()) == [3, 4, 1, 2]


def test_full_chunk_fits_beside_a_saturated_decode_set() -> None:
    scheduler = DecodeFirstScheduler.create(288, 32, 256)
    assert scheduler.submit([chunk(1000, 1000, 256)])
    assert scheduler.submit([decode(tid, sid=tid) for tid in range(40)])
    batch = scheduler.get_work()
    assert tids(batch) == [*range(32), 1000]
    assert sum(task.input.size for task in batch) == 288


# --- prefill ----------------------------------------------------------------------


def test_one_prompts_chunks_stay_in_order() -> None:
    scheduler = DecodeFirstScheduler.create(250, 1, 100)
    prompt = [chunk(tid, 1, 100, offset=100 * tid, output=tid == 4) for tid in range(5)]
    assert scheduler.submit(prompt)
    offsets = [task.input.offset for _ in range(3) for task in scheduler.get_work()]
    assert offsets == [0, 100, 200, 300, 400]


def test_long_prompt_cannot_hog_a_batch() -> None:
    scheduler = DecodeFirstScheduler.create(300, 1, 100)
    assert scheduler.submit([chunk(tid, 1, 100, offset=100 * tid) for tid in range(4)])
    assert scheduler.submit([chunk(10, 2, 100)])
    assert tids(scheduler.get_work()) == [0, 10, 1]


def test_lone_session_fills_a_batch_across_passes_and_stops_when_nothing_fits() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert scheduler.submit([chunk(tid, 1, 100, offset=100 * tid) for tid in range(6)])
    first = scheduler.get_work()
    assert tids(first) == [0, 1, 2, 3, 4]  # 500 tokens; the sixth chunk needs 100 > 44
    assert tids(scheduler.get_work()) == [5]
    assert not scheduler.has_work()


def test_prefill_stops_when_nothing_more_fits_among_several_sessions() -> None:
    scheduler = DecodeFirstScheduler.create(20, 1, 19)
    assert scheduler.submit([chunk(1, 1, 12), chunk(2, 2, 9), chunk(3, 3, 7)])
    batch = scheduler.get_work()
    assert tids(batch) == [1, 3]  # 19 tokens: the 9-token chunk no longer fits
    assert tids(scheduler.get_work()) == [2]


def test_deferred_session_outranks_one_never_reached() -> None:
    scheduler = one_chunk_per_batch()
    assert scheduler.submit([chunk(1, 1, 5), chunk(2, 1, 5, offset=5)])  # A
    assert scheduler.submit([chunk(3, 2, 19)])  # B: does not fit after A's chunk
    assert scheduler.submit([chunk(4, 3, 15), chunk(5, 3, 15, offset=15)])  # C: fills the batch
    assert scheduler.submit([chunk(6, 4, 10)])  # D: never reached
    assert sids(scheduler.get_work()) == [1, 3]
    assert sids(scheduler.get_work()) == [2]


def test_deferred_sessions_keep_their_order() -> None:
    scheduler = one_chunk_per_batch()
    assert scheduler.submit([chunk(1, 1, 10), chunk(2, 2, 15), chunk(3, 3, 15), chunk(4, 4, 10)])
    assert sids(scheduler.get_work()) == [1, 4]
    assert sids(scheduler.get_work()) == [2]
    assert sids(scheduler.get_work()) == [3]


def test_rotation_is_fair_across_calls() -> None:
    scheduler = one_chunk_per_batch()
    tid = itertools.count()
    for sid in (1, 2, 3):
        assert scheduler.submit([chunk(next(tid), sid, 19, offset=19 * i) for i in range(3)])
    assert [sids(scheduler.get_work()) for _ in range(9)] == [[1], [2], [3]] * 3


def test_drained_session_rejoins_on_new_work() -> None:
    scheduler = one_chunk_per_batch()
    assert scheduler.submit([chunk(1, 1, 19), chunk(2, 2, 19), chunk(3, 2, 19, offset=19)])
    assert sids(scheduler.get_work()) == [1]
    assert scheduler.submit([chunk(4, 1, 19)])  # session 1 drained; it rejoins at the back
    assert [tids(scheduler.get_work()) for _ in range(3)] == [[2], [4], [3]]
    assert not scheduler.has_work()


# --- composition ------------------------------------------------------------------


def test_one_decode_per_session_per_batch() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert scheduler.submit([decode(1, 1), decode(2, 1), decode(3, 1), decode(4, 2)])
    assert tids(scheduler.get_work()) == [1, 4]
    assert scheduler.submit([decode(5, 3)])
    # The held-back decodes go back to the head, in order.
    assert tids(scheduler.get_work()) == [2, 5]
    assert tids(scheduler.get_work()) == [3]


def test_held_back_decode_keeps_the_head_without_using_a_decode_slot() -> None:
    scheduler = DecodeFirstScheduler.create(20, 2, 18)
    assert scheduler.submit([decode(1, 1), decode(2, 1), decode(3, 2), decode(4, 3)])
    assert tids(scheduler.get_work()) == [1, 3]
    assert tids(scheduler.get_work()) == [2, 4]


def test_prompt_chunk_waits_while_its_sessions_decode_is_in_the_batch() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert scheduler.submit([chunk(1, 1, 10), chunk(2, 2, 10), decode(3, 1)])
    assert tids(scheduler.get_work()) == [3, 2]
    assert tids(scheduler.get_work()) == [1]


def test_session_passed_over_for_its_decode_keeps_the_front() -> None:
    scheduler = one_chunk_per_batch()
    assert scheduler.submit([chunk(1, 1, 10), chunk(2, 2, 18), chunk(3, 3, 18), decode(4, 1)])
    assert tids(scheduler.get_work()) == [4, 2]
    assert tids(scheduler.get_work()) == [1]  # session 1 was passed over: ahead of session 3
    assert tids(scheduler.get_work()) == [3]


def test_consecutive_chunks_of_one_prompt_may_share_a_batch() -> None:
    scheduler = DecodeFirstScheduler.create()
    prompt = [chunk(tid, 1, 100, offset=100 * tid, output=tid == 2) for tid in range(3)]
    assert scheduler.submit(prompt)
    assert tids(scheduler.get_work()) == [0, 1, 2]


def test_at_most_one_output_producing_chunk_per_session_per_batch() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert scheduler.submit([chunk(1, 1, 10, output=True), chunk(2, 1, 10, output=True)])
    assert scheduler.submit([chunk(3, 2, 10)])
    assert tids(scheduler.get_work()) == [1, 3]
    assert tids(scheduler.get_work()) == [2]


# --- priority ---------------------------------------------------------------------


def test_an_urgent_prompt_chunk_keeps_less_urgent_decodes_and_chunks_out() -> None:
    s = DecodeFirstScheduler.create(64, 8, 16)
    s.submit([replace(decode(tid, sid), priority=10) for tid, sid in ((1, 1), (2, 2))])
    s.submit([replace(chunk(3, 3, 8), priority=10)])
    s.submit([decode(4, 4), chunk(5, 5, 16)])  # priority 0: more urgent
    assert tids(s.get_work()) == [4, 5]  # the urgent decode and chunk alone
    # The held-back tasks keep their order and run once no urgent chunk waits.
    assert tids(s.get_work()) == [1, 2, 3]


def test_less_urgent_work_runs_beside_urgent_decodes() -> None:
    s = DecodeFirstScheduler.create(64, 8, 16)
    s.submit([decode(1, 1), replace(decode(2, 2), priority=10)])
    s.submit([replace(chunk(3, 3, 8), priority=10)])
    assert tids(s.get_work()) == [1, 2, 3]  # no urgent chunk waits: everything goes


def test_the_most_urgent_waiting_chunk_sets_the_limit() -> None:
    s = DecodeFirstScheduler.create(64, 8, 16)
    s.submit([replace(chunk(1, 1, 8), priority=20), replace(decode(2, 2), priority=10)])
    s.submit([replace(chunk(3, 3, 8), priority=10)])
    assert tids(s.get_work()) == [2, 3]  # priority 10 runs, 20 waits
    assert tids(s.get_work()) == [1]


# --- cancel -----------------------------------------------------------------------


def test_cancel_returns_every_queued_task_of_the_session_marked_cancelled() -> None:
    scheduler = DecodeFirstScheduler.create()
    mine = [chunk(1, 1, 10), chunk(2, 1, 10, offset=10, output=True), decode(3, 1)]
    assert scheduler.submit([*mine, chunk(4, 2, 10), decode(5, 3)])
    cancelled = scheduler.cancel(1)
    # Copies marked cancelled: tasks are values, the submitted ones stay as they were.
    assert cancelled == [replace(task, cancelled=True) for task in mine]
    assert not any(task.cancelled for task in mine)
    # Other sessions stay runnable.
    assert tids(scheduler.get_work()) == [5, 4]
    assert not scheduler.has_work()


def test_cancel_of_unknown_session_is_ignored() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert scheduler.submit([chunk(1, 1, 10)])
    assert scheduler.cancel(99) == []
    assert tids(scheduler.get_work()) == [1]


def test_double_cancel_reports_each_task_once() -> None:
    scheduler = DecodeFirstScheduler.create()
    assert scheduler.submit([chunk(1, 1, 10), decode(2, 1)])
    assert tids(scheduler.cancel(1)) == [1, 2]
    assert scheduler.cancel(1) == []
    assert not scheduler.has_work()
    assert scheduler.get_work() == []


def test_cancel_does_not_return_dispatched_tasks() -> None:
    scheduler = one_chunk_per_batch()
    assert scheduler.submit([chunk(1, 1, 19), chunk(2, 1, 19, offset=19)])
    (dispatched,) = scheduler.get_work()
    assert tids(scheduler.cancel(1)) == [2]
    assert not dispatched.cancelled


def test_cancelled_task_in_the_middle_of_the_queue_is_skipped() -> None:
    scheduler = DecodeFirstScheduler.create(20, 2, 18)
    assert scheduler.submit([decode(1, 1), decode(2, 2), decode(3, 3)])
    scheduler.cancel(2)
    assert tids(scheduler.get_work()) == [1, 3]


def test_cancelled_session_leaves_the_rotation_and_rejoining_gives_one_turn() -> None:
    scheduler = one_chunk_per_batch()
    tid = itertools.count()
    for sid in (1, 2):
        assert scheduler.submit([chunk(next(tid), sid, 19, offset=19 * i) for i in range(3)])
    assert sids(scheduler.get_work()) == [1]
    scheduler.cancel(1)
    assert scheduler.submit([chunk(next(tid), 1, 19, offset=19 * i) for i in range(3)])
    assert [sids(scheduler.get_work()) for _ in range(6)] == [[2], [1]] * 3


# --- clear ------------------------------------------------------------------------


def test_clear_returns_and_removes_queued_tasks_but_never_dispatched_ones() -> None:
    scheduler = one_chunk_per_batch()
    assert scheduler.submit([chunk(1, 1, 19), chunk(2, 1, 19, offset=19), decode(3, 2)])
    assert tids(scheduler.get_work()) == [3, 1]
    assert tids(scheduler.clear()) == [2]
    assert not scheduler.has_work()
    assert scheduler.get_work() == []
    assert scheduler.clear() == []
    assert scheduler.submit([chunk(2, 1, 19)])  # its tid is free again


# --- random operation sequences -------------------------------------------------------


@st.composite
def scheduler_limits(draw: st.DrawFn) -> tuple[int, int, int]:
    budget = draw(st.integers(2, 40))
    decodes = draw(st.integers(1, budget - 1))
    return budget, decodes, draw(st.integers(1, budget - decodes))


OPERATION_KINDS = ("submit",) * 4 + ("get_work",) * 4 + ("cancel", "clear")


def random_operations(rng: random.Random, chunk_size: int) -> list[tuple[str, object]]:
    """Submits and batches each four times as likely as a cancel or a clear, so that
    queues grow. Tids come from a small range so that reuse and collisions happen;
    about one task in ten is malformed (empty or one token too wide)."""
    ops: list[tuple[str, object]] = []
    for kind in rng.choices(OPERATION_KINDS, k=rng.randint(20, 100)):
        if kind == "submit":
            tasks = []
            for _ in range(rng.randint(1, 4)):
                tid, sid, is_decode = rng.randint(0, 30), rng.randint(0, 4), rng.random() < 0.5
                widest = 1 if is_decode else chunk_size
                size = rng.choice([0, widest + 1]) if rng.random() < 0.1 else rng.randint(1, widest)
                produce_output = is_decode or rng.random() < 0.5
                payload = (1,) * size
                input_ = Input(sid, produce_output, 0, size, payload, 0)
                tasks.append(Task(tid, input_, is_decode))
            ops.append((kind, tasks))
        else:
            ops.append((kind, rng.randint(0, 5) if kind == "cancel" else None))
    return ops


class QueueModel:
    """What must be waiting, in submission order; checks each answer against it."""

    def __init__(self, budget: int, decodes: int, chunk_size: int) -> None:
        self.budget, self.decode_cap, self.chunk_size = budget, decodes, chunk_size
        self.waiting: list[Task] = []
        self.accepted = 0
        self.left: Counter[str] = Counter()

    def should_accept(self, tasks: Sequence[Task]) -> bool:
        if any(not 0 < t.input.size <= (1 if t.is_decode else self.chunk_size) for t in tasks):
            return False
        batch_tids = [t.tid for t in tasks]
        waiting_tids = {t.tid for t in self.waiting}
        return len(set(batch_tids)) == len(batch_tids) and not waiting_tids & set(batch_tids)

    def remove(self, tasks: Sequence[Task], route: str) -> None:
        for task in tasks:
            # By tid: cancel hands back copies (tasks are values); tids are unique here.
            index = next(i for i, t in enumerate(self.waiting) if t.tid == task.tid)
            del self.waiting[index]
        self.left[route] += len(tasks)

    def check_batch(self, batch: list[Task]) -> None:
        assert bool(batch) == bool(self.waiting), "work waiting but nothing handed out"
        decodes = [t for t in batch if t.is_decode]
        assert batch[: len(decodes)] == decodes, "decodes come first"
        assert sum(t.input.size for t in batch) <= self.budget
        assert len({t.sid for t in decodes}) == len(decodes) <= self.decode_cap
        waiting_decode_sids = {t.sid for t in self.waiting if t.is_decode}
        assert len(decodes) == min(self.decode_cap, len(waiting_decode_sids))
        outputs = [t.sid for t in batch if t.input.produce_output]
        assert len(outputs) == len(set(outputs)), "one output-producing input per session"
        assert not {t.sid for t in batch if not t.is_decode} & {t.sid for t in decodes}
        for task in batch:
            # Each session's decodes and chunks leave in submission order.
            first = next(
                t for t in self.waiting if (t.sid, t.is_decode) == (task.sid, task.is_decode)
            )
            assert first is task
            self.remove([task], "dispatched")
        self.check_nothing_more_fits(batch)

    def check_nothing_more_fits(self, batch: list[Task]) -> None:
        room = self.budget - sum(t.input.size for t in batch)
        busy = {t.sid for t in batch if t.is_decode or t.input.produce_output}
        for sid in {t.sid for t in self.waiting if not t.is_decode} - busy:
            head = next(t for t in self.waiting if t.sid == sid and not t.is_decode)
            assert head.input.size > room, f"session {sid}'s next chunk still fits"


# Operations come from a seeded Random: an order of magnitude cheaper to draw than
# hypothesis strategies, which buys thousands of sequences in a few seconds. A failure
# reports the limits, the seed and (through note) the operations.
@settings(max_examples=2000, deadline=None)
@given(scheduler_limits(), st.randoms(use_true_random=True))
def test_random_operations_lose_nothing_and_return_nothing_twice(
    limits: tuple[int, int, int], rng: random.Random
) -> None:
    scheduler = DecodeFirstScheduler.create(*limits)
    model = QueueModel(*limits)
    for op, arg in random_operations(rng, model.chunk_size):
        note(f"{op} {arg}")
        if op == "submit":
            assert isinstance(arg, list)
            accepted = scheduler.submit(arg)
            assert accepted == model.should_accept(arg)
            if accepted:
                model.waiting.extend(arg)
                model.accepted += len(arg)
        elif op == "get_work":
            model.check_batch(scheduler.get_work())
        elif op == "cancel":
            cancelled = scheduler.cancel(arg)  # type: ignore[arg-type]
            assert tids(cancelled) == tids([t for t in model.waiting if t.sid == arg])
            assert all(t.cancelled for t in cancelled)
            model.remove(cancelled, "cancelled")
        else:
            cleared = scheduler.clear()
            assert ids(cleared) == ids(model.waiting)
            model.remove(cleared, "cleared")
        assert scheduler.has_work() == bool(model.waiting)
    while model.waiting:
        model.check_batch(scheduler.get_work())
    assert scheduler.get_work() == [] and not scheduler.has_work()
    assert model.left.total() == model.accepted
    event(f"accepted tasks >= {model.accepted // 10 * 10}")  # --hypothesis-show-statistics


def test_concurrent_producers_and_a_consumer_lose_nothing() -> None:
    scheduler = DecodeFirstScheduler.create(64, 8, 32)
    producers, tasks_per_producer = 4, 1500
    cancelled: list[Task] = []
    dispatched: list[Task] = []
    problems: list[str] = []
    producing = threading.Event()
    producing.set()

    def produce(index: int) -> None:
        for n in range(tasks_per_producer):
            tid, sid = index * 1_000_000 + n, index * 10 + n % 3
            task = decode(tid, sid) if n % 2 else chunk(tid, sid, 1 + n % 32, output=n % 5 == 0)
            if not scheduler.submit([task]):
                problems.append(f"task {tid} refused")
            if n % 37 == 0:
                cancelled.extend(scheduler.cancel(sid))

    def consume() -> None:
        while producing.is_set() or scheduler.has_work():
            batch = scheduler.get_work()
            if sum(t.input.size for t in batch) > 64 or sum(t.is_decode for t in batch) > 8:
                problems.append(f"oversized batch {tids(batch)}")
            outputs = [t.sid for t in batch if t.is_decode or t.input.produce_output]
            if len(outputs) != len(set(outputs)):
                problems.append(f"two outputs for one session in {tids(batch)}")
            dispatched.extend(batch)

    def recording_errors(work: Callable[..., None], *args: int) -> None:
        try:
            work(*args)
        except Exception as error:  # a thread's exception would otherwise only be printed
            problems.append(repr(error))

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads often
    try:
        # Daemons: a broken scheduler must fail the test, not hang the test run.
        consumer = threading.Thread(target=recording_errors, args=(consume,), daemon=True)
        threads = [
            threading.Thread(target=recording_errors, args=(produce, i), daemon=True)
            for i in range(producers)
        ]
        consumer.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        producing.clear()
        consumer.join(timeout=10)
    finally:
        sys.setswitchinterval(old_interval)
    assert not consumer.is_alive() and not any(t.is_alive() for t in threads)
    assert problems == []
    out = Counter(t.tid for t in dispatched + cancelled)
    expected = {i * 1_000_000 + n for i in range(producers) for n in range(tasks_per_producer)}
    assert set(out) == expected
    assert max(out.values()) == 1
    assert all(t.cancelled for t in cancelled) and not any(t.cancelled for t in dispatched)
