"""Runner, Session and GenerationHandle against the deterministic fake executor.

The fake answers `1000 + p` for a token that takes position p, so every expected
token below is computed from positions, not copied from a run.
"""

from __future__ import annotations

import asyncio
import gc
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import pytest

from cellbatch import GenerationHandle, Runner, Session
from cellbatch.generation_config import GenConfig, SamplingParams
from cellbatch.runner import InitializationState
from cellbatch.runner.generation import MOVES, Generation, GenerationKind, GenerationStatus
from cellbatch.scheduler import DecodeFirstScheduler
from cellbatch.types import FinishReason, InvalidArgumentError, Task
from fake_executor import WAIT_S, FakeExecutor, Recorder, make_tokens, open_session, wait_until

ENGINE = "cellbatch-engine"
Start = Callable[..., tuple[Runner, FakeExecutor]]


@pytest.fixture
def start() -> Iterator[Start]:
    """Makes runners over fake executors; shuts them down and checks the fakes after."""
    made: list[tuple[Runner, FakeExecutor]] = []

    def make(
        fake: FakeExecutor | None = None,
        budget: int = 64,
        decodes: int = 8,
        chunk: int = 16,
        scheduler: DecodeFirstScheduler | None = None,
        **options: object,
    ) -> tuple[Runner, FakeExecutor]:
        fake = fake if fake is not None else FakeExecutor()
        runner = Runner(
            fake, scheduler or DecodeFirstScheduler.create(budget, decodes, chunk), **options
        )
        made.append((runner, fake))
        return runner, fake

    yield make
    for runner, fake in made:
        fake.release()
        runner.shutdown()
        assert fake.wrong_thread_calls == 0
        assert fake.open_count == 0


def run(session: Session, delta: list[int], max_new: int = 3, **config: object) -> GenerationHandle:
    """Generate and wait for the outcome."""
    handle = session.generate_async(delta, GenConfig(max_new_tokens=max_new, **config))
    assert handle.wait(WAIT_S)
    return handle


def context(fake: FakeExecutor, session: Session) -> list[int]:
    """The session's whole context: what the executor committed + what is pending."""
    assert session.id is not None
    return fake.contexts[session.id][: session.position()] + list(session.unfed())


def first_execute_with(fake: FakeExecutor, sid: int) -> int:
    return next(
        i for i, event in enumerate(fake.events) if event[0] == "execute" and sid in event[2]
    )


# -- handles ---------------------------------------------------------------------------


def test_a_default_handle_is_invalid() -> None:
    handle = GenerationHandle()
    assert not handle.valid()
    assert not handle.done()
    assert handle.finish_reason() is None
    handle.cancel()  # harmless
    with pytest.raises(RuntimeError, match="not bound"):
        handle.wait(0)


def test_a_handle_handed_to_another_thread_stays_valid(start: Start) -> None:
    runner, _ = start()
    session = open_session(runner)
    handoff: queue.Queue[GenerationHandle] = queue.Queue()
    handoff.put(session.generate_async(make_tokens(4), GenConfig(max_new_tokens=2)))
    seen: dict[str, object] = {}

    def consumer() -> None:
        handle = handoff.get()
        seen["valid"] = handle.valid()
        seen["settled"] = handle.wait(WAIT_S)
        seen["tokens"] = handle.tokens()

    thread = threading.Thread(target=consumer)
    thread.start()
    thread.join(WAIT_S)
    assert seen == {"valid": True, "settled": True, "tokens": [1004, 1005]}


def test_the_outcome_is_published_before_waiters_wake_and_before_on_settled(start: Start) -> None:
    runner, fake = start()
    session = open_session(runner)
    seen: dict[str, object] = {}

    def on_settled(handle: GenerationHandle) -> None:
        seen["on_settled"] = (handle.done(), handle.finish_reason(), handle.tokens())
        seen["end_time_set"] = handle.metrics().end_time is not None

    fake.hold()
    handle = session.generate_async(make_tokens(4), GenConfig(max_new_tokens=1), None, on_settled)

    def waiter() -> None:
        handle.wait(WAIT_S)
        seen["waiter"] = (
            handle.finish_reason(),
            handle.tokens(),
            handle.metrics().generated_tokens,
        )

    thread = threading.Thread(target=waiter)
    thread.start()
    assert fake.wait_held()
    fake.release()
    thread.join(WAIT_S)
    assert wait_until(lambda: "on_settled" in seen)
    assert seen["waiter"] == (FinishReason.TOKEN_LIMIT, [1004], 1)
    assert seen["on_settled"] == (True, FinishReason.TOKEN_LIMIT, [1004])
    assert seen["end_time_set"] is True


def test_on_settled_runs_once_and_its_captures_are_released(start: Start) -> None:
    runner, _ = start()
    session = open_session(runner)

    class Captured:
        pass

    captured = Captured()
    alive = weakref.ref(captured)
    calls: list[str] = []
    handle = session.generate_async(
        make_tokens(3),
        GenConfig(max_new_tokens=2),
        on_update=lambda update, c=captured: None,
        on_settled=lambda h, c=captured: calls.append("settled"),
    )
    del captured
    assert handle.wait(WAIT_S)
    assert wait_until(lambda: alive() is None), "a callback's captures outlived the generation"
    assert calls == ["settled"]


def test_callbacks_run_on_the_engine_thread(start: Start) -> None:
    runner, _ = start()
    session = open_session(runner)
    recorder = Recorder()
    session.generate_async(make_tokens(3), GenConfig(max_new_tokens=2), *_callbacks(recorder))
    assert recorder.settled.wait(WAIT_S)
    assert recorder.threads == {ENGINE}


