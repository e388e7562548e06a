"""The runner owns every queue: submissions wait for sessions and cells, preemption
under KV pressure, priorities (a more urgent generation starts first, is fed in steps of
its own and never gives its cells up to a less urgent one), stop strings and text in
the core, and the contract fixes of Runner v2 (awaiting a running handle, a cancel
landing in a fresh session's prompt).

Against the deterministic fake executor: a token taking position p is 1000 + p.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from cellbatch import GenerationHandle, Runner
from cellbatch.generation_config import GenConfig, SamplingParams
from cellbatch.runner import Occupancy
from cellbatch.runner.admission import GROWTH_CELLS, Admission, AdmissionPolicy
from cellbatch.runner.generation import ContextSource, Generation, GenerationKind
from cellbatch.types import BATCH_PRIORITY, FinishReason, GenerationUpdate, InvalidArgumentError
from fake_executor import WAIT_S, FakeExecutor, make_tokens, open_session, wait_until


class LetterTokenizer:
    """Token t decodes to one letter, 'a' + t % 26; token 2 decodes to nothing. Counts
    the tokens it decodes."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, tokens: Sequence[int]) -> str:
        self.decoded += len(tokens)
        return "".join("" if t == 2 else chr(ord("a") + t % 26) for t in tokens)


def settle(handle: GenerationHandle) -> GenerationHandle:
    assert handle.wait(WAIT_S)
    return handle


def expected_tokens(prompt_length: int, count: int) -> list[int]:
    return [1000 + prompt_length + i for i in range(count)]


# -- submissions wait in the runner ----------------------------------------------------------


def test_sync_returns_once_a_settled_submission_has_given_its_cells_back(runners) -> None:
    runner, fake = runners.make(FakeExecutor(cell_limit=512))
    slow_settle = threading.Event()

    def on_settled(handle: GenerationHandle) -> None:
        # Waiters wake before this runs, and the session is released after it returns.
        slow_settle.wait(0.3)

    handle = settle(runner.submit(make_tokens(40), GenConfig(max_new_tokens=4), None, on_settled))
    assert runner.sync(WAIT_S)
    usage = runner.kv_usage()
    assert usage is not None and usage.cells_in_use == 0
    assert fake.open_count == 0
    assert handle.finish_reason() is FinishReason.TOKEN_LIMIT


def test_sync_on_a_stopped_runner_returns_at_once(runners) -> None:
    runner, _ = runners.make()
    runner.shutdown()
    assert runner.sync(0.0)


def test_submissions_beyond_the_session_limit_wait_and_all_complete(runners) -> None:
    runner, fake = runners.make(FakeExecutor(max_sessions=3))
    handles = [runner.submit(make_tokens(5 + i), GenConfig(max_new_tokens=4)) for i in range(10)]
    for i, handle in enumerate(handles):
        assert settle(handle).finish_reason() == FinishReason.TOKEN_LIMIT
        assert handle.tokens() == expected_tokens(5 + i, 4)
    assert runner.metrics().peak_concurrent_generations == 3
    assert wait_until(lambda: fake.open_count == 0)  # each submission closed its session


def test_occupancy_counts_running_and_waiting_generations_as_of_the_last_step(
    runners,
) -> None:
    fake = FakeExecutor(max_sessions=2)
    runner, _ = runners.make(fake)
    seen: list[Occupancy] = []
    fake.on_execute = lambda batch: seen.append(runner.occupancy())
    assert runner.occupancy() == Occupancy(running=0, waiting=0)
    fake.hold()
    handles = [runner.submit(make_tokens(5), GenConfig(max_new_tokens=4))]
    assert fake.wait_held()  # step 1 runs the first alone; the others queue behind it
    handles += [runner.submit(make_tokens(5), GenConfig(max_new_tokens=4)) for _ in range(4)]
    fake.release()
    for handle in handles:
        settle(handle)
    assert runner.sync(WAIT_S)
    # Step 2 takes the second (two sessions in all), so step 3 sees two run, three wait.
    assert seen[1:3] == [Occupancy(1, 0), Occupancy(2, 3)]
    running, waiting = runner.occupancy()
    assert (running, waiting) == (0, 0)


