"""The server's Prometheus metrics.

Owns: one `CollectorRegistry` per server with the request counters and latency
histograms the server observes, and the collector of the engine's own figures
(tokens, preemptions, KV cells, prefix-cache hits, speculative decoding's drafts and
acceptance) read at scrape time: one engine's, or several replicas' summed and each
labelled `replica`; and of its LoRA adapters (how many are loaded; generations, prompt
and generated tokens per adapter, labelled `adapter`).
Promises: `/metrics` output parses with `prometheus_client`'s parser; the engine
figures are read once per scrape, never kept twice.
Never: observes anything on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cellbatch.engine import Engine

if TYPE_CHECKING:
    from cellbatch.model.adapters import AdapterUsage

# (LoRA adapters loaded now, each adapter name's figures since the engine started)
AdapterFigures = tuple[int, Mapping[str, "AdapterUsage"]]

# Seconds: from a decode step's few ms to a long queue's tens of seconds.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class ServerMetrics:
    def __init__(self) -> None:
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

    def watch(self, engine: Collector, requests_load: Callable[[], tuple[int, int]]) -> None:
        """Report the engine's figures as `engine` collects them, and the requests
        running and waiting as `requests_load()` tells them, at every scrape."""
        self.registry.register(engine)
        self.registry.register(_RequestsCollector(requests_load))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _RequestsCollector(Collector):
    def __init__(self, requests_load: Callable[[], tuple[int, int]]) -> None:
        self._requests_load = requests_load

    def collect(self) -> Iterator[Metric]:
        running, waiting = self._requests_load()
        yield GaugeMetricFamily(
            "cellbatch_requests_running", "Requests generating tokens.", value=running
        )
        yield GaugeMetricFamily(
            "cellbatch_requests_waiting", "Requests waiting for their first token.", value=waiting
        )


# The engine's own figures: name -> (is a counter, help).
ENGINE_FIGURES = {
    "cellbatch_prompt_tokens": (True, "Prompt tokens fed to the model."),
    "cellbatch_generation_tokens": (True, "Tokens generated."),
    "cellbatch_preemptions": (True, "Running generations preempted for KV cells."),
    "cellbatch_recomputed_tokens": (
        True,
        "Context tokens fed again after their cells were dropped.",
    ),
    "cellbatch_prefix_cache_hits": (True, "Requests that started from the prefix cache."),
    "cellbatch_prefix_cache_tokens": (True, "Prompt tokens served from the prefix cache."),
    "cellbatch_kv_cells_in_use": (False, "KV cells holding context."),
    "cellbatch_kv_cells_capacity": (False, "KV cells the pool may hold."),
}


# Speculative decoding, vLLM's spec_decode counters (each labelled `method`; the
# acceptance rate is accepted / draft tokens, per position too).
SPEC_FIGURES = {
    "cellbatch_spec_decode_num_drafts": "Verifications of drafted tokens.",
    "cellbatch_spec_decode_num_draft_tokens": "Drafted tokens verified.",
    "cellbatch_spec_decode_num_accepted_tokens": "Drafted tokens accepted.",
}
PER_POSITION = "cellbatch_spec_decode_num_accepted_tokens_per_pos"


def engine_figures(engine: Engine) -> dict[str, float]:
    """The ENGINE_FIGURES of one engine, now, and its SPEC_FIGURES (accepted tokens
    per position under PER_POSITION + "_" + the position)."""
    metrics = engine.metrics()
    kv = engine.kv_usage()
    spec: dict[str, float] = {
        "cellbatch_spec_decode_num_drafts": metrics.spec_drafts,
        "cellbatch_spec_decode_num_draft_tokens": metrics.spec_draft_tokens,
        "cellbatch_spec_decode_num_accepted_tokens": metrics.spec_accepted_tokens,
        **{
            f"{PER_POSITION}_{position}": count
            for position, count in enumerate(metrics.spec_accepted_per_position)
        },
    }
    return spec | {
        "cellbatch_prompt_tokens": metrics.prompt_tokens,
        "cellbatch_generation_tokens": metrics.generated_tokens,
        "cellbatch_preemptions": metrics.preemptions,
        "cellbatch_recomputed_tokens": metrics.recomputed_tokens,
        "cellbatch_prefix_cache_hits": metrics.prefix_cache_hits,
        "cellbatch_prefix_cache_tokens": metrics.prefix_cache_tokens,
        "cellbatch_kv_cells_in_use": kv.cells_in_use,
        "cellbatch_kv_cells_capacity": kv.max_cells,
    }


class EngineFiguresCollector(Collector):
    """ENGINE_FIGURES at scrape time from `read()`, which gives each engine's figures
    by replica name ("" for the one engine of a plain server). Each figure is the sum
    over the engines; with named replicas, `cellbatch_replica_*` families also give
    each one's own, labelled `replica` (a separate name, so that summing a family never
    counts an engine twice). With `speculative` (the engines' method), the SPEC_FIGURES
    too, summed and labelled `method`, the accepted tokens per position labelled
    `position`, and the acceptance rate (accepted / drafted) as a gauge."""

    def __init__(
        self,
        read: Callable[[], Mapping[str, Mapping[str, float]]],
        speculative: str | None = None,
        adapters: Callable[[], AdapterFigures] | None = None,
    ) -> None:
        self._read = read
        self._method = speculative
        self._adapters = adapters

    def collect(self) -> Iterator[Metric]:
        if self._adapters is not None:
            yield from adapter_families(*self._adapters())
        engines = self._read()
        if self._method is not None:
            yield from _speculation(engines.values(), self._method)
        named = {name: figures for name, figures in engines.items() if name}
        for name, (counter, documentation) in ENGINE_FIGURES.items():
            family = CounterMetricFamily if counter else GaugeMetricFamily
            total = sum(figures[name] for figures in engines.values())
            yield family(name, documentation, value=total)
            if named:
                each = family(
                    name.replace("cellbatch_", "cellbatch_replica_", 1),
                    f"{documentation} One replica's.",
                    labels=["replica"],
                )
                for replica, figures in named.items():
                    each.add_metric([replica], figures[name])
                yield each


def _speculation(engines: Iterable[Mapping[str, float]], method: str) -> Iterator[Metric]:
    totals: dict[str, float] = {}
    for figures in engines:
        for name, value in figures.items():
            if name in SPEC_FIGURES or name.startswith(PER_POSITION):
                totals[name] = totals.get(name, 0.0) + value
    for name, documentation in SPEC_FIGURES.items():
        family = CounterMetricFamily(name, documentation, labels=["method"])
        family.add_metric([method], totals.get(name, 0.0))
        yield family
    per_position = CounterMetricFamily(
        PER_POSITION,
        "Drafted tokens accepted, by their place in the draft (from 0).",
        labels=["method", "position"],
    )
    positions = {
        int(name.rsplit("_", 1)[1]): value
        for name, value in totals.items()
        if name.startswith(PER_POSITION)
    }
    for position in sorted(positions):
        per_position.add_metric([method, str(position)], positions[position])
    yield per_position
    drafted = totals.get("cellbatch_spec_decode_num_draft_tokens", 0.0)
    accepted = totals.get("cellbatch_spec_decode_num_accepted_tokens", 0.0)
    rate = GaugeMetricFamily(
        "cellbatch_spec_decode_acceptance_rate",
        "Drafted tokens accepted, of those verified (0 before any).",
        labels=["method"],
    )
    rate.add_metric([method], accepted / drafted if drafted else 0.0)
    yield rate


def adapter_families(loaded: int, usage: Mapping[str, AdapterUsage]) -> Iterator[Metric]:
    """The LoRA adapters' figures: how many are loaded, and per adapter name (labelled
    `adapter`) its generations and their prompt and generated tokens."""
    yield GaugeMetricFamily(
        "cellbatch_lora_adapters_loaded", "LoRA adapters served now.", value=loaded
    )
    figures = {
        "cellbatch_lora_generations": ("Generations run with the adapter.", "generations"),
        "cellbatch_lora_prompt_tokens": ("Prompt tokens its generations fed.", "prompt_tokens"),
        "cellbatch_lora_generation_tokens": ("Tokens it generated.", "generated_tokens"),
    }
    for name, (documentation, field) in figures.items():
        family = CounterMetricFamily(name, documentation, labels=["adapter"])
        for adapter, figures_of in usage.items():
            family.add_metric([adapter], getattr(figures_of, field))
        yield family