def _callbacks(recorder: Recorder) -> tuple[Callable[..., None], Callable[..., None]]:
    return recorder.on_update, recorder.on_settled


def test_the_handle_is_awaitable_and_streams_its_updates(start: Start) -> None:
    runner, _ = start()
    session = open_session(runner)

    async def main() -> tuple[list[object], object]:
        handle = session.generate_async(make_tokens(5), GenConfig(max_new_tokens=4))
        updates = [update async for update in handle.stream()]
        return updates, await handle

    updates, result = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert [t for u in updates for t in u.tokens] == [1005, 1006, 1007, 1008]  # type: ignore[attr-defined]
    assert [u.finish_reason for u in updates][-1] == FinishReason.TOKEN_LIMIT  # type: ignore[attr-defined]
    assert all(u.finish_reason is None for u in updates[:-1])  # type: ignore[attr-defined]
    assert result.tokens == (1005, 1006, 1007, 1008)  # type: ignore[attr-defined]


def test_a_late_stream_catches_up_with_everything_delivered(start: Start) -> None:
    runner, _ = start()
    session = open_session(runner)
    handle = run(session, make_tokens(2), max_new=3)

    async def collect() -> list[object]:
        return [update async for update in handle.stream()]

    (only,) = asyncio.run(asyncio.wait_for(collect(), WAIT_S))
    assert only.tokens == (1002, 1003, 1004)  # type: ignore[attr-defined]
    assert only.finish_reason == FinishReason.TOKEN_LIMIT  # type: ignore[attr-defined]


# -- sessions --------------------------------------------------------------------------


def test_a_default_session_fails_synchronously() -> None:
    recorder = Recorder()
    handle = Session().generate_async([1, 2], GenConfig(), *_callbacks(recorder))
    assert handle.done()
    assert handle.finish_reason() == FinishReason.FAILED
    assert "session is not initialized" in handle.error()
    assert recorder.settled_calls == 1
    assert recorder.threads == {threading.current_thread().name}


def test_a_closed_session_is_cancelled_synchronously(start: Start) -> None:
    runner, fake = start()
    session = open_session(runner)
    session.close()
    handle = session.generate_async([1, 2], GenConfig())
    assert handle.done()
    assert handle.finish_reason() == FinishReason.CANCELLED
    assert fake.batches == []


@pytest.mark.parametrize("how", ["cancel", "close", "shutdown"])
def test_each_way_of_ending_notifies_exactly_once(start: Start, how: str) -> None:
    runner, fake = start()
    session = open_session(runner)
    recorder = Recorder()
    fake.hold()
    handle = session.generate_async(
        make_tokens(5), GenConfig(max_new_tokens=50), *_callbacks(recorder)
    )
    assert fake.wait_held()
    stoppers: list[threading.Thread] = []
    if how == "cancel":
        handle.cancel()
        handle.cancel()
    elif how == "close":
        session.close()
        session.close()
    else:
        stoppers = [threading.Thread(target=runner.shutdown) for _ in range(2)]
        for thread in stoppers:
            thread.start()
        assert wait_until(runner.stopping)
    fake.release()
    assert recorder.settled.wait(WAIT_S)
    for thread in stoppers:
        thread.join(WAIT_S)
    handle.cancel()
    session.close()
    runner.shutdown()
    assert handle.finish_reason() == FinishReason.CANCELLED
    assert len(recorder.finals) == 1
    assert recorder.settled_calls == 1


def test_a_raising_callback_fails_only_its_generation(start: Start) -> None:
    runner, fake = start()
    first, second = open_session(runner), open_session(runner)
    calls: list[object] = []

    def explode(update: object) -> None:
        calls.append(update)
        raise ValueError("boom")

    prompt = make_tokens(4)
    failing = first.generate_async(prompt, GenConfig(max_new_tokens=5), on_update=explode)
    healthy = second.generate_async(prompt, GenConfig(max_new_tokens=5))
    assert failing.wait(WAIT_S) and healthy.wait(WAIT_S)
    assert failing.finish_reason() == FinishReason.FAILED
    assert "ValueError('boom')" in failing.error()
    assert len(calls) == 1, "a callback that raised was called again"
    assert failing.tokens() == [1004]
    assert healthy.finish_reason() == FinishReason.TOKEN_LIMIT
    assert healthy.tokens() == [1004, 1005, 1006, 1007, 1008]
    # The session carries on, and its context holds exactly the delivered token.
    assert context(fake, first) == [*prompt, 1004]
    again = run(first, [7], max_new=2)
    assert again.finish_reason() == FinishReason.TOKEN_LIMIT
    assert again.tokens() == [1006, 1007]


def test_a_callback_raising_while_shutdown_is_requested_still_reports_its_failure(
    start: Start,
) -> None:
    runner, _ = start()
    session = open_session(runner)

    def stop_and_explode(update: object) -> None:
        runner.shutdown()
        raise ValueError("late")

    handle = session.generate_async(
        make_tokens(3), GenConfig(max_new_tokens=5), on_update=stop_and_explode
    )
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.FAILED
    assert "ValueError('late')" in handle.error()


