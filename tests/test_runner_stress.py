"""Stress: 8 client threads, 400 generations, random cancels, closes and clones, and a
shutdown in the middle. Every handle must settle exactly once with a reason, no
session may leak, nothing may deadlock, and every session's context must equal
what it held before + the delta + the delivered tokens."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import pytest

from cellbatch import GenConfig, GenerationHandle, Runner, Session
from cellbatch.scheduler import DecodeFirstScheduler
from cellbatch.types import FinishReason, GenerationUpdate
from fake_executor import FakeExecutor, wait_until

CLIENTS = 8
PER_CLIENT = 50  # 400 generations in all
SHUTDOWN_AFTER = 200  # settled generations before the main thread shuts the runner down
STOP_TOKEN = 2
TIME_LIMIT_S = 60.0
WAIT_S = 10.0


@dataclass
class Tally:
    """One generation's callbacks (called only on the engine thread)."""

    updates: list[GenerationUpdate] = field(default_factory=list)
    settled_calls: int = 0
    settled: threading.Event = field(default_factory=threading.Event)

    def on_update(self, update: GenerationUpdate) -> None:
        self.updates.append(update)

    def on_settled(self, handle: GenerationHandle) -> None:
        self.settled_calls += 1
        self.settled.set()


@dataclass
class Shared:
    runner: Runner
    fake: FakeExecutor
    cloning: bool
    lock: threading.Lock = field(default_factory=threading.Lock)
    settled: int = 0
    handles: list[GenerationHandle] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)


def whole_context(fake: FakeExecutor, session: Session) -> list[int] | None:
    """Committed + pending tokens, or None once the session is gone from the executor."""
    committed = fake.contexts.get(session.id)  # type: ignore[arg-type]
    if committed is None or not session.is_open():
        return None
    return committed[: session.position()] + list(session.unfed())


def client(index: int, shared: Shared) -> None:
    rng = random.Random(index)
    runner, fake = shared.runner, shared.fake
    session: Session = Session()
    expected: list[int] = []  # the session's whole context, as this client knows it
    for turn in range(PER_CLIENT):
        if not session.is_open() or len(expected) > 150:
            session.close()
            session = runner.open_session_async().result(WAIT_S) or session
            expected = []
        delta = [rng.randrange(10, 900) for _ in range(rng.randint(1, 40))]
        stops = frozenset({STOP_TOKEN}) if rng.random() < 0.3 else frozenset()
        config = GenConfig(max_new_tokens=rng.randint(1, 24), stop_tokens=stops, seed=turn)
        tally = Tally()
        before = list(expected)
        handle = session.generate_async(delta, config, tally.on_update, tally.on_settled)
        action = rng.random()
        if action < 0.15:
            time.sleep(rng.random() * 0.001)
            handle.cancel()
        elif action < 0.22:
            time.sleep(rng.random() * 0.001)
            session.close()
        if not (handle.wait(WAIT_S) and tally.settled.wait(WAIT_S)):
            shared.errors.append(f"client {index} turn {turn}: the generation never settled")
            return
        problem = check_generation(handle, tally)
        reason = handle.finish_reason()
        delivered = handle.tokens()
        actual = whole_context(fake, session)
        if actual is not None and not problem:
            if actual == before + delta + delivered:
                expected = actual
            elif reason in (FinishReason.CANCELLED, FinishReason.FAILED) and not delivered:
                if actual != before:  # ended before it started: nothing may change
                    problem = f"context changed by a generation that never started: {reason}"
            else:
                problem = f"context {actual} != before + delta + delivered ({reason})"
        if reason == FinishReason.FAILED and "not enough KV cells" in handle.error():
            session.close()  # give the cells back; a later turn opens a fresh session
        if shared.cloning and session.is_open() and rng.random() < 0.2:
            upto = rng.randint(0, session.position())
            clone, clone_problem = take_clone(shared, session, upto, expected)
            problem = problem or clone_problem
            fate = rng.random()
            if clone is not None and fate < 0.4:  # carry on in the branch
                session.close()
                session, expected = clone, expected[:upto]
            elif clone is not None and fate < 0.7:
                clone.close()
            # Otherwise the clone is simply dropped: garbage collection must close it.
        with shared.lock:
            shared.handles.append(handle)
            shared.settled += 1
            shared.reasons[str(reason)] = shared.reasons.get(str(reason), 0) + 1
            if problem:
                shared.errors.append(f"client {index} turn {turn}: {problem}")
    session.close()