def test_submissions_start_in_arrival_order(runners) -> None:
    runner, _ = runners.make(FakeExecutor(max_sessions=1))
    order: list[int] = []
    handles = [
        runner.submit(
            make_tokens(3), GenConfig(max_new_tokens=1), on_settled=lambda h, i=i: order.append(i)
        )
        for i in range(6)
    ]
    for handle in handles:
        settle(handle)
    assert order == list(range(6))


def test_submissions_from_a_closed_source_share_it_and_the_last_takes_it_over(runners) -> None:
    runner, fake = runners.make(FakeExecutor(max_sessions=3))
    root = open_session(runner)
    prefix = make_tokens(8)
    assert settle(root.prefill_async(prefix)).finish_reason() == FinishReason.TOKEN_LIMIT
    handles = [
        runner.submit([50 + i], GenConfig(max_new_tokens=3), source=root, upto=8) for i in range(5)
    ]
    root_sid = root.id
    root.close()  # queued submissions still start from it
    for handle in handles:
        assert settle(handle).finish_reason() == FinishReason.TOKEN_LIMIT
        assert handle.tokens() == expected_tokens(9, 3)
    assert all(call == (root_sid, 8) for call in fake.clone_calls)
    # The root and four copies: the fifth submission took the root itself over.
    assert runner.metrics().sessions_opened == 1 + 4
    assert any(inp.sid == root_sid and list(inp.tokens) == [54] for inp in fake.inputs_of(root_sid))
    assert wait_until(lambda: fake.open_count == 0)


def test_a_submission_with_an_empty_prompt_and_no_source_fails_alone(runners) -> None:
    runner, _ = runners.make()
    bad = settle(runner.submit([], GenConfig(max_new_tokens=2)))
    good = settle(runner.submit(make_tokens(3), GenConfig(max_new_tokens=2)))
    assert bad.finish_reason() == FinishReason.FAILED and "prompt is empty" in bad.error()
    assert good.finish_reason() == FinishReason.TOKEN_LIMIT


def test_cancelling_a_waiting_submission_releases_its_place(runners) -> None:
    runner, fake = runners.make(FakeExecutor(max_sessions=1))
    fake.hold()
    first = runner.submit(make_tokens(3), GenConfig(max_new_tokens=2))
    assert fake.wait_held()
    waiting = runner.submit(make_tokens(3), GenConfig(max_new_tokens=2))
    waiting.cancel()
    fake.release()
    assert settle(waiting).finish_reason() == FinishReason.CANCELLED
    assert settle(first).finish_reason() == FinishReason.TOKEN_LIMIT
    assert waiting.tokens() == []


# -- the runner's defaults --------------------------------------------------------------------


def test_sessions_default_to_the_runners_stop_tokens(runners) -> None:
    runner, _ = runners.make(FakeExecutor(stop_after=2, stop_token=7), stop_tokens=[7])
    session = open_session(runner)
    handle = settle(session.generate_async(make_tokens(3), GenConfig(max_new_tokens=10)))
    assert handle.finish_reason() == FinishReason.STOP_TOKEN and handle.tokens()[-1] == 7
    # An explicit set replaces the default: here, none at all.
    config = GenConfig(max_new_tokens=4, stop_tokens=frozenset())
    assert settle(session.generate_async([9], config)).finish_reason() == FinishReason.TOKEN_LIMIT


def test_generate_after_a_prefill_turn_with_an_empty_delta(runners) -> None:
    runner, _ = runners.make()
    session = open_session(runner)
    settle(session.prefill_async(make_tokens(6)))
    clone = session.clone_async(session.position()).result(WAIT_S)
    assert clone is not None
    for target in (session, clone):
        handle = settle(target.generate_async([], GenConfig(max_new_tokens=2)))
        assert handle.finish_reason() == FinishReason.TOKEN_LIMIT
        assert handle.tokens() == expected_tokens(6, 2)  # same as one 6-token prompt
    assert runner.metrics().recomputed_tokens == 2  # each replayed the last prompt token


def test_an_empty_delta_on_an_empty_session_fails(runners) -> None:
    runner, _ = runners.make()
    handle = settle(open_session(runner).generate_async([], GenConfig(max_new_tokens=2)))
    assert handle.finish_reason() == FinishReason.FAILED and "delta is empty" in handle.error()


# -- text and stop strings in the core ---------------------------------------------------------