@pytest.mark.parametrize("how", ["close", "drop", "with"])
def test_closing_a_session_goes_through_the_engine_and_never_waits(start: Start, how: str) -> None:
    runner, fake = start()
    session = open_session(runner)
    sid = session.id
    fake.hold()
    handle = session.generate_async(make_tokens(5), GenConfig(max_new_tokens=50))
    assert fake.wait_held()
    held = [session]
    del session  # the closer's is the only reference: "drop" lets go of the last one

    def close() -> None:
        closing = held.pop()
        if how == "close":
            closing.close()
        elif how == "with":
            with closing:
                pass
        else:
            del closing
            gc.collect()

    # The engine stays inside execute until released below, so a close that waited for
    # it would still be running (a wall-clock bound would also count gc.collect's walk
    # over the whole heap, which is slow late in a long test run).
    closer = threading.Thread(target=close)
    closer.start()
    closer.join(WAIT_S)
    assert not closer.is_alive(), "closing waited for the engine"
    assert sid not in fake.closed  # the engine is still inside execute
    fake.release()
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.CANCELLED
    assert wait_until(lambda: sid in fake.closed)
    assert fake.wrong_thread_calls == 0


def test_capacity_refusal_is_reported(start: Start) -> None:
    runner, _ = start(FakeExecutor(max_sessions=2))
    sessions = [runner.open_session_async().result(WAIT_S) for _ in range(3)]
    assert sessions[0] is not None and sessions[1] is not None
    assert sessions[2] is None
    assert runner.metrics().sessions_refused == 1
    assert runner.metrics().sessions_opened == 2


# -- sampling ---------------------------------------------------------------------------


def test_sampling_and_seed_are_installed_before_the_generations_tasks_run(start: Start) -> None:
    runner, fake = start()
    session = open_session(runner)
    params = SamplingParams(temperature=0.7, top_k=5)
    run(session, make_tokens(4), max_new=2, sampling=params, seed=42)
    assert fake.sampling == [(session.id, params, 42)]
    installed = fake.events.index(("sampling", session.id, 42))
    assert installed < first_execute_with(fake, session.id)


def test_each_generation_reseeds_and_a_refused_one_does_not(start: Start) -> None:
    runner, fake = start()
    session = open_session(runner)
    fake.hold()
    active = session.generate_async(make_tokens(4), GenConfig(max_new_tokens=3, seed=1))
    assert fake.wait_held()
    refused = session.generate_async([5], GenConfig(max_new_tokens=3, seed=2))
    fake.release()
    assert active.wait(WAIT_S) and refused.wait(WAIT_S)
    assert refused.finish_reason() == FinishReason.FAILED
    assert "already has an active generation" in refused.error()
    run(session, [6], max_new=1, seed=3)
    run(session, [7], max_new=1)
    assert [seed for _, _, seed in fake.sampling] == [1, 3, None]  # None: the executor picks


# -- bad requests ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("delta", "max_new", "message"),
    [
        ([1, 2], 0, "max_new_tokens must be a positive integer"),
        ([1, 2], -3, "max_new_tokens must be a positive integer"),
        ([], 4, "delta is empty"),
        (range(2**31), 4, "overflows the position range"),
        ([1, -5], 4, "token ids must be >= 0"),
        ([1.5], 4, "integer token ids"),
    ],
)
def test_bad_requests_fail_with_a_message_and_execute_nothing(
    start: Start, delta: object, max_new: int, message: str
) -> None:
    runner, fake = start()
    session = open_session(runner)
    handle = session.generate_async(delta, GenConfig(max_new_tokens=max_new))  # type: ignore[arg-type]
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.FAILED
    assert message in handle.error()
    assert fake.batches == [] and fake.sampling == []
    assert session.position() == 0 and session.unfed() == ()


# -- stop tokens and budget ---------------------------------------------------------------------


def test_the_stop_token_is_included_in_the_final_update(start: Start) -> None:
    runner, _ = start(FakeExecutor(stop_after=3, stop_token=2))
    session = open_session(runner)
    recorder = Recorder()
    session.generate_async(
        make_tokens(4),
        GenConfig(max_new_tokens=10, stop_tokens=frozenset({2})),
        *_callbacks(recorder),
    )
    assert recorder.settled.wait(WAIT_S)
    assert recorder.tokens == [1004, 1005, 2]
    assert recorder.finals == [recorder.updates[-1]]
    assert recorder.finals[0].tokens == (2,)
    assert recorder.finals[0].finish_reason == FinishReason.STOP_TOKEN


def test_an_immediate_stop_token_beats_the_budget(start: Start) -> None:
    runner, _ = start(FakeExecutor(stop_after=1, stop_token=2))
    session = open_session(runner)
    handle = run(session, make_tokens(4), max_new=1, stop_tokens=frozenset({2}))
    assert handle.finish_reason() == FinishReason.STOP_TOKEN
    assert handle.tokens() == [2]


# -- deltas, chunks and positions -----------------------------------------------------------


def test_a_prompt_is_cut_into_chunks_on_the_turns_base_position(start: Start) -> None:
    runner, fake = start(chunk=4)
    session = open_session(runner)
    prompt = make_tokens(10)
    run(session, prompt, max_new=1)
    (batch,) = fake.batches
    assert [(i.offset, i.size, i.position) for i in batch.inputs] == [
        (0, 4, 0),
        (4, 4, 0),
        (8, 2, 0),
    ]
    assert [i.produce_output for i in batch.inputs] == [False, False, True]
    assert all(list(i.payload) == prompt for i in batch.inputs)


def test_a_one_token_opening_delta_is_prefill(start: Start) -> None:
    runner, _ = start()
    session = open_session(runner)
    run(session, [5], max_new=1)
    metrics = runner.metrics()
    assert (metrics.prefill_tokens, metrics.decode_tokens) == (1, 0)


