"""Runner v2 under concurrent, randomized use on a real (tiny) model.

Several client threads open sessions, run multi-turn greedy generations, clone,
cancel, close and raise from callbacks, over a KV pool small enough to force
preemption; without speculation, with prompt lookup and with a draft model.
Afterwards: every handle settled exactly once, every session's context holds exactly
what was delivered, every uncancelled greedy turn equals the same context run alone,
and no KV cell is left in use.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from cellbatch.engine import Engine, EngineShape, ModuleBackend
from cellbatch.generation_config import GenConfig
from cellbatch.model.loading import load_model
from cellbatch.runner import GenerationHandle, Session
from cellbatch.speculative import SpeculativeConfig
from cellbatch.types import FinishReason, GenerationUpdate
from fake_executor import wait_until
from tiny_models import make_tiny_checkpoint

VOCAB = 96
WAIT_S = 60.0
THREADS = 4
OPERATIONS = 14
# kind < 0.1: on_update raises; 0.1 <= kind < MID_CANCEL: cancelled after its first
# token, always mid-generation; MID_CANCEL <= kind < 0.25: cancelled at a random moment.
MID_CANCEL = 0.18
NO_EOS = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": None}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    folder = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama", **NO_EOS)[1]
    return load_model(folder, "float32")


@pytest.fixture(params=["plain", "ngram", "draft_model"])
def engine(request: pytest.FixtureRequest, llama) -> Iterator[Engine]:
    """The engine without speculation, with prompt lookup, and with the model drafting
    for itself (its own cells beside the target's, following every clone and rewind)."""
    torch.set_num_threads(1)  # tests/conftest.py puts the count back after the test
    config, module = llama
    backend = ModuleBackend(module, config)
    # Room for about four sessions' contexts: the clients' load preempts.
    shape = EngineShape(max_sessions=16, max_cells=400, max_batch_tokens=64)
    speculative = None
    if request.param == "ngram":
        speculative = SpeculativeConfig("ngram", prompt_lookup_min=1)
    elif request.param == "draft_model":
        speculative = SpeculativeConfig("draft_model", model="tiny")
    draft = backend if request.param == "draft_model" else None
    made = Engine(backend, None, shape=shape, speculative=speculative, draft=draft)
    yield made
    made.close()


@dataclass
class Turn:
    context: list[int]  # the session's context before the turn, delta included
    tokens: list[int]  # delivered
    reason: FinishReason | None
    max_new: int


@dataclass
class Client:
    rng: random.Random
    engine: Engine
    turns: list[Turn] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    settle_counts: dict[int, int] = field(default_factory=dict)

    def run(self) -> None:
        sessions: list[tuple[Session, list[int]]] = []  # each with its context
        for _ in range(OPERATIONS):
            op = self.rng.random()
            if not sessions or op < 0.15:
                sessions.append((self.engine.open_session(), []))
            elif op < 0.25:
                source, context = self.rng.choice(sessions)
                upto = source.position()
                clone = source.clone_async(upto).result(WAIT_S)
                if clone is not None:
                    sessions.append((clone, context[:upto]))
            elif op < 0.32:
                session, _ = sessions.pop(self.rng.randrange(len(sessions)))
                session.close()
            else:
                index = self.rng.randrange(len(sessions))
                session, context = sessions[index]
                if len(context) > 256 - 64:  # the tiny model's context would overflow
                    session.close()
                    sessions[index] = (self.engine.open_session(), [])
                else:
                    sessions[index] = (session, self.turn(session, context))
        for session, _ in sessions:
            session.close()

    def turn(self, session: Session, context: list[int]) -> list[int]:
        delta = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 40))]
        kind = self.rng.random()
        # A turn that raises or is cancelled mid-generation needs tokens after its first.
        max_new = self.rng.randint(3 if kind < MID_CANCEL else 1, 24)
        delivered: list[int] = []
        count_key = len(self.settle_counts)
        self.settle_counts[count_key] = 0

        first_token, cancel_posted = threading.Event(), threading.Event()

        def on_update(update: GenerationUpdate) -> None:
            delivered.extend(update.tokens)
            if kind < 0.1 and len(delivered) >= 2 and update.finish_reason is None:
                raise RuntimeError("a client callback failed")
            if 0.1 <= kind < MID_CANCEL and delivered and update.finish_reason is None:
                # Hold the engine until the client's cancel is posted: it lands
                # mid-generation on any machine, however fast.
                first_token.set()
                cancel_posted.wait(WAIT_S)

        def on_settled(handle: GenerationHandle) -> None:
            self.settle_counts[count_key] += 1

        handle = session.generate_async(
            delta, GenConfig(max_new_tokens=max_new), on_update, on_settled
        )
        if 0.1 <= kind < MID_CANCEL:
            if not first_token.wait(WAIT_S):
                self.problems.append("a turn to cancel mid-generation never delivered a token")
            handle.cancel()
            cancel_posted.set()
        elif MID_CANCEL <= kind < 0.25:  # a cancel at a random moment, maybe after the end
            threading.Event().wait(self.rng.random() * 0.02)
            handle.cancel()
        if not handle.wait(WAIT_S):
            self.problems.append("a handle never settled")
            return context
        reason = handle.finish_reason()
        if handle.tokens() != delivered:
            self.problems.append("the handle's tokens differ from what on_update delivered")
        new_context = [*context, *delta]
        if reason == FinishReason.FAILED and "on_update raised" not in handle.error():
            self.problems.append(f"unexpected failure: {handle.error()}")
        self.turns.append(Turn(new_context, list(delivered), reason, max_new))
        context = [*new_context, *delivered]
        held = session.position() + len(session.unfed())
        if held != len(context):
            self.problems.append(
                f"session holds {held} tokens, the client delivered {len(context)}"
            )
        return context


def test_concurrent_clients_with_cancels_clones_closes_and_raising_callbacks(engine) -> None:
    clients = [Client(random.Random(seed), engine) for seed in range(THREADS)]
    threads = [threading.Thread(target=client.run) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
        assert not thread.is_alive(), "a client deadlocked"
    for client in clients:
        assert client.problems == []
        assert all(count == 1 for count in client.settle_counts.values())
    metrics = engine.metrics()
    assert metrics.preemptions + metrics.sessions_reclaimed > 0, "the pool was never short"
    assert wait_until(lambda: engine.kv_usage().cells_in_use == 0)
    reasons = {turn.reason for client in clients for turn in client.turns}
    assert {FinishReason.CANCELLED, FinishReason.FAILED, FinishReason.TOKEN_LIMIT} <= reasons

    # Every turn that ran to its budget equals its context run alone.
    complete = [
        turn
        for client in clients
        for turn in client.turns
        if turn.reason == FinishReason.TOKEN_LIMIT
    ]
    assert len(complete) >= 10
    alone = engine.generate(
        [turn.context for turn in complete], GenConfig(max_new_tokens=24), share_prefix=False
    )
    for turn, result in zip(complete, alone, strict=True):
        assert result.tokens[: turn.max_new] == turn.tokens
    # Cancelled or failed turns delivered a prefix of what they would have produced.
    for client in clients:
        for turn in client.turns:
            if turn.reason in (FinishReason.CANCELLED, FinishReason.FAILED) and turn.tokens:
                (result,) = engine.generate(
                    [turn.context], GenConfig(max_new_tokens=len(turn.tokens))
                )
                assert result.tokens == turn.tokens
