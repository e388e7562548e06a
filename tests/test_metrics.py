"""GenerationMetrics and EngineMetrics: counters, derived figures, reports."""

from __future__ import annotations

import json

import pytest

from cellbatch.metrics import EngineMetrics, GenerationMetrics
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