def test_the_second_turn_carries_the_pending_token(start: Start) -> None:
    runner, fake = start()
    session = open_session(runner)
    prompt = make_tokens(5)
    first = run(session, prompt, max_new=3)
    assert first.tokens() == [1005, 1006, 1007]
    assert (session.position(), session.unfed()) == (7, (1007,))
    second = run(session, [50, 51], max_new=2)
    opening = fake.inputs_of(session.id)[3]
    assert (tuple(opening.payload), opening.position, opening.offset) == ((1007, 50, 51), 7, 0)
    assert second.tokens() == [1010, 1011]
    assert context(fake, session) == [*prompt, 1005, 1006, 1007, 50, 51, 1010, 1011]


def test_a_prefill_turn_feeds_the_delta_asks_for_no_output_and_settles_empty(
    start: Start,
) -> None:
    runner, fake = start(chunk=4)
    session = open_session(runner)
    prompt = make_tokens(10)
    handle = session.prefill_async(prompt)
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.TOKEN_LIMIT and handle.error() == ""
    assert handle.tokens() == []
    (batch,) = fake.batches
    assert [i.produce_output for i in batch.inputs] == [False, False, False]
    assert (session.position(), session.unfed()) == (10, ())
    metrics = runner.metrics()
    assert (metrics.prefill_turns, metrics.generations_started) == (1, 0)
    assert (metrics.generations_completed, metrics.prefill_tokens) == (0, 10)
    # The next turn continues from the fed context; its first token answers position 11.
    assert run(session, [50], max_new=2).tokens() == [1011, 1012]
    assert context(fake, session) == [*prompt, 50, 1011, 1012]
    assert runner.metrics().generations_completed == 1


def test_a_prefill_turn_can_be_cloned_at_its_end(start: Start) -> None:
    runner, _ = start()
    root = open_session(runner)
    assert root.prefill_async(make_tokens(6)).wait(WAIT_S)
    clone = root.clone_async(6).result(WAIT_S)
    assert clone is not None and clone.position() == 6
    assert run(clone, [7, 8], max_new=1).tokens() == [1008]
    assert run(root, [9], max_new=1).tokens() == [1007]


def test_positions_are_per_session(start: Start) -> None:
    runner, fake = start()
    short, long = open_session(runner), open_session(runner)
    assert run(short, make_tokens(2), max_new=2).tokens() == [1002, 1003]
    assert run(long, make_tokens(6), max_new=2).tokens() == [1006, 1007]
    assert fake.inputs_of(short.id)[0].position == fake.inputs_of(long.id)[0].position == 0


# -- executor misbehaviour ------------------------------------------------------------------


@pytest.mark.parametrize("malformation", ["wrong_sid", "empty", "extra", "missing"])
def test_malformed_output_fails_and_poisons_even_when_the_step_would_end_it(
    start: Start, malformation: str
) -> None:
    runner, _ = start(FakeExecutor(malformed_at_step=1, malformation=malformation), chunk=4)
    session = open_session(runner)
    handle = run(session, make_tokens(6), max_new=1)  # two chunks in one batch
    assert handle.finish_reason() == FinishReason.FAILED
    assert "the executor failed on this batch" in handle.error()
    assert handle.tokens() == []
    after = run(session, [1], max_new=1)
    assert "poisoned" in after.error()
    assert session.clone_async(0).result(WAIT_S) is None


@pytest.mark.parametrize("knob", ["fail_steps", "raise_steps"])
def test_an_executor_failure_poisons_every_session_in_the_batch_and_no_other(
    start: Start, knob: str
) -> None:
    runner, fake = start()
    bystander, left, right = open_session(runner), open_session(runner), open_session(runner)
    fake.hold()
    first = bystander.generate_async(make_tokens(3), GenConfig(max_new_tokens=1))
    assert fake.wait_held()
    getattr(fake, knob).add(2)
    doomed = [s.generate_async(make_tokens(3), GenConfig(max_new_tokens=4)) for s in (left, right)]
    fake.release()
    assert all(handle.wait(WAIT_S) for handle in (first, *doomed))
    assert tuple(i.sid for i in fake.batches[1].inputs) == (left.id, right.id)
    assert [h.finish_reason() for h in doomed] == [FinishReason.FAILED] * 2
    assert "fake" in doomed[0].error()
    for session in (left, right):
        assert "poisoned" in run(session, [1], max_new=1).error()
    assert run(bystander, [1], max_new=2).finish_reason() == FinishReason.TOKEN_LIMIT


class RefusingScheduler(DecodeFirstScheduler):
    """Refuses decodes (or everything) on demand."""

    refuse_decodes = False
    refuse_all = False

    def submit(self, tasks: list[Task]) -> bool:  # type: ignore[override]
        if self.refuse_all or (self.refuse_decodes and any(t.is_decode for t in tasks)):
            return False
        return super().submit(tasks)


def test_scheduler_rejection_ends_the_generation(start: Start) -> None:
    scheduler = RefusingScheduler(64, 8, 16)
    runner, fake = start(scheduler=scheduler)
    session = open_session(runner)
    scheduler.refuse_decodes = True
    prompt = make_tokens(4)
    handle = run(session, prompt, max_new=5)
    assert handle.finish_reason() == FinishReason.FAILED
    assert "scheduler refused" in handle.error()
    assert handle.tokens() == [1004]
    assert context(fake, session) == [*prompt, 1004]
    scheduler.refuse_decodes = False
    assert run(session, [9], max_new=2).tokens() == [1006, 1007]
    scheduler.refuse_all = True
    refused = run(session, [9], max_new=2)
    assert "scheduler refused" in refused.error()
    assert len(fake.batches) == 3  # nothing ran for the refused turn


