"""A deterministic stand-in for a model executor, and helpers for runner tests.

Owns: per-session token histories (what a real executor's KV cache would hold),
a record of every call, and knobs that make it misbehave on purpose.
Promises: the token it returns for a session is `token_base + p`, where p is the
position that token takes in the session (so tests can predict every token), and
with `logprobs` on, its logprob is -p / 100 (`fake_logprob`) and a prompt's output
carries prompt logprobs for its whole payload (None first), recomputed or not;
every method checks it runs on the engine thread (`engine_thread` is learnt at
`initialize`).
Never: sleeps, except `init_delay` and at the gate, which a test opens (and which
gives up after `GATE_TIMEOUT_S`, so a broken test fails instead of hanging).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cellbatch.generation_config import SamplingParams
from cellbatch.runner import Runner, Session
from cellbatch.types import (
    BatchInput,
    BatchOutput,
    GenerationUpdate,
    KVUsage,
    Output,
    SessionId,
    TokenLogprob,
)

GATE_TIMEOUT_S = 10.0
WAIT_S = 5.0  # what tests allow any single wait; nothing here should take close to it


@dataclass
class FakeExecutor:
    """Knobs are plain attributes; a test may change them between steps."""

    max_sessions: int = 64
    token_base: int = 1000
    decode_tokens: int = 1  # tokens per decode output (several: a speculative executor)
    prefill_tokens: int = 1  # tokens per output of a prompt's last chunk
    stop_after: int | None = None  # the N-th token after each prompt is `stop_token`
    stop_token: int = 2
    fail_from_step: int | None = None  # execute returns None from this step (1-based) on
    fail_steps: set[int] = field(default_factory=set)  # ... or at just these steps
    raise_steps: set[int] = field(default_factory=set)  # execute raises at these steps
    malformed_at_step: int | None = None  # with `malformation` below
    malformation: str = ""  # "wrong_sid", "empty", "extra", "missing", "logprobs"
    logprobs: bool = False  # outputs carry logprobs, a prompt's output prompt logprobs
    clone_supported: bool = True
    clone_raises: bool = False
    refuse_clone_of: set[SessionId] = field(default_factory=set)
    cell_limit: int | None = None  # kv_usage() reports limit - cells held free; None: no limit
    fail_initialize: bool = False
    init_delay: float = 0.0
    on_execute: Callable[[BatchInput], None] | None = None

    contexts: dict[SessionId, list[int]] = field(default_factory=dict)
    batches: list[BatchInput] = field(default_factory=list)
    events: list[tuple[Any, ...]] = field(default_factory=list)
    sampling: list[tuple[SessionId, SamplingParams, int | None]] = field(default_factory=list)
    adapters: list[tuple[SessionId, int]] = field(default_factory=list)  # set_adapter calls
    closed: list[SessionId] = field(default_factory=list)
    clone_calls: list[tuple[SessionId, int]] = field(default_factory=list)
    init_calls: int = 0
    steps: int = 0
    truncations: list[tuple[SessionId, int]] = field(default_factory=list)
    engine_thread: threading.Thread | None = None
    wrong_thread_calls: int = 0
    _next_sid: int = 0
    _since_prompt: dict[SessionId, int] = field(default_factory=dict)
    _gate: threading.Event = field(default_factory=threading.Event)
    _held: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._gate.set()

    # -- test controls -------------------------------------------------------------

    def hold(self) -> None:
        """The next execute blocks until `release()`."""
        self._held.clear()
        self._gate.clear()

    def wait_held(self, timeout: float = WAIT_S) -> bool:
        """True once an execute is blocked at the gate."""
        return self._held.wait(timeout)

    def release(self) -> None:
        self._gate.set()

    @property
    def open_count(self) -> int:
        return len(self.contexts)

    def used_cells(self) -> int:
        return sum(len(tokens) for tokens in self.contexts.values())

    def inputs_of(self, sid: SessionId) -> list[Any]:
        """Every input this session has had executed, in order."""
        return [inp for batch in self.batches for inp in batch.inputs if inp.sid == sid]

    # -- the Executor protocol -----------------------------------------------------

    def _check_thread(self) -> None:
        if threading.current_thread() is not self.engine_thread:
            self.wrong_thread_calls += 1

    def initialize(self) -> None:
        self.engine_thread = threading.current_thread()
        self.init_calls += 1
        self.events.append(("initialize",))
        time.sleep(self.init_delay)
        if self.fail_initialize:
            raise RuntimeError("fake initialisation failure")

    def open_session(self) -> SessionId | None:
        self._check_thread()
        if len(self.contexts) >= self.max_sessions:
            return None
        sid = self._new_sid()
        self.contexts[sid] = []
        self.events.append(("open", sid))
        return sid

    def close_session(self, sid: SessionId) -> None:
        self._check_thread()
        if self.contexts.pop(sid, None) is not None:
            self.closed.append(sid)
            self.events.append(("close", sid))

    def clone(self, source: SessionId, upto: int) -> SessionId | None:
        self._check_thread()
        self.clone_calls.append((source, upto))
        self.events.append(("clone", source, upto))
        if self.clone_raises:
            raise RuntimeError("fake clone failure")
        refused = not self.clone_supported or source in self.refuse_clone_of
        if refused or len(self.contexts) >= self.max_sessions:
            return None
        history = self.contexts[source]
        if not 0 <= upto <= len(history):
            return None
        sid = self._new_sid()
        self.contexts[sid] = history[:upto]
        return sid

    def set_sampling(self, sid: SessionId, params: SamplingParams, seed: int | None) -> None:
        self._check_thread()
        self.sampling.append((sid, params, seed))
        self.events.append(("sampling", sid, seed))

    def set_adapter(self, sid: SessionId, adapter: int) -> None:
        self._check_thread()
        self.adapters.append((sid, adapter))

    def truncate(self, sid: SessionId, length: int) -> None:
        self._check_thread()
        self.truncations.append((sid, length))
        self.events.append(("truncate", sid, length))
        del self.contexts[sid][length:]

    def kv_usage(self) -> KVUsage | None:
        if self.cell_limit is None:
            return None
        used = self.used_cells()
        return KVUsage(used, self.cell_limit - used, self.cell_limit)

    def execute(self, batch: BatchInput) -> BatchOutput:
        self._check_thread()
        self.steps += 1
        step = self.steps
        self.batches.append(batch)
        self.events.append(("execute", step, tuple(inp.sid for inp in batch.inputs)))
        if not self._gate.is_set():
            self._held.set()
            if not self._gate.wait(GATE_TIMEOUT_S):
                raise TimeoutError("the fake executor's gate was never released")
        if self.on_execute is not None:
            self.on_execute(batch)
        if step in self.raise_steps:
            raise RuntimeError(f"fake executor failure at step {step}")
        if step in self.fail_steps or (
            self.fail_from_step is not None and step >= self.fail_from_step
        ):
            raise RuntimeError(f"fake failure at step {step}")
        outputs = []
        for inp in batch.inputs:
            history = self.contexts.get(inp.sid)
            if history is None or inp.start > len(history):
                raise RuntimeError(f"input {inp} does not continue session {inp.sid}")
            del history[inp.start :]  # a lower start rewinds
            history.extend(inp.tokens)
            if self.cell_limit is not None and self.used_cells() > self.cell_limit:
                raise RuntimeError("out of cells")
            outputs.append(self._answer(inp, history) if inp.produce_output else None)
        if self.malformed_at_step == step:
            self._malform(batch, outputs)
        return BatchOutput(tuple(outputs))

    # -- internals -----------------------------------------------------------------

    def _new_sid(self) -> SessionId:
        self._next_sid += 1
        return self._next_sid

    def _answer(self, inp: Any, history: list[int]) -> Output:
        # A decode's payload is the single pending token; a prompt's is the whole turn.
        is_decode = len(inp.payload) == 1 and inp.offset == 0 and inp.position > 0
        if not is_decode or inp.sid not in self._since_prompt:
            self._since_prompt[inp.sid] = 0
        count = self.decode_tokens if is_decode else self.prefill_tokens
        tokens = []
        for i in range(count):
            self._since_prompt[inp.sid] += 1
            if self.stop_after is not None and self._since_prompt[inp.sid] == self.stop_after:
                tokens.append(self.stop_token)
            else:
                tokens.append(self.token_base + len(history))
            if i < count - 1:
                history.append(tokens[-1])  # the accepted run is fed; the last is a prediction
        if not self.logprobs:
            return Output(inp.sid, tuple(tokens))
        first = len(history) - len(tokens) + 1  # where the first returned token goes
        logprobs = tuple(fake_logprob(t, first + i) for i, t in enumerate(tokens))
        fed = list(inp.payload[: inp.offset + inp.size])
        prompt = () if is_decode else fake_prompt_logprobs(fed, inp.position)
        return Output(inp.sid, tuple(tokens), logprobs, prompt)

    def _malform(self, batch: BatchInput, outputs: list[Output | None]) -> None:
        wanted = [i for i, inp in enumerate(batch.inputs) if inp.produce_output]
        if self.malformation == "wrong_sid" and wanted:
            i = wanted[0]
            outputs[i] = Output(batch.inputs[i].sid + 1000, outputs[i].tokens)  # type: ignore[union-attr]
        elif self.malformation == "empty" and wanted:
            outputs[wanted[0]] = Output(batch.inputs[wanted[0]].sid, ())
        elif self.malformation == "missing" and wanted:
            outputs[wanted[0]] = None
        elif self.malformation == "logprobs" and wanted:
            i = wanted[0]
            outputs[i] = Output(batch.inputs[i].sid, outputs[i].tokens, (fake_logprob(7, 0),) * 2)  # type: ignore[union-attr]
        elif self.malformation == "extra":
            for i, inp in enumerate(batch.inputs):
                if not inp.produce_output:
                    outputs[i] = Output(inp.sid, (self.token_base,))
                    break


def fake_logprob(token: int, position: int) -> TokenLogprob:
    """The logprob FakeExecutor gives `token` at `position`."""
    return TokenLogprob(token, -position / 100, ((token, -position / 100),))


def fake_prompt_logprobs(tokens: list[int], position: int = 0) -> tuple[TokenLogprob | None, ...]:
    """FakeExecutor's prompt logprobs for `tokens` fed from `position` (None first)."""
    return (None, *(fake_logprob(t, position + i) for i, t in enumerate(tokens) if i))


