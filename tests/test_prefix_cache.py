"""PrefixCache: longest-prefix reuse of snapshot sessions through cloning."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cellbatch import PrefixCache, Runner, Session
from cellbatch.scheduler import DecodeFirstScheduler
from cellbatch.types import FinishReason, GenConfig, InvalidArgumentError
from fake_executor import WAIT_S, FakeExecutor, make_tokens, open_session, wait_until


@pytest.fixture
def fake() -> FakeExecutor:
    return FakeExecutor()


@pytest.fixture
def runner(fake: FakeExecutor) -> Iterator[Runner]:
    runner = Runner(fake, DecodeFirstScheduler.create(64, 8, 16))
    yield runner
    runner.shutdown()
    assert fake.open_count == 0


def generate(session: Session, delta: list[int], max_new: int = 1, **kwargs: object) -> None:
    handle = session.generate_async(delta, GenConfig(max_new_tokens=max_new), **kwargs)  # type: ignore[arg-type]
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.TOKEN_LIMIT, handle.error()


def snapshot_of(runner: Runner, fake: FakeExecutor, tokens: list[int]) -> Session:
    """An idle session holding exactly `tokens` (its source is closed)."""
    source = open_session(runner)
    generate(source, tokens)
    snapshot = source.clone_async(len(tokens)).result(WAIT_S)
    assert snapshot is not None
    source.close()
    assert wait_until(lambda: source.id not in fake.contexts)
    return snapshot


def cache_with(
    runner: Runner, fake: FakeExecutor, *histories: list[int], max_entries: int = 8
) -> PrefixCache:
    cache = PrefixCache(max_entries)
    for tokens in histories:
        assert cache.insert(tokens, snapshot_of(runner, fake, tokens))
    return cache


@pytest.mark.parametrize(
    ("cached", "matched"),
    [("equal", 7), ("shorter", 5), ("longer", 7)],
)
def test_equal_shorter_and_longer_prompts_all_replay_the_final_prompt_token(
    runner: Runner, fake: FakeExecutor, cached: str, matched: int
) -> None:
    request = make_tokens(8)
    key = {"equal": request, "shorter": request[:5], "longer": [*request, 90, 91]}[cached]
    cache = cache_with(runner, fake, key)
    hit = cache.lookup(request)
    assert hit is not None and hit.matched == matched
    assert hit.session.position() == matched
    generate(hit.session, request[matched:])
    (opening,) = fake.inputs_of(hit.session.id)
    assert opening.start == matched and opening.tokens[-1] == request[-1]
    assert fake.contexts[hit.session.id][:8] == request


def test_a_one_token_request_or_no_match_is_a_miss(runner: Runner, fake: FakeExecutor) -> None:
    cache = cache_with(runner, fake, make_tokens(4))
    calls = len(fake.clone_calls)
    assert cache.lookup(make_tokens(1)) is None
    assert cache.lookup(make_tokens(4, start=500)) is None
    assert len(fake.clone_calls) == calls


def test_branches_survive_closing_their_source_and_evicting_the_snapshot(
    runner: Runner, fake: FakeExecutor
) -> None:
    first = make_tokens(6)
    cache = cache_with(runner, fake, first, max_entries=1)
    hit = cache.lookup([*first, 50])
    assert hit is not None and hit.matched == 6
    evicted_sid = fake.clone_calls[-1][0]
    assert cache.insert(
        make_tokens(3, start=300), snapshot_of(runner, fake, make_tokens(3, start=300))
    )
    assert cache.keys() == [tuple(make_tokens(3, start=300))]
    assert wait_until(lambda: evicted_sid in fake.closed)
    generate(hit.session, [50], max_new=2)
    assert fake.contexts[hit.session.id][:7] == [*first, 50]


def test_the_longest_match_wins_over_a_more_recent_shorter_one(
    runner: Runner, fake: FakeExecutor
) -> None:
    request = make_tokens(10)
    cache = cache_with(runner, fake, request[:6], request[:3])
    hit = cache.lookup(request)
    assert hit is not None and hit.matched == 6
    assert fake.contexts[hit.session.id] == request[:6]


def test_equal_lengths_prefer_the_most_recently_used(runner: Runner, fake: FakeExecutor) -> None:
    request = make_tokens(8)
    older, newer = [*request[:4], 90], [*request[:4], 91]
    cache = cache_with(runner, fake, older, newer)
    hit = cache.lookup(request)
    assert hit is not None and hit.matched == 4
    source = fake.clone_calls[-1][0]
    assert fake.contexts[source] == newer


def test_a_duplicate_insert_refreshes_lru_and_drops_the_new_snapshot(
    runner: Runner, fake: FakeExecutor
) -> None:
    a, b, c = make_tokens(3), make_tokens(3, start=100), make_tokens(3, start=200)
    cache = cache_with(runner, fake, a, b, max_entries=2)
    duplicate = snapshot_of(runner, fake, a)
    assert not cache.insert(a, duplicate)
    assert wait_until(lambda: duplicate.id in fake.closed)
    assert cache.keys() == [tuple(b), tuple(a)]
    assert cache.insert(c, snapshot_of(runner, fake, c))
    assert cache.keys() == [tuple(a), tuple(c)]


def test_a_hit_refreshes_lru_before_eviction(runner: Runner, fake: FakeExecutor) -> None:
    a, b, c = make_tokens(3), make_tokens(3, start=100), make_tokens(3, start=200)
    cache = cache_with(runner, fake, a, b, max_entries=2)
    assert cache.lookup([*a, 7]) is not None
    assert cache.insert(c, snapshot_of(runner, fake, c))
    assert cache.keys() == [tuple(a), tuple(c)]


def test_a_refused_clone_moves_to_the_next_snapshot_without_retrying_shorter_boundaries(
    runner: Runner, fake: FakeExecutor
) -> None:
    request = make_tokens(10)
    cache = cache_with(runner, fake, request[:6], request[:4])
    long_sid = next(sid for sid, ctx in fake.contexts.items() if ctx == request[:6])
    short_sid = next(sid for sid, ctx in fake.contexts.items() if ctx == request[:4])
    fake.refuse_clone_of.add(long_sid)
    before = len(fake.clone_calls)
    hit = cache.lookup(request)
    assert hit is not None and hit.matched == 4
    assert fake.clone_calls[before:] == [(long_sid, 6), (short_sid, 4)]


def test_an_older_snapshot_can_serve_a_refused_newer_match(
    runner: Runner, fake: FakeExecutor
) -> None:
    request = make_tokens(8)
    older, newer = [*request[:5], 90], [*request[:5], 91]
    cache = cache_with(runner, fake, older, newer)
    older_sid = next(sid for sid, ctx in fake.contexts.items() if ctx == older)
    newer_sid = next(sid for sid, ctx in fake.contexts.items() if ctx == newer)
    fake.refuse_clone_of.add(newer_sid)
    before = len(fake.clone_calls)
    hit = cache.lookup(request)
    assert hit is not None and hit.matched == 5
    assert fake.clone_calls[before:] == [(newer_sid, 5), (older_sid, 5)]


def test_capacity_refusal_leaks_and_evicts_nothing(runner: Runner, fake: FakeExecutor) -> None:
    request = make_tokens(8)
    cache = cache_with(runner, fake, request[:5], request[:3])
    fake.max_sessions = fake.open_count
    opened, closed = fake.open_count, list(fake.closed)
    assert cache.lookup(request) is None
    assert len(fake.clone_calls) == 2 + 2  # two snapshots taken, then one try each
    assert len(cache) == 2
    assert (fake.open_count, fake.closed) == (opened, closed)


def test_insert_checks_the_snapshot_holds_exactly_its_tokens(
    runner: Runner, fake: FakeExecutor
) -> None:
    a, b = make_tokens(3), make_tokens(3, start=100)
    cache = cache_with(runner, fake, a, max_entries=1)
    busy = open_session(runner)
    generate(busy, b)  # position 3 and a pending token: not a snapshot
    with pytest.raises(InvalidArgumentError, match="exactly its tokens"):
        cache.insert(b, busy)
    with pytest.raises(InvalidArgumentError, match="exactly its tokens"):
        cache.insert(make_tokens(5), snapshot_of(runner, fake, b))
    assert cache.keys() == [tuple(a)]
    with pytest.raises(InvalidArgumentError, match="max_entries"):
        PrefixCache(0)


def test_capture_is_taken_before_decode_can_overwrite_anything() -> None:
    fake = FakeExecutor(prefill_tokens=3, decode_tokens=2)  # runs ahead of the prompt
    with Runner(fake, DecodeFirstScheduler.create(64, 8, 16)) as own:
        session = open_session(own)
        prompt = make_tokens(6)
        cache = PrefixCache(4)
        capture = cache.capture_prompt(session, prompt)
        generate(session, prompt, max_new=6, on_update=capture.on_update)
        assert capture.collect(WAIT_S)
        executes = [i for i, event in enumerate(fake.events) if event[0] == "execute"]
        taken = fake.events.index(("clone", session.id, 6))
        assert executes[0] < taken < executes[1]
        assert cache.keys() == [tuple(prompt)]
        hit = cache.lookup([*prompt, 1])
        assert hit is not None and fake.contexts[hit.session.id] == prompt


def test_capture_copies_the_whole_history_after_a_reused_prefix(
    runner: Runner, fake: FakeExecutor
) -> None:
    reused = make_tokens(5)
    request = [*reused, *make_tokens(4, start=50)]
    cache = cache_with(runner, fake, reused)
    hit = cache.lookup(request)
    assert hit is not None and hit.matched == 5
    capture = cache.capture_prompt(hit.session, request)
    generate(hit.session, request[5:], max_new=3, on_update=capture.on_update)
    assert capture.collect(WAIT_S)
    again = cache.lookup([*request, 1])
    assert again is not None and again.matched == len(request)
    assert fake.contexts[again.session.id] == request


def test_capture_never_swallows_a_user_callback_exception(
    runner: Runner, fake: FakeExecutor
) -> None:
    session = open_session(runner)
    cache = PrefixCache(2)

    def explode(update: object) -> None:
        raise ValueError("user bug")

    capture = cache.capture_prompt(session, make_tokens(4), on_update=explode)
    handle = session.generate_async(
        make_tokens(4), GenConfig(max_new_tokens=3), on_update=capture.on_update
    )
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.FAILED
    assert "user bug" in handle.error()


def test_capture_takes_nothing_for_a_rejected_generation(
    runner: Runner, fake: FakeExecutor
) -> None:
    session = open_session(runner)
    cache = PrefixCache(2)
    capture = cache.capture_prompt(session, make_tokens(4))
    handle = session.generate_async(
        make_tokens(4), GenConfig(max_new_tokens=0), on_update=capture.on_update
    )
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.FAILED
    assert not capture.collect(WAIT_S)
    assert fake.clone_calls == [] and len(cache) == 0


def test_collect_happens_at_most_once(runner: Runner, fake: FakeExecutor) -> None:
    session = open_session(runner)
    cache = PrefixCache(2)
    prompt = make_tokens(4)
    capture = cache.capture_prompt(session, prompt)
    generate(session, prompt, max_new=2, on_update=capture.on_update)
    assert capture.collect(WAIT_S)
    assert not capture.collect(WAIT_S)
    assert len(cache) == 1


def test_capture_refuses_tokens_shorter_than_the_sessions_context(
    runner: Runner, fake: FakeExecutor
) -> None:
    session = open_session(runner)
    generate(session, make_tokens(4))
    with pytest.raises(InvalidArgumentError, match="whole context"):
        PrefixCache(2).capture_prompt(session, make_tokens(3))
