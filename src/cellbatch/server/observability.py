"""The server's Prometheus metrics.

Owns: one `CollectorRegistry` per server with the request counters and latency
histograms the server observes, and a collector that reads the engine's own
counters (tokens, preemptions, KV cells, prefix-cache hits) at scrape time.
Promises: `/metrics` output parses with `prometheus_client`'s parser; the engine
figures are read once per scrape, never kept twice.
Never: observes anything on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cellbatch.engine import Engine

# Seconds: from a decode step's few ms to a long queue's tens of seconds.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class ServerMetrics:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "cellbatch_requests",
            "Finished requests by endpoint and finish reason.",
            ["endpoint", "finish_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "cellbatch_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "cellbatch_inter_token_latency_seconds",
            "Between two streamed updates of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "cellbatch_e2e_request_latency_seconds",
            "From a request's arrival to its end.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def watch(self, requests_load: Callable[[], tuple[int, int]]) -> None:
        """Report the engine's figures, and the requests running and waiting as
        `requests_load()` tells them, at every scrape."""
        self.registry.register(_EngineCollector(self._engine, requests_load))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, requests_load: Callable[[], tuple[int, int]]) -> None:
        self._engine = engine
        self._requests_load = requests_load

    def collect(self) -> Iterator[Metric]:
        metrics = self._engine.metrics()
        kv = self._engine.kv_usage()
        running, waiting = self._requests_load()
        yield GaugeMetricFamily(
            "cellbatch_requests_running", "Requests generating tokens.", value=running
        )
        yield GaugeMetricFamily(
            "cellbatch_requests_waiting", "Requests waiting for their first token.", value=waiting
        )
        counters = {
            "cellbatch_prompt_tokens": ("Prompt tokens fed to the model.", metrics.prompt_tokens),
            "cellbatch_generation_tokens": ("Tokens generated.", metrics.generated_tokens),
            "cellbatch_preemptions": (
                "Running generations preempted for KV cells.",
                metrics.preemptions,
            ),
            "cellbatch_recomputed_tokens": (
                "Context tokens fed again after their cells were dropped.",
                metrics.recomputed_tokens,
            ),
            "cellbatch_prefix_cache_hits": (
                "Requests that started from the prefix cache.",
                metrics.prefix_cache_hits,
            ),
            "cellbatch_prefix_cache_tokens": (
                "Prompt tokens served from the prefix cache.",
                metrics.prefix_cache_tokens,
            ),
        }
        for name, (documentation, value) in counters.items():
            yield CounterMetricFamily(name, documentation, value=value)
        yield GaugeMetricFamily(
            "cellbatch_kv_cells_in_use", "KV cells holding context.", value=kv["cells_in_use"]
        )
        yield GaugeMetricFamily(
            "cellbatch_kv_cells_capacity", "KV cells the pool may hold.", value=kv["max_cells"]
        )
