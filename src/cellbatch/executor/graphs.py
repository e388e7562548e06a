"""Captured forwards, one per static shape, replayed step after step
(docs/design.md#the-cuda-executor).

Owns: `StepGraphs`, the bookkeeping of a CUDA executor's graphs (one per key, say a decode
width and its key bucket: captured on first use, replayed after, all dropped at once
when what they captured moves, as the KV pool does when it grows), its counters
(`GraphStats`), and the two ways to capture (`GraphCapture`): `CudaGraphCapture`
(torch.cuda.CUDAGraph, every graph in one memory pool) and `RecordedCapture`, the CPU
stand-in, which records a forward's operations once (torch.fx's make_fx over the real
tensors) and replays that record, so the Python that chose them does not run again, as
on a GPU.
Promises: a captured forward reads only tensors that outlive it (the executor's static
input buffers, the weights, the pool) and its output is the same tensor at every replay,
overwritten; `run(key, forward)` returns the forward's output for the inputs now in the
buffers whether it captured, replayed or (with no capture) ran it eagerly; after
`invalidate`, every key captures anew, counted as a recapture.
Never: copies inputs (the executor fills the buffers), or keeps a graph across an
invalidation.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

Forward = Callable[[], torch.Tensor]


class Replay(Protocol):
    """One captured forward."""

    def replay(self) -> torch.Tensor:
        """Runs the capture again over the buffers' current contents; its output."""


class GraphCapture(Protocol):
    """How forwards are captured."""

    def capture(self, forward: Forward) -> Replay: ...


@dataclass
class GraphStats:
    """What a StepGraphs did: graphs captured (recaptures among them: keys captured
    before an invalidation), replays, eager runs, invalidations, graphs held now."""

    captures: int = 0
    recaptures: int = 0
    replays: int = 0
    eager_runs: int = 0
    invalidations: int = 0
    graphs: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class StepGraphs:
    """Graphs by key over one `GraphCapture`; None runs every forward eagerly."""

    def __init__(self, capture: GraphCapture | None) -> None:
        self.capture = capture
        self.stats = GraphStats()
        self._graphs: dict[Hashable, Replay] = {}
        self._seen: set[Hashable] = set()

    @property
    def enabled(self) -> bool:
        return self.capture is not None

    def run(self, key: Hashable, forward: Forward) -> torch.Tensor:
        """`forward`'s output over the current buffers: replayed when `key` is captured,
        captured first when not, eager without a capture."""
        if self.capture is None:
            self.stats.eager_runs += 1
            return forward()
        graph = self._graphs.get(key)
        if graph is None:
            graph = self.capture.capture(forward)
            self._graphs[key] = graph
            self.stats.captures += 1
            self.stats.recaptures += key in self._seen
            self._seen.add(key)
            self.stats.graphs = len(self._graphs)
        self.stats.replays += 1
        return graph.replay()

    def invalidate(self) -> None:
        """Drops every graph (what they captured has moved); the next run of each key
        captures again."""
        if self._graphs:
            self.stats.invalidations += 1
        self._graphs.clear()
        self.stats.graphs = 0

    def captured_keys(self) -> list[Hashable]:
        return list(self._graphs)


class _CudaReplay:
    def __init__(self, graph: Any, output: torch.Tensor, device: torch.device | None) -> None:
        self.graph = graph
        self.output = output
        self.device = device

    def replay(self) -> torch.Tensor:
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.output


class CudaGraphCapture:
    """torch.cuda.CUDAGraph captures, all in one memory pool: graphs replay one at a time
    and an output is read before the next replay, so their scratch memory is shared."""

    WARMUPS = 2  # eager runs on a side stream first: lazy initialisation stays out

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device  # the GPU the forwards run on (None: the current one)
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Forward) -> Replay:
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch: untyped
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(self.WARMUPS):
                    forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = forward()
        return _CudaReplay(graph, output, self.device)


class _RecordedReplay:
    def __init__(self, module: Callable[[], torch.Tensor]) -> None:
        self.module = module

    def replay(self) -> torch.Tensor:
        return self.module()


class RecordedCapture:
    """The CPU stand-in for CUDA graphs: make_fx records the aten (and custom) operations
    a forward runs over the real tensors it reads, once; a replay runs that record over
    the same tensors. Decisions the forward's Python took at capture stay taken, as in a
    CUDA graph; `captured` counts the forwards it recorded."""

    def __init__(self) -> None:
        self.captured = 0

    def capture(self, forward: Forward) -> Replay:
        from torch.fx.experimental.proxy_tensor import make_fx

        self.captured += 1
        return _RecordedReplay(make_fx(forward)())
