"""The LoRA adapters one model serves, and what a packed step hands its layers of them.

Owns: `AdapterBank` (the adapters loaded for one model: their names, the ids the
executor's rows carry, how many generations use each, and their figures) and
`LoraStep` / `LayerLora` (one step's rows grouped by adapter, with each layer's weights
in the argument layout of the ops `lora_add` and `decoder_layer`).
Promises: thread-safe: `load`, `unload`, `acquire` and `release` come from any thread,
`step` from the engine thread. An adapter id is issued once and never reused, so a
name loaded again after an unload is another adapter (the prefix cache keeps them
apart). `unload` takes the name away at once (new generations cannot name it) and
drops the weights once the last generation that acquired it has released it: a
running generation always finishes with the weights it started with. At most
`max_loras` adapters hold weights at a time (those still draining count). Rows of id
NO_ADAPTER (0) are in no group and cost nothing; a step without adapter rows gets no
LoraStep at all. A row layout seen in the last few steps gets the LoraStep built for it
then (read-only, and dropped with the weights of any adapter in it). Beside a quantised
base (`for_model`) adapters are held in int8 (`cellbatch.model.lora`).
Never: reads files itself (`cellbatch.model.lora` does), or changes the base model.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cellbatch.model.config import ModelConfig
from cellbatch.model.lora import PRODUCTS, LoraAdapter, read_adapter
from cellbatch.model.quantized import DecoderModel
from cellbatch.model.weights_summary import describe
from cellbatch.types import (
    DEFAULT_MAX_LORAS,
    NO_ADAPTER,
    InvalidArgumentError,
    OutOfResourcesError,
)

# Row layouts whose LoraStep AdapterBank keeps (the oldest goes first).
_LAYOUTS_KEPT = 16


@dataclass(frozen=True)
class AdapterInfo:
    """A loaded adapter as callers see it."""

    name: str
    path: Path
    rank: int
    targets: tuple[str, ...]
    nbytes: int
    weights: str  # how A and B are held: "int8", or the model's dtype ("bfloat16", ...)


@dataclass
class AdapterUsage:
    """One adapter name's figures since the bank was made (kept after an unload)."""

    generations: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


@dataclass
class _Loaded:
    adapter_id: int
    info: AdapterInfo
    weights: LoraAdapter
    uses: int = 0
    unloading: bool = False


@dataclass(frozen=True)
class LayerLora:
    """One layer's share of a step: `args` is what `decoder_layer` takes as `lora` (the
    step's rows, its groups' offsets, then per product in PRODUCTS' order 4 tensors per
    group: a, b, segments, scales); `products[p]` is product p's part of it, or None where no
    group's adapter targets that product."""

    args: list[torch.Tensor]
    products: tuple[list[torch.Tensor] | None, ...]

    @property
    def rows(self) -> torch.Tensor:
        return self.args[0]

    @property
    def offsets(self) -> torch.Tensor:
        return self.args[1]


@dataclass(frozen=True)
class LoraStep:
    """A step's rows with adapters, grouped by adapter: `layers[i]` for layer i (None
    where no group's adapter targets that layer)."""

    layers: tuple[LayerLora | None, ...]