# -- speculative outputs ----------------------------------------------------------------------


def test_speculative_bursts_record_intra_burst_latencies(start: Start) -> None:
    runner, _ = start(FakeExecutor(decode_tokens=3))
    session = open_session(runner)
    recorder = Recorder()
    handle = session.generate_async(
        make_tokens(4), GenConfig(max_new_tokens=7), *_callbacks(recorder)
    )
    assert handle.wait(WAIT_S)
    assert [len(u.tokens) for u in recorder.updates] == [1, 3, 3]
    assert handle.tokens() == list(range(1004, 1011))
    metrics = handle.metrics()
    assert metrics.generated_tokens == 7
    assert metrics.itl_count == 6
    assert metrics.itl_min == 0.0
    assert metrics.decode_steps == 2


def test_a_stop_token_inside_an_accepted_run_drops_only_the_suffix(start: Start) -> None:
    runner, fake = start(FakeExecutor(decode_tokens=3, stop_after=3, stop_token=2))
    session = open_session(runner)
    prompt = make_tokens(4)
    handle = run(session, prompt, max_new=10, stop_tokens=frozenset({2}))
    assert handle.tokens() == [1004, 1005, 2]
    assert handle.finish_reason() == FinishReason.STOP_TOKEN
    assert (session.position(), session.unfed()) == (6, (2,))
    assert context(fake, session) == [*prompt, 1004, 1005, 2]
    run(session, [9], max_new=1)
    assert fake.inputs_of(session.id)[-1].start == 6  # rewinds what the executor ran ahead


def test_positions_follow_the_accepted_run_and_the_budget_cuts_a_burst(start: Start) -> None:
    runner, fake = start(FakeExecutor(decode_tokens=2))
    session = open_session(runner)
    prompt = make_tokens(4)
    handle = run(session, prompt, max_new=4)
    assert handle.tokens() == [1004, 1005, 1006, 1007]
    decodes = fake.inputs_of(session.id)[1:]
    assert [(i.position, tuple(i.payload)) for i in decodes] == [(4, (1004,)), (6, (1006,))]
    assert len(fake.contexts[session.id]) == 8  # the executor ran one token past the budget
    assert (session.position(), session.unfed()) == (7, (1007,))
    run(session, [9], max_new=1)
    assert fake.inputs_of(session.id)[-1].start == 7


# -- cancellation -------------------------------------------------------------------------------


def test_cancel_mid_prompt_keeps_the_chunks_consumed_in_the_batch(start: Start) -> None:
    runner, fake = start(budget=12, decodes=4, chunk=4)
    session = open_session(runner)
    prompt = make_tokens(20)
    fake.hold()
    handle = session.generate_async(prompt, GenConfig(max_new_tokens=5))
    assert fake.wait_held()
    handle.cancel()
    fake.release()
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.CANCELLED
    assert len(fake.batches) == 1 and sum(i.size for i in fake.batches[0].inputs) == 12
    assert session.position() == 12
    assert handle.metrics().prefilled_tokens == 12
    assert context(fake, session) == prompt  # the unfed rest stays pending


def test_a_callback_may_close_its_own_session(start: Start) -> None:
    runner, fake = start()
    session = open_session(runner)
    sid = session.id
    recorder = Recorder()

    def close_own(update: object) -> None:
        recorder.on_update(update)  # type: ignore[arg-type]
        session.close()

    handle = session.generate_async(
        make_tokens(3), GenConfig(max_new_tokens=50), close_own, recorder.on_settled
    )
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.CANCELLED
    assert len(recorder.finals) == 1 and recorder.settled_calls == 1
    assert wait_until(lambda: sid in fake.closed)


def test_position_survives_a_cancelled_generation(start: Start) -> None:
    runner, fake = start()
    session = open_session(runner)
    prompt = make_tokens(5)
    run(session, prompt, max_new=3)
    assert (session.position(), session.unfed()) == (7, (1007,))
    fake.hold()
    handle = session.generate_async([9], GenConfig(max_new_tokens=3))
    assert fake.wait_held()
    handle.cancel()
    fake.release()
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.CANCELLED
    # The step in flight consumed the turn's input: it is committed, its output dropped.
    assert (session.position(), session.unfed()) == (9, ())
    assert context(fake, session) == [*prompt, 1005, 1006, 1007, 9]
    run(session, [11], max_new=1)
    opening = fake.inputs_of(session.id)[-1]
    assert (tuple(opening.payload), opening.start) == ((11,), 9)


def test_a_cancelled_decode_advances_only_for_delivered_tokens(start: Start) -> None:
    runner, fake = start()
    session = open_session(runner)
    prompt = make_tokens(5)

    updates: list[object] = []

    def hold_after_two(update: object) -> None:
        updates.append(update)
        if len(updates) == 2:
            fake.hold()  # the next forward, the third token's decode, waits at the gate

    handle = session.generate_async(prompt, GenConfig(max_new_tokens=50), hold_after_two)
    assert fake.wait_held()
    handle.cancel()
    fake.release()
    assert handle.wait(WAIT_S)
    assert handle.tokens() == [1005, 1006]
    # The decode in flight fed 1006; the token it produced was never delivered.
    assert (session.position(), session.unfed()) == (7, ())
    assert context(fake, session) == [*prompt, 1005, 1006]


# -- cloning --------------------------------------------------------------------------------