def make_tokens(count: int, start: int = 10) -> list[int]:
    """A prompt of `count` distinct token ids."""
    return list(range(start, start + count))


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    """Poll `predicate` (collecting garbage in between) until it holds or time runs out."""
    deadline = time.monotonic() + timeout
    polls = 0
    while not predicate():
        if time.monotonic() > deadline:
            return False
        polls += 1
        if polls % 20 == 0:
            gc.collect()  # what is waited for may hang on a reference cycle
        time.sleep(0.001)
    return True


class Recorder:
    """Collects one generation's callbacks and the threads they ran on."""

    def __init__(self) -> None:
        self.updates: list[GenerationUpdate] = []
        self.settled_calls = 0
        self.settled = threading.Event()
        self.threads: set[str] = set()

    def on_update(self, update: GenerationUpdate) -> None:
        self.threads.add(threading.current_thread().name)
        self.updates.append(update)

    def on_settled(self, handle: Any) -> None:
        self.threads.add(threading.current_thread().name)
        self.settled_calls += 1
        self.settled.set()

    @property
    def finals(self) -> list[GenerationUpdate]:
        return [update for update in self.updates if update.finish_reason is not None]

    @property
    def tokens(self) -> list[int]:
        return [token for update in self.updates for token in update.tokens]


def open_session(runner: Runner) -> Session:
    """A session of `runner`, opened synchronously (the test fails if refused)."""
    session = runner.open_session_async().result(WAIT_S)
    assert session is not None
    return session


class FakeRunners:
    """The Runners a test starts over FakeExecutors (the `runners` fixture of
    tests/conftest.py): each on a decode-first scheduler of 64 cells, 8 sessions and 16
    tokens a step. `close` opens each fake's gate, shuts its runner down and checks that
    the fake was only called from the engine thread and was left no session open."""

    def __init__(self) -> None:
        self.made: list[tuple[Runner, FakeExecutor]] = []

    def make(self, fake: FakeExecutor | None = None, **options: Any) -> tuple[Runner, FakeExecutor]:
        from cellbatch.scheduler import DecodeFirstScheduler

        fake = fake if fake is not None else FakeExecutor()
        runner = Runner(fake, DecodeFirstScheduler.create(64, 8, 16), **options)
        self.made.append((runner, fake))
        return runner, fake

    def close(self) -> None:
        for runner, fake in self.made:
            fake.release()
            runner.shutdown()
            assert fake.wrong_thread_calls == 0
            assert fake.open_count == 0