def test_updates_carry_text_and_a_stop_string_ends_the_generation(runners) -> None:
    runner, fake = runners.make(tokenizer=LetterTokenizer())
    session = open_session(runner)
    # Prompt of 4 tokens: generated tokens 1004, 1005, ... decode to q, r, s, t, ...
    updates: list[GenerationUpdate] = []
    handle = settle(
        session.generate_async(
            make_tokens(4), GenConfig(max_new_tokens=20, stop_strings=("st",)), updates.append
        )
    )
    assert handle.finish_reason() == FinishReason.STOP_STRING and handle.error() == ""
    assert handle.tokens() == [1004, 1005, 1006, 1007]  # 1007 ("t") completed "st"
    assert handle.text() == "qr"
    assert "".join(update.text for update in updates) == "qr"
    assert all("s" not in update.text for update in updates)  # never a part of the stop
    assert len(fake.batches) == 4  # nothing ran past the stop
    # The session holds exactly the delivered tokens; no cancel was involved.
    assert session.unfed() == (1007,)
    assert runner.metrics().finished["stop_string"] == 1
    assert runner.metrics().finished["cancelled"] == 0


def test_stop_checking_costs_per_token_not_per_generation(runners) -> None:
    tokenizer = LetterTokenizer()
    runner, _ = runners.make(tokenizer=tokenizer)
    config = GenConfig(max_new_tokens=3000, stop_strings=("zzz", "never"))
    session = open_session(runner)
    handle = settle(session.generate_async(make_tokens(4), config))
    assert handle.finish_reason() == FinishReason.TOKEN_LIMIT
    assert len(handle.text()) == 3000
    # A bounded window per token: O(n), where re-decoding the text would be O(n^2).
    assert tokenizer.decoded <= 4 * 3000


def test_stop_strings_without_a_tokenizer_fail_clearly(runners) -> None:
    runner, _ = runners.make()
    config = GenConfig(max_new_tokens=3, stop_strings=("x",))
    handle = settle(open_session(runner).generate_async(make_tokens(3), config))
    assert handle.finish_reason() == FinishReason.FAILED and "tokenizer" in handle.error()


# -- contract fixes ----------------------------------------------------------------------------


def test_awaiting_a_running_generation_waits_for_its_end(runners) -> None:
    runner, _ = runners.make()
    session = open_session(runner)
    handle = session.generate_async(list(range(10, 30)), GenConfig(max_new_tokens=50))

    async def main() -> GenerationUpdate:
        return await handle

    result = asyncio.run(main())
    assert result.finish_reason == FinishReason.TOKEN_LIMIT and len(result.tokens) == 50


def test_a_cancel_in_the_step_that_consumes_a_fresh_prompt_harms_no_one(runners) -> None:
    runner, _ = runners.make()
    a, b, c = open_session(runner), open_session(runner), open_session(runner)
    handles: dict[str, GenerationHandle] = {}

    def a_update(update: GenerationUpdate) -> None:
        if "b" in handles:
            handles["b"].cancel()

    def c_update(update: GenerationUpdate) -> None:
        if "a" not in handles:
            handles["a"] = a.generate_async(make_tokens(20), GenConfig(max_new_tokens=5), a_update)
            handles["b"] = b.generate_async(make_tokens(20, 40), GenConfig(max_new_tokens=5))

    handles["c"] = c.generate_async(make_tokens(10), GenConfig(max_new_tokens=30), c_update)
    for name in ("a", "b", "c"):
        assert wait_until(lambda name=name: name in handles)
        settle(handles[name])
    assert handles["b"].finish_reason() == FinishReason.CANCELLED
    # Both sessions take new turns; nothing failed.
    for session in (c, b):
        handle = settle(session.generate_async([7], GenConfig(max_new_tokens=2)))
        assert handle.finish_reason() == FinishReason.TOKEN_LIMIT, handle.error()
    assert runner.metrics().failed_steps == 0
    assert b.position() + len(b.unfed()) == 20 + 1 + 2  # its prompt, [7], two tokens


# -- preemption under KV pressure ------------------------------------------------------------