@dataclass
class AdapterBank:
    """The adapters of one model (see the module)."""

    config: ModelConfig
    dtype: torch.dtype
    max_loras: int = DEFAULT_MAX_LORAS
    int8: bool = False  # adapters' A and B held as int8
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(NO_ADAPTER + 1))
    _by_name: dict[str, _Loaded] = field(default_factory=dict)  # listed: loaded, not unloading
    _by_id: dict[int, _Loaded] = field(default_factory=dict)  # holding weights
    _usage: dict[str, AdapterUsage] = field(default_factory=dict)
    # The weights of each adapter set a step used, per layer and product (see _weights).
    _cache: dict[tuple[int, ...], list[list[list[torch.Tensor] | None]]] = field(
        default_factory=dict
    )
    # The LoraStep of each recent row layout (the bytes of a step's row_adapters): a decode
    # step usually has the layout of the one before, and building a step's per-layer
    # lists anew costs as much as the adapters' products on a lone row.
    _steps: dict[bytes, tuple[frozenset[int], LoraStep]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_max_loras(self.max_loras)

    @classmethod
    def for_model(
        cls, model: DecoderModel, config: ModelConfig, max_loras: int = DEFAULT_MAX_LORAS
    ) -> AdapterBank:
        """The bank of a loaded model: adapters in its dtype, or in int8 where its layers'
        products are quantised (a float base keeps its adapters' arithmetic)."""
        float_format = str(model.dtype).removeprefix("torch.")
        quantised = describe(model).formats["projections"] != float_format
        return cls(config, model.dtype, max_loras, int8=quantised)

    # -- any thread ---------------------------------------------------------------

    def load(self, name: str, path: str | Path) -> AdapterInfo:
        """Reads the PEFT adapter at `path` and serves it as `name`; AdapterError naming
        the file and the mismatch when it cannot run on this model, InvalidArgumentError
        for a name in use, OutOfResourcesError past max_loras. Nothing loads on error."""
        check_name(name)
        with self._lock:
            self._check_room(name)
        weights = read_adapter(path, self.config, self.dtype, self.int8)  # unlocked: slow
        held = "int8" if self.int8 else str(self.dtype).removeprefix("torch.")
        info = AdapterInfo(name, weights.path, weights.rank, weights.targets, weights.nbytes, held)
        with self._lock:
            self._check_room(name)
            loaded = _Loaded(next(self._ids), info, weights)
            self._by_name[name] = loaded
            self._by_id[loaded.adapter_id] = loaded
            self._usage.setdefault(name, AdapterUsage())
        return info

    def unload(self, name: str) -> None:
        """`name` is no longer served; its weights go once no generation uses them.
        InvalidArgumentError when no adapter has that name."""
        with self._lock:
            loaded = self._by_name.pop(name, None)
            if loaded is None:
                raise InvalidArgumentError(
                    f"no LoRA adapter named {name!r} is loaded{self._listing()}"
                )
            loaded.unloading = True
            self._drop_if_unused(loaded)

    def acquire(self, name: str) -> int:
        """The id of the adapter served as `name`, held for one generation until
        `release`; InvalidArgumentError when no adapter has that name."""
        with self._lock:
            loaded = self._by_name.get(name)
            if loaded is None:
                raise InvalidArgumentError(
                    f"no LoRA adapter named {name!r} is loaded{self._listing()}"
                )
            loaded.uses += 1
            self._usage[name].generations += 1
            return loaded.adapter_id

    def release(self, adapter_id: int, prompt_tokens: int, generated_tokens: int) -> None:
        """A generation that acquired `adapter_id` has ended, having fed and generated
        these many tokens."""
        with self._lock:
            loaded = self._by_id.get(adapter_id)
            if loaded is None:
                return
            usage = self._usage[loaded.info.name]
            usage.prompt_tokens += prompt_tokens
            usage.generated_tokens += generated_tokens
            loaded.uses -= 1
            self._drop_if_unused(loaded)

    def adapters(self) -> list[AdapterInfo]:
        """The adapters served now, in load order."""
        with self._lock:
            return [loaded.info for loaded in self._by_name.values()]

    def usage(self) -> dict[str, AdapterUsage]:
        """Per adapter name ever loaded: its figures (copies)."""
        with self._lock:
            return {name: AdapterUsage(**vars(usage)) for name, usage in self._usage.items()}

    def holding(self) -> int:
        """Adapters whose weights are held (served, or draining)."""
        with self._lock:
            return len(self._by_id)

    # -- engine thread ------------------------------------------------------------

    def step(self, row_adapters: np.ndarray) -> LoraStep | None:
        """The LoraStep of a forward whose row i carries adapter id row_adapters[i]
        (NO_ADAPTER: none); None when no row has one."""
        layout = np.ascontiguousarray(row_adapters, dtype=np.int64).tobytes()
        known = self._steps.get(layout)
        if known is not None:
            return known[1]
        with_adapter = np.flatnonzero(row_adapters != NO_ADAPTER)
        if with_adapter.size == 0:
            return None
        order = with_adapter[np.argsort(row_adapters[with_adapter], kind="stable")]
        ids, counts = np.unique(row_adapters[order], return_counts=True)
        rows = torch.from_numpy(order.astype(np.int64))
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
        layers: list[LayerLora | None] = []
        for per_product in self._weights(tuple(int(i) for i in ids)):
            if all(weights is None for weights in per_product):
                layers.append(None)
                continue
            groups = len(ids)
            args = [rows, offsets]
            for p, weights in enumerate(per_product):
                args += weights if weights is not None else self._nothing(p) * groups
            layers.append(LayerLora(args, tuple(per_product)))
        step = LoraStep(tuple(layers))
        with self._lock:
            if len(self._steps) >= _LAYOUTS_KEPT:
                del self._steps[next(iter(self._steps))]
            self._steps[layout] = (frozenset(int(i) for i in ids), step)
        return step

    def _weights(self, ids: tuple[int, ...]) -> list[list[list[torch.Tensor] | None]]:
        """Per layer, per product: the groups' (a, b, segments, scales) one after the
        other, or None where none of the adapters `ids` targets the product."""
        cached = self._cache.get(ids)
        if cached is not None:
            return cached
        with self._lock:
            missing = [i for i in ids if i not in self._by_id]
            if missing:
                raise InvalidArgumentError(
                    f"a step carries adapter id {missing[0]}, whose weights are gone; "
                    "a generation must hold its adapter until it ends"
                )
            adapters = [self._by_id[i].weights for i in ids]
            if len(self._cache) >= 4 * self.max_loras:
                self._cache.clear()
            built: list[list[list[torch.Tensor] | None]] = []
            for layer in range(self.config.num_layers):
                per_product: list[list[torch.Tensor] | None] = []
                for p, product in enumerate(PRODUCTS):
                    pairs = [adapter.layers[layer].get(product) for adapter in adapters]
                    if all(pair is None for pair in pairs):
                        per_product.append(None)
                        continue
                    weights: list[torch.Tensor] = []
                    for pair in pairs:
                        weights += (
                            self._nothing(p)
                            if pair is None
                            else [pair.a, pair.b, pair.segments, pair.scales]
                        )
                    per_product.append(weights)
                built.append(per_product)
            self._cache[ids] = built
            return built

    def _nothing(self, product: int) -> list[torch.Tensor]:
        """The (a, b, segments, scales) of a group whose adapter does not target `product`."""
        empty = torch.empty(0, 0, dtype=self.dtype)
        return [
            empty,
            empty.view(0),
            torch.empty(0, 4, dtype=torch.int64),
            torch.empty(0, dtype=torch.float32),
        ]

    # -- internals (under the lock) -------------------------------------------------

    def _check_room(self, name: str) -> None:
        if name in self._by_name:
            raise InvalidArgumentError(
                f"a LoRA adapter named {name!r} is already loaded; unload it first or pick "
                "another name"
            )
        if len(self._by_id) >= self.max_loras:
            raise OutOfResourcesError(
                f"{len(self._by_id)} LoRA adapters are loaded (max_loras={self.max_loras}, "
                "adapters still finishing generations after an unload count); unload one "
                "or raise max_loras"
            )

    def _drop_if_unused(self, loaded: _Loaded) -> None:
        if loaded.unloading and loaded.uses == 0:
            del self._by_id[loaded.adapter_id]
            gone = loaded.adapter_id
            self._cache = {ids: v for ids, v in self._cache.items() if gone not in ids}
            self._steps = {key: v for key, v in self._steps.items() if gone not in v[0]}

    def _listing(self) -> str:
        names = list(self._by_name)
        return f"; loaded: {', '.join(names)}" if names else "; none is loaded"


def check_name(name: object) -> str:
    """An adapter name: a non-empty string without surrounding spaces."""
    if not isinstance(name, str) or not name or name != name.strip():
        raise InvalidArgumentError(
            f"an adapter name must be a non-empty string without surrounding spaces, got {name!r}"
        )
    return name


def check_max_loras(value: object) -> int:
    """The bound on adapters loaded at once: an integer >= 1."""
    if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
        raise InvalidArgumentError(
            f"max_loras must be an integer >= 1 (LoRA adapters loaded at once), got {value!r}"
        )
    return value