def test_clone_is_refused_synchronously_for_default_and_closed_sessions(start: Start) -> None:
    runner, fake = start()
    future = Session().clone_async(0)
    assert future.done() and future.result() is None
    session = open_session(runner)
    session.close()
    future = session.clone_async(0)
    assert future.done() and future.result() is None
    assert fake.clone_calls == []


def test_an_executor_without_clone_support_refuses_and_the_source_is_unharmed(
    start: Start,
) -> None:
    runner, fake = start(FakeExecutor(clone_supported=False))
    session = open_session(runner)
    run(session, make_tokens(4), max_new=2)
    assert session.clone_async(3).result(WAIT_S) is None
    assert fake.clone_calls == [(session.id, 3)]
    assert run(session, [9], max_new=2).finish_reason() == FinishReason.TOKEN_LIMIT


def test_a_clone_copies_only_the_committed_prefix_and_starts_idle(start: Start) -> None:
    runner, fake = start(FakeExecutor(decode_tokens=2))
    source = open_session(runner)
    run(source, make_tokens(6), max_new=2)
    assert len(fake.contexts[source.id]) > source.position()  # speculative leftovers
    clone = source.clone_async(source.position()).result(WAIT_S)
    assert clone is not None
    assert clone.position() == source.position() and clone.unfed() == ()
    assert fake.contexts[clone.id] == fake.contexts[source.id][: source.position()]
    assert all(sid != clone.id for sid, _, _ in fake.sampling)
    run(clone, [9], max_new=1)
    assert fake.inputs_of(clone.id)[0].start == source.position()


def test_an_empty_boundary_is_passed_to_the_executor(start: Start) -> None:
    runner, fake = start()
    source = open_session(runner)
    run(source, make_tokens(3), max_new=1)
    clone = source.clone_async(0).result(WAIT_S)
    assert clone is not None and clone.position() == 0
    assert fake.clone_calls == [(source.id, 0)]


@pytest.mark.parametrize("boundary", ["negative", "pending", "future"])
def test_bad_clone_boundaries_are_refused_without_asking_the_executor(
    start: Start, boundary: str
) -> None:
    runner, fake = start()
    source = open_session(runner)
    run(source, make_tokens(5), max_new=2)
    upto = {"negative": -1, "pending": source.position() + 1, "future": 100}[boundary]
    assert source.clone_async(upto).result(WAIT_S) is None
    assert fake.clone_calls == []


def test_a_clone_requested_from_the_first_output_callback_runs_before_the_next_forward(
    start: Start,
) -> None:
    runner, fake = start()
    source = open_session(runner)
    prompt = make_tokens(5)
    futures = []

    def clone_once(update: object) -> None:
        if not futures:
            futures.append(source.clone_async(len(prompt)))

    run_handle = source.generate_async(prompt, GenConfig(max_new_tokens=3), clone_once)
    assert run_handle.wait(WAIT_S)
    clone = futures[0].result(WAIT_S)
    assert clone is not None
    executes = [i for i, event in enumerate(fake.events) if event[0] == "execute"]
    assert executes[0] < fake.events.index(("clone", source.id, 5)) < executes[1]
    assert fake.contexts[clone.id] == prompt


def test_a_clone_survives_immediate_destruction_of_its_source(start: Start) -> None:
    runner, fake = start()
    source = open_session(runner)
    prompt = make_tokens(5)
    run(source, prompt, max_new=1)
    source_id = source.id
    future = source.clone_async(5)
    del source
    gc.collect()
    clone = future.result(WAIT_S)
    assert clone is not None
    assert wait_until(lambda: source_id in fake.closed)
    assert run(clone, [9], max_new=1).tokens() == [1006]
    assert fake.contexts[clone.id][:5] == prompt


def test_failed_and_malformed_sources_are_not_cloned(start: Start) -> None:
    runner, fake = start(FakeExecutor(fail_steps={1}))
    session = open_session(runner)
    run(session, make_tokens(3), max_new=1)
    assert session.clone_async(0).result(WAIT_S) is None
    assert fake.clone_calls == []


def test_an_executor_exception_settles_the_clone_future_and_the_engine_keeps_running(
    start: Start,
) -> None:
    runner, _ = start(FakeExecutor(clone_raises=True))
    session = open_session(runner)
    run(session, make_tokens(3), max_new=1)
    with pytest.raises(RuntimeError, match="fake clone failure"):
        session.clone_async(2).result(WAIT_S)
    assert run(session, [9], max_new=2).finish_reason() == FinishReason.TOKEN_LIMIT


def test_a_dropped_clone_future_releases_its_session(start: Start) -> None:
    runner, fake = start()
    session = open_session(runner)
    run(session, make_tokens(3), max_new=1)
    session.clone_async(2)  # dropped at once
    assert wait_until(lambda: len(fake.clone_calls) == 1 and fake.open_count == 1)
    assert len(fake.closed) == 1


# -- shutdown -------------------------------------------------------------------------------


def test_shutdown_ends_live_work_and_refuses_new_work(start: Start) -> None:
    runner, fake = start()
    session = open_session(runner)
    handle = session.generate_async(make_tokens(3), GenConfig(max_new_tokens=10**6))
    assert wait_until(lambda: len(handle.tokens()) > 3)
    runner.shutdown()
    assert handle.done() and handle.finish_reason() == FinishReason.CANCELLED
    assert runner.open_session_async().result(WAIT_S) is None
    late = session.generate_async([1], GenConfig())
    assert late.done() and late.finish_reason() == FinishReason.CANCELLED
    assert session.clone_async(0).result(WAIT_S) is None
    assert fake.open_count == 0