@pytest.mark.parametrize("seeded", [False, True])
def test_generations_over_a_small_pool_are_preempted_and_give_the_same_tokens(
    runners, seeded: bool
) -> None:
    sampling = SamplingParams(temperature=0.8) if seeded else SamplingParams()
    prompts = [make_tokens(6 + i % 5, start=10 + i) for i in range(24)]
    new_tokens = GROWTH_CELLS + 24  # each outgrows the growth reserve it started with

    def run_all(fake: FakeExecutor) -> tuple[list[list[int]], Runner]:
        runner, _ = runners.make(fake)
        handles = [
            runner.submit(p, GenConfig(max_new_tokens=new_tokens, sampling=sampling, seed=i))
            for i, p in enumerate(prompts)
        ]
        for handle in handles:
            assert settle(handle).finish_reason() == FinishReason.TOKEN_LIMIT, handle.error()
        return [handle.tokens() for handle in handles], runner

    free, _ = run_all(FakeExecutor())
    pressed_fake = FakeExecutor(cell_limit=6 * (10 + new_tokens))  # about 6 full contexts
    pressed, runner = run_all(pressed_fake)
    assert pressed == free
    metrics = runner.metrics()
    assert metrics.preemptions > 0 and metrics.recomputed_tokens > 0
    assert wait_until(lambda: pressed_fake.used_cells() == 0)


def test_a_preempted_generation_keeps_its_random_stream(runners) -> None:
    runner, fake = runners.make(FakeExecutor(cell_limit=60))
    session = open_session(runner)
    # Hold the second step so that others join and force a preemption.
    handle = session.generate_async(
        make_tokens(10), GenConfig(max_new_tokens=30, sampling=SamplingParams(0.5), seed=3)
    )
    others = [runner.submit(make_tokens(10), GenConfig(max_new_tokens=30)) for _ in range(2)]
    for h in [handle, *others]:
        assert settle(h).finish_reason() == FinishReason.TOKEN_LIMIT, h.error()
    # set_sampling ran once per generation: a resumed generation is not re-seeded.
    assert sum(1 for sid, _, _ in fake.sampling if sid == session.id) == 1


def test_a_turn_cancelled_while_it_waits_for_cells_leaves_its_delta_unfed(runners) -> None:
    runner, fake = runners.make(FakeExecutor(cell_limit=60))
    busy, waiting = open_session(runner), open_session(runner)
    fake.hold()
    running = busy.generate_async(make_tokens(40), GenConfig(max_new_tokens=10))
    assert fake.wait_held()
    delta = make_tokens(30, start=50)
    turn = waiting.generate_async(delta, GenConfig(max_new_tokens=3))  # 30 cells: 20 free
    turn.cancel()
    fake.release()
    assert settle(turn).finish_reason() == FinishReason.CANCELLED
    assert turn.tokens() == [] and runner.metrics().failed_steps == 0
    # The session holds the delta, unfed, as after a turn cancelled once it had begun.
    assert waiting.position() == 0 and list(waiting.unfed()) == delta
    assert settle(running).finish_reason() == FinishReason.TOKEN_LIMIT
    after = settle(waiting.generate_async([9], GenConfig(max_new_tokens=3)))
    assert after.finish_reason() == FinishReason.TOKEN_LIMIT, after.error()
    assert after.tokens() == expected_tokens(30 + 1, 3)
    assert fake.contexts[waiting.id][:31] == [*delta, 9]


def test_idle_sessions_give_their_cells_back_and_recompute_on_their_next_turn(runners) -> None:
    runner, fake = runners.make(FakeExecutor(cell_limit=50))
    idle = open_session(runner)
    first = settle(idle.generate_async(make_tokens(20), GenConfig(max_new_tokens=5)))
    busy = settle(runner.submit(make_tokens(30), GenConfig(max_new_tokens=10)))
    assert busy.finish_reason() == FinishReason.TOKEN_LIMIT, busy.error()
    assert runner.metrics().sessions_reclaimed >= 1
    # The idle session's next turn continues its context as if nothing happened.
    second = settle(idle.generate_async([9], GenConfig(max_new_tokens=3)))
    assert second.finish_reason() == FinishReason.TOKEN_LIMIT
    assert first.tokens() == expected_tokens(20, 5)
    assert second.tokens() == expected_tokens(20 + 5 + 1, 3)
    assert fake.contexts[idle.id][:26] == [*make_tokens(20), *expected_tokens(20, 5), 9]


