"""GenerationMetrics and EngineMetrics: counters, derived figures, reports; the
MetricsLedger that adds the runner's events up."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from cellbatch.metrics import EngineMetrics, GenerationMetrics
from cellbatch.runner.metrics_ledger import (
    Admitted,
    DeferredForCells,
    GenerationFinished,
    GenerationStarted,
    Initialized,
    MetricsLedger,
    Preempted,
    PrefillTurnStarted,
    PrefixCacheHit,
    PromptFed,
    SessionOpened,
    SessionReclaimed,
    SessionRefused,
    StepDone,
    StepFailed,
)
from cellbatch.types import FinishReason


def test_token_timing_gives_inter_token_latencies() -> None:
    metrics = GenerationMetrics(submit_time=1.0)
    metrics.first_step_time = 1.5
    metrics.record_tokens(1, 2.0)
    assert (metrics.itl_count, metrics.itl_min, metrics.itl_max) == (0, 0.0, 0.0)
    metrics.record_tokens(1, 2.25)
    metrics.record_tokens(3, 2.75)  # a speculative burst: 0.5 s, then two at 0 s
    metrics.end_time = 3.0
    assert metrics.generated_tokens == 5
    assert metrics.itl_count == 4
    assert metrics.itl_sum == pytest.approx(0.75)
    assert (metrics.itl_min, metrics.itl_max) == (0.0, 0.5)
    assert metrics.ttft == pytest.approx(1.0)
    assert metrics.queue_wait == pytest.approx(0.5)
    assert metrics.prefill_span == pytest.approx(0.5)
    assert metrics.decode_span == pytest.approx(0.75)
    assert metrics.e2e == pytest.approx(2.0)
    assert metrics.decode_tokens_per_s == pytest.approx(4 / 0.75)
    assert metrics.itl_mean == pytest.approx(0.75 / 4)


def test_the_first_itl_is_its_own_minimum() -> None:
    metrics = GenerationMetrics()
    metrics.record_tokens(1, 1.0)
    metrics.record_tokens(1, 1.3)
    metrics.record_tokens(1, 1.4)
    assert metrics.itl_min == pytest.approx(0.1)
    assert metrics.itl_max == pytest.approx(0.3)


def test_missing_times_give_none_not_errors() -> None:
    metrics = GenerationMetrics(submit_time=1.0)
    assert metrics.ttft is None and metrics.e2e is None and metrics.decode_span is None
    assert metrics.itl_mean is None
    assert metrics.decode_tokens_per_s == 0.0
    assert "n/a" in metrics.report()
    json.dumps(metrics.as_dict())


def test_step_buckets_partition_the_step_time() -> None:
    metrics = EngineMetrics()
    metrics.record_step(
        0.0, 0.1, decode_sessions=4, prefill_sessions=0, prefill_tokens=0, context=40
    )
    metrics.record_step(
        0.1, 0.3, decode_sessions=2, prefill_sessions=1, prefill_tokens=16, context=70
    )
    metrics.record_step(
        0.3, 0.6, decode_sessions=0, prefill_sessions=2, prefill_tokens=32, context=32
    )
    assert (metrics.decode_only_steps, metrics.mixed_steps, metrics.prefill_only_steps) == (1, 1, 1)
    assert metrics.decode_only_time == pytest.approx(0.1)
    assert metrics.mixed_time == pytest.approx(0.2)
    assert metrics.prefill_only_time == pytest.approx(0.3)
    total = metrics.decode_only_time + metrics.mixed_time + metrics.prefill_only_time
    assert total == pytest.approx(metrics.step_time_sum)
    assert metrics.step_time_max == pytest.approx(0.3)
    assert (metrics.decode_tokens, metrics.prefill_tokens, metrics.prefill_sessions) == (6, 48, 3)
    assert (metrics.context_sum, metrics.context_max) == (142, 70)
    assert metrics.mean_tokens_per_step == pytest.approx(54 / 3)
    assert metrics.decode_only_tokens_per_s == pytest.approx(4 / 0.1)


def test_wall_time_spans_every_step_and_failed_steps_credit_nothing() -> None:
    metrics = EngineMetrics(init_time=5.0)
    metrics.record_step(
        10.0, 10.5, decode_sessions=8, prefill_sessions=0, prefill_tokens=0, context=80
    )
    metrics.record_failed_step(11.0, 11.5)
    metrics.generated_tokens = 8
    assert (metrics.steps, metrics.failed_steps) == (1, 1)
    assert metrics.decode_tokens == 8
    assert metrics.wall_time == pytest.approx(1.5)  # init time stays out
    assert metrics.idle_fraction == pytest.approx(1 - 0.5 / 1.5)
    assert metrics.generated_tokens_per_s == pytest.approx(8 / 1.5)


def test_ttft_and_finish_counters() -> None:
    metrics = EngineMetrics()
    for ttft in (0.3, 0.1, 0.2):
        metrics.record_ttft(ttft)
    metrics.record_finish(FinishReason.TOKEN_LIMIT)
    metrics.record_finish(FinishReason.CANCELLED)
    metrics.record_finish(FinishReason.TOKEN_LIMIT)
    assert (metrics.ttft_count, metrics.ttft_min, metrics.ttft_max) == (3, 0.1, 0.3)
    assert metrics.ttft_mean == pytest.approx(0.2)
    assert metrics.generations_completed == 3
    assert metrics.finished["token_limit"] == 2 and metrics.finished["cancelled"] == 1


def test_empty_engine_metrics_derive_without_dividing_by_zero() -> None:
    metrics = EngineMetrics()
    assert metrics.wall_time == 0.0 and metrics.idle_fraction == 0.0
    assert metrics.generated_tokens_per_s == 0.0 and metrics.mean_tokens_per_step == 0.0
    assert metrics.mean_step_time is None and metrics.ttft_mean is None
    assert "0 ok" in metrics.report()


def test_copy_is_independent_and_reports_are_readable() -> None:
    metrics = EngineMetrics()
    metrics.record_finish(FinishReason.STOP_TOKEN)
    snapshot = metrics.copy()
    metrics.record_finish(FinishReason.STOP_TOKEN)
    assert snapshot.finished["stop_token"] == 1
    report = metrics.report()
    assert "stop_token 2" in report and "throughput" in report
    encoded = json.loads(json.dumps(metrics.as_dict()))
    assert encoded["finished"]["stop_token"] == 2
    assert "idle_fraction" in encoded and "wall_time" in encoded


def test_the_ledger_adds_each_event_to_its_counters() -> None:
    ledger = MetricsLedger()
    events = [
        Initialized(2.5),
        SessionOpened(),
        SessionOpened(),
        SessionRefused(),
        GenerationStarted(),
        GenerationStarted(),
        PrefillTurnStarted(),
        PromptFed(10),
        PromptFed(6),
        Admitted(running=1, recomputed=0),
        Admitted(running=2, recomputed=7),
        Admitted(running=1, recomputed=3),
        PrefixCacheHit(4),
        DeferredForCells(),
        Preempted(),
        SessionReclaimed(),
        SessionReclaimed(),
        StepDone(1.0, 1.5, 2, 1, 16, 40, generated_tokens=3),
        StepFailed(2.0, 2.25),
        GenerationFinished(FinishReason.TOKEN_LIMIT, 0.5),
        GenerationFinished(FinishReason.CANCELLED, None),
    ]
    for event in events:
        ledger.record(event)
    m = ledger.snapshot()
    assert (m.init_time, m.sessions_opened, m.sessions_refused) == (2.5, 2, 1)
    assert (m.generations_started, m.prefill_turns, m.prompt_tokens) == (2, 1, 16)
    assert (m.peak_concurrent_generations, m.recomputed_tokens) == (2, 10)
    assert (m.prefix_cache_hits, m.prefix_cache_tokens) == (1, 4)
    assert (m.deferred_for_cells, m.preemptions, m.sessions_reclaimed) == (1, 1, 2)
    assert (m.steps, m.failed_steps, m.generated_tokens) == (1, 1, 3)
    assert (m.decode_tokens, m.prefill_tokens, m.mixed_steps, m.context_max) == (2, 16, 1, 40)
    assert m.wall_time == pytest.approx(1.25)
    assert m.generations_completed == 2 and m.ttft_count == 1
    assert m.finished["token_limit"] == 1 and m.finished["cancelled"] == 1
    # The same figures as the EngineMetrics methods the events stand for.
    direct = EngineMetrics()
    direct.record_step(1.0, 1.5, 2, 1, 16, 40)
    direct.record_failed_step(2.0, 2.25)
    assert (m.step_time_sum, m.mixed_time, m.last_step_end) == (
        direct.step_time_sum,
        direct.mixed_time,
        direct.last_step_end,
    )


def test_ledger_snapshots_are_copies_and_events_are_frozen() -> None:
    ledger = MetricsLedger()
    ledger.record(GenerationFinished(FinishReason.STOP_TOKEN, 0.1))
    first = ledger.snapshot()
    first.finished["stop_token"] = 99
    first.steps = 99
    ledger.record(GenerationFinished(FinishReason.STOP_TOKEN, 0.2))
    second = ledger.snapshot()
    assert second.finished["stop_token"] == 2 and second.steps == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        PromptFed(3).tokens = 4  # type: ignore[misc]
    with pytest.raises(TypeError, match="not a metrics event"):
        ledger.record(object())  # type: ignore[arg-type]


def test_the_ledger_loses_no_event_recorded_from_several_threads() -> None:
    ledger = MetricsLedger()

    def record() -> None:
        for _ in range(2000):
            ledger.record(StepDone(0.0, 0.001, 1, 0, 0, 1, generated_tokens=1))
            ledger.record(SessionRefused())

    threads = [threading.Thread(target=record) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    m = ledger.snapshot()
    assert (m.steps, m.generated_tokens, m.sessions_refused) == (8000, 8000, 8000)