def test_shutdown_discards_in_flight_outputs(start: Start) -> None:
    runner, fake = start()
    session = open_session(runner)
    recorder = Recorder()
    fake.hold()
    handle = session.generate_async(
        make_tokens(3), GenConfig(max_new_tokens=5), *_callbacks(recorder)
    )
    assert fake.wait_held()
    stopper = threading.Thread(target=runner.shutdown)
    stopper.start()
    assert wait_until(runner.stopping)
    fake.release()
    stopper.join(WAIT_S)
    assert handle.finish_reason() == FinishReason.CANCELLED
    assert handle.tokens() == [] and recorder.tokens == []


def test_concurrent_shutdown_callers_all_wait_for_the_full_stop(start: Start) -> None:
    runner, fake = start()
    sessions = [open_session(runner) for _ in range(3)]
    fake.hold()
    handle = sessions[0].generate_async(make_tokens(3), GenConfig(max_new_tokens=5))
    assert fake.wait_held()
    seen: list[tuple[int, bool]] = []

    def stop() -> None:
        runner.shutdown()
        seen.append((fake.open_count, handle.done()))

    stoppers = [threading.Thread(target=stop) for _ in range(3)]
    for thread in stoppers:
        thread.start()
    assert wait_until(runner.stopping)
    time.sleep(0.01)
    assert seen == [], "a shutdown returned while the engine was still inside execute"
    fake.release()
    for thread in stoppers:
        thread.join(WAIT_S)
    assert seen == [(0, True)] * 3


def test_a_callback_may_request_shutdown(start: Start) -> None:
    runner, fake = start()
    session = open_session(runner)
    handle = session.generate_async(
        make_tokens(3), GenConfig(max_new_tokens=50), lambda update: runner.shutdown()
    )
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.CANCELLED
    assert handle.tokens() == [1003]
    runner.shutdown()
    assert fake.open_count == 0


def test_remaining_sessions_close_exactly_once_and_outliving_sessions_close_cleanly(
    start: Start,
) -> None:
    runner, fake = start()
    sessions = [open_session(runner) for _ in range(3)]
    ids = sorted(s.id for s in sessions)  # type: ignore[type-var]
    sessions[0].close()
    runner.shutdown()
    assert sorted(fake.closed) == ids
    for session in sessions:
        session.close()
        assert not session.is_open()
    del sessions
    gc.collect()
    assert sorted(fake.closed) == ids


# -- metrics --------------------------------------------------------------------------------


def test_metrics_of_a_ten_token_prompt_with_three_new_tokens(start: Start) -> None:
    runner, _ = start()
    session = open_session(runner)
    handle = run(session, make_tokens(10), max_new=3)
    engine = runner.metrics()
    assert (engine.steps, engine.prefill_tokens, engine.decode_tokens) == (3, 10, 2)
    assert (engine.generated_tokens, engine.prompt_tokens) == (3, 10)
    generation = handle.metrics()
    assert (generation.prefill_steps, generation.decode_steps) == (1, 2)
    assert (generation.prompt_tokens, generation.prefilled_tokens) == (10, 10)
    assert generation.generated_tokens == 3 and generation.itl_count == 2
    assert generation.ttft is not None and generation.e2e is not None
    assert 0 <= generation.queue_wait <= generation.ttft <= generation.e2e  # type: ignore[operator]
    assert "generated 3" in generation.report() and "3 ok" in engine.report()


def test_starts_and_completions_balance_across_outcomes(start: Start) -> None:
    runner, fake = start(FakeExecutor(stop_after=2, stop_token=2))
    sessions = [open_session(runner) for _ in range(4)]
    handles = [
        run(sessions[0], [5], max_new=1),
        run(sessions[1], [5], max_new=5, stop_tokens=frozenset({2})),
        run(sessions[2], [], max_new=1),
    ]
    fake.hold()
    cancelled = sessions[3].generate_async([5], GenConfig(max_new_tokens=5))
    assert fake.wait_held()
    cancelled.cancel()
    fake.release()
    assert cancelled.wait(WAIT_S)
    reasons = [h.finish_reason() for h in [*handles, cancelled]]
    assert reasons == ["token_limit", "stop_token", "failed", "cancelled"]
    metrics = runner.metrics()
    assert metrics.generations_started == metrics.generations_completed == 4
    assert {k: v for k, v in metrics.finished.items() if v} == {
        "token_limit": 1,
        "stop_token": 1,
        "failed": 1,
        "cancelled": 1,
    }


def test_a_failed_batch_is_counted_without_crediting_its_tokens(start: Start) -> None:
    runner, _ = start(FakeExecutor(fail_steps={2}))
    session = open_session(runner)
    handle = run(session, make_tokens(10), max_new=3)
    assert handle.finish_reason() == FinishReason.FAILED
    metrics = runner.metrics()
    assert (metrics.steps, metrics.failed_steps) == (1, 1)
    assert (metrics.prefill_tokens, metrics.decode_tokens, metrics.generated_tokens) == (10, 0, 1)


def test_a_one_token_generation_has_minimum_itl_zero(start: Start) -> None:
    runner, _ = start()
    session = open_session(runner)
    metrics = run(session, make_tokens(3), max_new=1).metrics()
    assert (metrics.itl_count, metrics.itl_min, metrics.itl_max) == (0, 0.0, 0.0)
    assert metrics.decode_tokens_per_s == 0.0