def check_generation(handle: GenerationHandle, tally: Tally) -> str:
    finals = [u for u in tally.updates if u.finish_reason is not None]
    if tally.settled_calls != 1 or len(finals) > 1:
        return f"settled {tally.settled_calls} times with {len(finals)} final updates"
    if handle.finish_reason() is None:
        return "settled without a reason"
    if finals and finals[0] is not tally.updates[-1]:
        return "an update came after the final one"
    if [t for u in tally.updates for t in u.tokens] != handle.tokens():
        return "the handle's tokens differ from the delivered ones"
    if (
        handle.finish_reason() == FinishReason.FAILED
        and "not enough KV cells" not in handle.error()
    ):
        return f"unexpected failure: {handle.error()}"
    return ""


def take_clone(
    shared: Shared, session: Session, upto: int, expected: list[int]
) -> tuple[Session | None, str]:
    clone = session.clone_async(upto).result(WAIT_S)
    if clone is None:
        return None, "" if shared.runner.stopping() else f"clone at {upto} refused"
    copied = whole_context(shared.fake, clone)
    if copied is not None and copied != expected[:upto]:
        return clone, f"clone at {upto} holds {copied}, expected {expected[:upto]}"
    return clone, ""


@pytest.mark.parametrize("cell_limit", [None, 700], ids=["unlimited", "cell-limited"])
def test_many_clients_with_cancels_closes_clones_and_a_shutdown(cell_limit: int | None) -> None:
    fake = FakeExecutor(
        decode_tokens=2,  # speculative: accepted runs and rewinds on every turn
        stop_after=7,
        stop_token=STOP_TOKEN,
        max_sessions=4 * CLIENTS,
        cell_limit=cell_limit,
        on_execute=lambda batch: time.sleep(0.0002),  # steps take time, as real ones do
    )
    # A speculative executor writes more cells than the runner can count ahead, so the
    # cell-limited run reserves worst cases (optimistic admission is stressed elsewhere).
    runner = Runner(fake, DecodeFirstScheduler.create(128, 16, 32), admission="reserve")
    # The fake copies a clone's cells instead of sharing them, which would break
    # the cell budget, so clones run only without a cell limit.
    shared = Shared(runner, fake, cloning=cell_limit is None)
    threads = [threading.Thread(target=client, args=(i, shared)) for i in range(CLIENTS)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        assert wait_until(lambda: shared.settled >= SHUTDOWN_AFTER, TIME_LIMIT_S)
        runner.shutdown()
        for thread in threads:
            thread.join(max(0.0, TIME_LIMIT_S - (time.monotonic() - began)))
        assert not any(thread.is_alive() for thread in threads), "a client deadlocked"
    finally:
        runner.shutdown()
    if cell_limit is not None:
        assert runner.metrics().deferred_for_cells > 0
    assert shared.errors == []
    assert len(shared.handles) == CLIENTS * PER_CLIENT
    assert all(handle.done() for handle in shared.handles)
    assert shared.reasons.get("token_limit", 0) > 0 and shared.reasons.get("cancelled", 0) > 0
    assert shared.reasons.get("stop_token", 0) > 0
    assert wait_until(lambda: fake.open_count == 0)
    assert fake.wrong_thread_calls == 0
    assert runner.metrics().failed_steps == 0