def test_clones_sharing_a_prefix_keep_it_when_another_is_preempted(runners) -> None:
    runner, fake = runners.make(FakeExecutor(cell_limit=70))
    root = open_session(runner)
    settle(root.prefill_async(make_tokens(16)))
    handles = [
        runner.submit([60 + i], GenConfig(max_new_tokens=20), source=root, upto=16)
        for i in range(4)
    ]
    for handle in handles:
        assert settle(handle).finish_reason() == FinishReason.TOKEN_LIMIT, handle.error()
        assert handle.tokens() == expected_tokens(17, 20)
    root.close()
    assert wait_until(lambda: fake.used_cells() == 0)


def test_a_context_too_big_for_the_whole_pool_fails_alone_with_the_numbers(runners) -> None:
    runner, _ = runners.make(FakeExecutor(cell_limit=30))
    small = runner.submit(make_tokens(5), GenConfig(max_new_tokens=5))
    big = runner.submit(make_tokens(40), GenConfig(max_new_tokens=5))
    assert settle(big).finish_reason() == FinishReason.FAILED
    assert "not enough KV cells" in big.error() and "30" in big.error()
    assert settle(small).finish_reason() == FinishReason.TOKEN_LIMIT


def test_a_generation_that_outgrows_the_pool_fails_with_the_numbers(runners) -> None:
    runner, _ = runners.make(FakeExecutor(cell_limit=20))
    handle = settle(runner.submit(make_tokens(10), GenConfig(max_new_tokens=30)))
    assert handle.finish_reason() == FinishReason.FAILED
    assert "pool has 20" in handle.error()
    assert len(handle.tokens()) == 11  # everything up to the last cell was delivered


def test_reserve_admission_never_preempts(runners) -> None:
    runner, _ = runners.make(FakeExecutor(cell_limit=6 * 34), admission="reserve")
    handles = [runner.submit(make_tokens(10), GenConfig(max_new_tokens=24)) for _ in range(16)]
    for handle in handles:
        assert settle(handle).finish_reason() == FinishReason.TOKEN_LIMIT
    assert runner.metrics().preemptions == 0
    assert runner.metrics().peak_concurrent_generations <= 6


def test_a_raising_callback_during_pressure_fails_only_its_generation(runners) -> None:
    runner, _ = runners.make(FakeExecutor(cell_limit=80))
    calls = threading.Event()

    def boom(update: GenerationUpdate) -> None:
        calls.set()
        raise ValueError("boom")

    bad = runner.submit(make_tokens(10), GenConfig(max_new_tokens=20), boom)
    good = [runner.submit(make_tokens(10), GenConfig(max_new_tokens=20)) for _ in range(5)]
    assert settle(bad).finish_reason() == FinishReason.FAILED and calls.is_set()
    for handle in good:
        assert settle(handle).finish_reason() == FinishReason.TOKEN_LIMIT


# -- the runner's prefix cache ----------------------------------------------------------------


def test_a_submission_sharing_a_prefix_starts_from_a_kept_snapshot(runners) -> None:
    runner, fake = runners.make(prefix_cache_entries=4)
    first = settle(runner.submit(make_tokens(20), GenConfig(max_new_tokens=3)))
    # A longer prompt that begins with the first's prompt and answer (a chat's next turn).
    follow_up = [*make_tokens(20), *first.tokens()[:-1], 77, 78]
    second = settle(runner.submit(follow_up, GenConfig(max_new_tokens=3)))
    assert second.finish_reason() == FinishReason.TOKEN_LIMIT
    assert second.metrics().cached_tokens == 22  # prompt + the two answer tokens it fed
    assert second.metrics().prompt_tokens == len(follow_up) - 22
    assert second.tokens() == expected_tokens(len(follow_up), 3)
    metrics = runner.metrics()
    assert (metrics.prefix_cache_hits, metrics.prefix_cache_tokens) == (1, 22)
    assert fake.open_count == 2  # both kept as snapshots


def test_a_prompt_always_feeds_its_last_token_even_when_all_of_it_is_cached(runners) -> None:
    runner, _ = runners.make(prefix_cache_entries=4)
    settle(runner.submit(make_tokens(10), GenConfig(max_new_tokens=2)))
    again = settle(runner.submit(make_tokens(10), GenConfig(max_new_tokens=2)))
    assert again.metrics().cached_tokens == 9
    assert again.tokens() == expected_tokens(10, 2)