def test_latency_buckets_partition_the_step_time(start: Start) -> None:
    runner, fake = start()
    first, second = open_session(runner), open_session(runner)

    updates: list[object] = []

    def join_midway(update: object) -> None:
        updates.append(update)
        if len(updates) == 2:
            second.generate_async(make_tokens(4), GenConfig(max_new_tokens=1))

    first_handle = first.generate_async(make_tokens(4), GenConfig(max_new_tokens=6), join_midway)
    assert first_handle.wait(WAIT_S)
    metrics = runner.metrics()
    assert metrics.prefill_only_steps >= 1 and metrics.mixed_steps == 1
    assert metrics.decode_only_steps >= 3
    buckets = metrics.decode_only_time + metrics.mixed_time + metrics.prefill_only_time
    assert buckets == pytest.approx(metrics.step_time_sum)
    counted = metrics.decode_only_steps + metrics.mixed_steps + metrics.prefill_only_steps
    assert counted == metrics.steps == len(fake.batches)


def test_a_multi_chunk_prompt_counts_its_context_once_per_step(start: Start) -> None:
    runner, fake = start(chunk=4)
    session = open_session(runner)
    run(session, make_tokens(10), max_new=1)
    assert len(fake.batches) == 1 and len(fake.batches[0].inputs) == 3
    metrics = runner.metrics()
    assert (metrics.context_sum, metrics.context_max) == (10, 10)


def test_init_time_is_kept_out_of_the_wall_time(start: Start) -> None:
    # A long delay, so that the run itself stays far below it on a loaded machine too.
    runner, _ = start(FakeExecutor(init_delay=1.0))
    session = open_session(runner)
    run(session, make_tokens(3), max_new=2)
    metrics = runner.metrics()
    assert metrics.init_time >= 1.0
    assert 0 < metrics.wall_time < 1.0


# -- initialisation ---------------------------------------------------------------------------


def test_an_object_that_is_not_an_executor_is_refused_with_what_it_lacks() -> None:
    class Partial:
        def initialize(self) -> None:
            pass

    with pytest.raises(InvalidArgumentError, match="Partial lacks open_session, close_session"):
        Runner(Partial())  # type: ignore[arg-type]


def test_executor_initialisation_runs_once_and_first(start: Start) -> None:
    runner, fake = start()
    run(open_session(runner), make_tokens(3), max_new=1)
    run(open_session(runner), make_tokens(3), max_new=1)
    assert fake.init_calls == 1
    assert fake.events[0] == ("initialize",)
    assert runner.initialization_state() == InitializationState.READY


def test_initialisation_failure_stops_the_runner_and_refuses_sessions(start: Start) -> None:
    runner, fake = start(FakeExecutor(fail_initialize=True, init_delay=0.05))
    early = runner.open_session_async()  # queued while initialisation runs
    assert runner.wait_initialized(WAIT_S) == InitializationState.FAILED
    assert "fake initialisation failure" in runner.initialization_error()
    assert early.result(WAIT_S) is None
    assert runner.open_session_async().result(WAIT_S) is None
    assert fake.events == [("initialize",)]
    assert runner.metrics().sessions_refused == 2


# -- admission control ----------------------------------------------------------------------


def test_a_generation_waits_for_cells_and_runs_once_they_free(start: Start) -> None:
    runner, fake = start(FakeExecutor(cell_limit=40), admission="reserve")
    first, second = open_session(runner), open_session(runner)
    fake.hold()
    running = first.generate_async(
        make_tokens(10), GenConfig(max_new_tokens=20), on_settled=lambda h: first.close()
    )
    assert fake.wait_held()
    waiting = second.generate_async(make_tokens(10), GenConfig(max_new_tokens=20))
    fake.release()
    assert running.wait(WAIT_S) and waiting.wait(WAIT_S)
    assert running.finish_reason() == waiting.finish_reason() == FinishReason.TOKEN_LIMIT
    last_of_first = max(
        i for i, e in enumerate(fake.events) if e[0] == "execute" and first.id in e[2]
    )
    assert first_execute_with(fake, second.id) > last_of_first
    assert runner.metrics().failed_steps == 0


def test_a_generation_that_can_never_fit_fails_with_the_reason(start: Start) -> None:
    runner, fake = start(FakeExecutor(cell_limit=20), admission="reserve")
    session = open_session(runner)
    handle = run(session, make_tokens(10), max_new=20)
    assert handle.finish_reason() == FinishReason.FAILED
    assert "not enough KV cells" in handle.error()
    assert fake.batches == []
    assert run(session, make_tokens(10), max_new=5).finish_reason() == FinishReason.TOKEN_LIMIT


# -- the generation lifecycle -----------------------------------------------------------------


def test_a_generation_moves_only_along_its_lifecycle() -> None:
    S = GenerationStatus
    generation = Generation(GenConfig(), None, None)
    assert generation.kind is GenerationKind.TURN and generation.status is S.POSTED
    for status in (S.WAITING, S.RUNNING, S.PREEMPTED, S.RUNNING, S.ENDED):
        generation.move(status)
        assert generation.status is status
    assert generation.ended and not generation.admitted
    for source, targets in MOVES.items():
        for target in set(GenerationStatus) - targets:
            stuck = Generation(GenConfig(), None, None)
            stuck.status = source
            with pytest.raises(AssertionError, match=f"from {source.name} to {target.name}"):
                stuck.move(target)
    with pytest.raises(ValueError, match="ContextSource"):
        Generation(GenConfig(), None, None, kind=GenerationKind.SUBMISSION)