def test_snapshots_give_way_to_live_work_for_sessions_and_cells(runners) -> None:
    runner, fake = runners.make(FakeExecutor(max_sessions=2, cell_limit=40), prefix_cache_entries=8)
    for start in (10, 40):
        settle(runner.submit(make_tokens(12, start), GenConfig(max_new_tokens=2)))
    assert fake.open_count == 2  # both slots held by snapshots
    fresh = settle(runner.submit(make_tokens(30, 70), GenConfig(max_new_tokens=5)))
    assert fresh.finish_reason() == FinishReason.TOKEN_LIMIT, fresh.error()
    assert fresh.metrics().cached_tokens == 0


def test_with_every_session_busy_a_matching_snapshot_is_taken_over(runners) -> None:
    # As many streaming clients as sessions: the only session not generating is the
    # finished request's snapshot, and the next request sharing its prefix (a system
    # prompt) starts from its cells instead of closing it and feeding everything again.
    runner, fake = runners.make(FakeExecutor(max_sessions=1), prefix_cache_entries=4)
    settle(runner.submit(make_tokens(20), GenConfig(max_new_tokens=3)))
    prompt = [*make_tokens(12), 90, 91]
    second = settle(runner.submit(prompt, GenConfig(max_new_tokens=3)))
    assert second.finish_reason() == FinishReason.TOKEN_LIMIT, second.error()
    assert second.metrics().cached_tokens == 12
    assert second.metrics().prompt_tokens == 2
    assert second.tokens() == expected_tokens(len(prompt), 3)
    assert runner.metrics().prefix_cache_hits == 1
    assert runner.metrics().sessions_opened == 1  # the take-over opened none
    assert fake.open_count == 1


def test_a_matching_snapshot_keeps_its_session_and_an_older_one_gives_way(runners) -> None:
    runner, fake = runners.make(FakeExecutor(max_sessions=2), prefix_cache_entries=4)
    settle(runner.submit(make_tokens(20), GenConfig(max_new_tokens=3)))
    settle(runner.submit(make_tokens(20, 40), GenConfig(max_new_tokens=3)))  # newer
    assert fake.open_count == 2  # both sessions held by snapshots
    for _ in range(2):
        prompt = [*make_tokens(12), 90, 91]
        handle = settle(runner.submit(prompt, GenConfig(max_new_tokens=3)))
        assert handle.finish_reason() == FinishReason.TOKEN_LIMIT, handle.error()
        # The first time from the first snapshot, the second from either it or the
        # first answer's, which holds all of the prompt (its last token still runs).
        assert handle.metrics().cached_tokens in (12, 13)
        assert handle.tokens() == expected_tokens(len(prompt), 3)
    assert runner.metrics().prefix_cache_hits == 2


def test_failed_submissions_are_not_kept(runners) -> None:
    runner, fake = runners.make(FakeExecutor(fail_steps={2}), prefix_cache_entries=4)
    failed = settle(runner.submit(make_tokens(10), GenConfig(max_new_tokens=3)))
    assert failed.finish_reason() == FinishReason.FAILED
    assert wait_until(lambda: fake.open_count == 0)


def test_the_prefix_cache_is_off_by_default_and_refuses_bad_sizes(runners) -> None:
    runner, fake = runners.make()
    settle(runner.submit(make_tokens(10), GenConfig(max_new_tokens=2)))
    assert wait_until(lambda: fake.open_count == 0)
    with pytest.raises(InvalidArgumentError):
        Runner(FakeExecutor(), prefix_cache_entries=-1)


# -- priorities ------------------------------------------------------------------------------


def settle_complete(handle: GenerationHandle) -> GenerationHandle:
    assert settle(handle).finish_reason() == FinishReason.TOKEN_LIMIT, handle.error()
    return handle


BATCH = GenConfig(max_new_tokens=6, priority=BATCH_PRIORITY)
URGENT = GenConfig(max_new_tokens=6)


def waiting(priority: int) -> Generation:
    generation = Generation(
        GenConfig(priority=priority), None, None, kind=GenerationKind.SUBMISSION,
        start=ContextSource(),
    )  # fmt: skip
    generation.delta = (1, 2)
    return generation


def test_the_queue_orders_by_priority_then_arrival_and_a_preempted_one_leads_its_own() -> None:
    admission = Admission(AdmissionPolicy.OPTIMISTIC)
    batch_a, batch_b, urgent_a, urgent_b = waiting(10), waiting(10), waiting(0), waiting(0)
    for generation in (batch_a, urgent_a, batch_b, urgent_b):
        admission.enqueue(generation)
    assert list(admission.waiting) == [urgent_a, urgent_b, batch_a, batch_b]
    for _ in range(3):
        head = admission.head()
        assert head is not None
        admission.start(head)
    assert admission.preemption_victim() is batch_a  # the least urgent running one
    admission.preempt(batch_a)
    assert list(admission.waiting) == [batch_a, batch_b]
    admission.enqueue(late := waiting(0))
    assert list(admission.waiting) == [late, batch_a, batch_b]


def test_the_victim_is_the_newest_of_the_least_urgent() -> None:
    admission = Admission(AdmissionPolicy.OPTIMISTIC)
    older, newer, urgent = waiting(10), waiting(10), waiting(0)
    for generation in (urgent, older, newer):
        admission.enqueue(generation)
        admission.start(generation)
    assert admission.preemption_victim() is newer


def test_a_more_urgent_submission_starts_ahead_of_waiting_batch_ones(runners) -> None:
    runner, fake = runners.make(FakeExecutor(max_sessions=1))
    order: list[str] = []
    fake.hold()
    first = runner.submit(make_tokens(3), BATCH, on_settled=lambda h: order.append("batch 0"))
    assert fake.wait_held()  # the first batch submission holds the only session
    handles = [
        runner.submit(make_tokens(3), BATCH, on_settled=lambda h, i=i: order.append(f"batch {i}"))
        for i in (1, 2)
    ]
    urgent = runner.submit(make_tokens(3), URGENT, on_settled=lambda h: order.append("urgent"))
    fake.release()
    for handle in (first, *handles, urgent):
        settle_complete(handle)
    assert order == ["batch 0", "urgent", "batch 1", "batch 2"]


def test_an_urgent_prompt_is_fed_in_steps_without_less_urgent_work(runners) -> None:
    runner, fake = runners.make(FakeExecutor())
    fake.hold()
    batch = [
        runner.submit(make_tokens(5, start=20 + i), GenConfig(max_new_tokens=40, priority=10))
        for i in range(3)
    ]
    assert fake.wait_held()  # the batch prompts' step: the batch decodes come next
    urgent = runner.submit(make_tokens(40, start=100), URGENT)
    fake.release()
    settle_complete(urgent)
    for handle in batch:
        settle_complete(handle)
    prompt_steps = [
        step for step in fake.batches if any(len(inp.payload) == 40 for inp in step.inputs)
    ]
    assert sum(len(step.inputs) for step in prompt_steps) == 3  # 3 chunks of at most 16
    for step in prompt_steps:  # the batch decodes waited while the urgent prompt was fed
        assert all(len(inp.payload) == 40 for inp in step.inputs), step
    urgent_sid = prompt_steps[0].inputs[0].sid
    # Once it decodes, the batch decodes run beside it again.
    assert any(
        urgent_sid in {inp.sid for inp in step.inputs} and len(step.inputs) > 1
        for step in fake.batches
        if step not in prompt_steps
    )


def test_an_urgent_generation_short_of_cells_takes_them_from_a_batch_one(runners) -> None:
    runner, fake = runners.make(FakeExecutor(cell_limit=80))
    fake.hold()
    batch = runner.submit(make_tokens(10), GenConfig(max_new_tokens=60, priority=BATCH_PRIORITY))
    assert fake.wait_held()
    urgent = runner.submit(make_tokens(10, start=50), GenConfig(max_new_tokens=40))
    fake.release()
    settle_complete(urgent)
    settle_complete(batch)
    metrics = runner.metrics()
    assert metrics.preemptions >= 1
    # The batch generation gave way and resumed: the same tokens as alone.
    assert batch.tokens() == [1000 + 10 + i for i in range(60)]
    assert urgent.tokens() == [1000 + 10 + i for i in range(40)]


def test_a_priority_that_is_not_an_integer_is_refused_when_the_config_is_built() -> None:
    with pytest.raises(InvalidArgumentError, match="priority must be an integer"):
        GenConfig(priority="high")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="priority must be an integer"):
        GenConfig(priority=True)
