"""The repacked-weights cache: a model's weights as the kernels hold them, written once
beside nothing else, so that the next start maps them from disk instead of converting.

Owns: where the cache lives (`cache_directory`: `CELLBATCH_CACHE_DIR`, else
`$XDG_CACHE_HOME/cellbatch`, else `~/.cache/cellbatch`), the key an entry is valid for
(`CacheKey`), writing an entry (`store`) and mapping one back (`restore`).
Promises: an entry is used only when its key is the one asked for, field for field: the
source files (path, size, modification time), the load options as resolved (dtype,
quantize, activations, kernels), torch's version and CPU capability, and the digest of
cellbatch's model code and kernel sources (every layout is defined there) — so a changed
file, option or layout makes a new entry, never a stale one, and the entries of a source
whose files changed are removed. An entry is a torch.save archive (64-byte aligned
tensors, each storage once: a tied head and embedding stay one tensor) loaded with
`mmap=True, weights_only=True`: the weights are the file's pages, read on first touch,
never copied, and loading runs no pickled code. An entry is written to a temporary file
and renamed into place, so a reader sees a whole entry or none; one that fails to read
is removed and the model converted again.
The modules: float parameters are restored into the model the loader builds from the
config; a quantised product (a module with `op`, `codes` and `scales`: the int8/int4
formats' linear modules and the kept K-quant blocks' alike) is rebuilt from its plain
attributes, its tensors and its op from the ops table; a quantised embedding (int8, or
gathered from kept K-quant panels) from its linear and the dtype, as its constructor takes
them. Only classes of `cellbatch.model` are rebuilt.
Never: caches a model without quantised modules (its float weights are the checkpoint's
own: nothing was converted), writes where there is not room for the entry, or fails a
load because the cache cannot be written (a warning says why).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import nn

from cellbatch.model.transformer import PackedTransformer
from cellbatch.types import InvalidArgumentError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ENTRY_SUFFIX = ".weights.pt"
_MODEL_PACKAGE = Path(__file__).parent
_PLAIN = (str, int, float, bool, type(None))


def cache_directory(choice: str | Path | None) -> Path | None:
    """The folder `choice` names: "auto" the default one, None or "off" none, else the
    path given; anything else is refused."""
    if choice is None or choice == "off":
        return None
    if not isinstance(choice, str | Path) or choice == "":
        raise InvalidArgumentError(
            f"weights_cache must be 'auto', a folder, or None (no cache), got {choice!r}"
        )
    if choice != "auto":
        return Path(choice).expanduser()
    if os.environ.get("CELLBATCH_CACHE_DIR"):
        return Path(os.environ["CELLBATCH_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cellbatch"


def code_digest() -> str:
    """sha256 of cellbatch's model code and kernel sources: the layouts' definition."""
    digest = hashlib.sha256()
    files = sorted(_MODEL_PACKAGE.rglob("*.py")) + sorted(
        path for pattern in ("*.cpp", "*.h") for path in (_MODEL_PACKAGE / "kernels").glob(pattern)
    )
    for path in files:
        digest.update(str(path.relative_to(_MODEL_PACKAGE)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class CacheKey:
    """What an entry is valid for (see the module's text)."""

    name: str  # the model's file or folder name, for people reading the folder
    sources: tuple[tuple[str, int, int], ...]  # (absolute path, size, mtime in ns)
    options: tuple[tuple[str, str], ...]  # resolved load options, by name
    torch_version: str
    cpu_capability: str
    code: str
    format_version: int = FORMAT_VERSION

    @classmethod
    def make(cls, name: str, files: list[Path], options: dict[str, str]) -> CacheKey:
        sources = []
        for file in sorted(path.resolve() for path in files):
            stat = file.stat()
            sources.append((str(file), stat.st_size, stat.st_mtime_ns))
        return cls(
            name,
            tuple(sources),
            tuple(sorted(options.items())),
            torch.__version__,
            torch.backends.cpu.get_cpu_capability(),
            code_digest(),
        )

    def as_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def entry(self, directory: Path) -> Path:
        digest = hashlib.sha256(self.as_json().encode()).hexdigest()[:24]
        return directory / f"{self.name}.{digest}{ENTRY_SUFFIX}"


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages under `tensors`, each once (a tied head and its embedding,
    loaded back as two tensors over one storage, count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# -- writing ------------------------------------------------------------------------


def has_quantized_modules(model: nn.Module) -> bool:
    return any(_is_product(module) for module in model.modules())


def _is_product(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("op", "codes", "scales"))


def _class_name(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    """The module's own attributes that JSON holds (names, sizes, flags, dicts of them)."""

    def plain(value: Any) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        return isinstance(value, _PLAIN)

    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_") and name != "training" and plain(value)
    }


def describe_modules(model: PackedTransformer) -> dict[str, Any]:
    """The quantised modules of `model`: products by path (class and plain attributes),
    and the embedding (class, plain attributes, whether the head is its linear)."""
    described: dict[str, Any] = {
        "products": {
            path: {"class": _class_name(module), "attributes": _plain_attributes(module)}
            for path, module in model.named_modules()
            if _is_product(module)
        }
    }
    embed = model.embed
    if hasattr(embed, "codes"):
        described["embedding"] = {
            "class": _class_name(embed),
            "attributes": _plain_attributes(embed),
            "tied": getattr(model.lm_head, "codes", None) is embed.codes,
        }
    return described


def store(entry: Path, key: CacheKey, model: PackedTransformer) -> int:
    """Writes `model`'s weights (quantised modules installed, float products not yet
    packed) as the entry for `key`, removes the stale entries of the same sources, and
    returns the bytes written (0 when there was not room)."""
    tensors = {name: tensor.detach() for name, tensor in model.state_dict(keep_vars=True).items()}
    tensors = {
        name: tensor
        for name, tensor in tensors.items()
        if not name.startswith(("rope_cos", "rope_sin"))
    }
    size = storage_bytes(tensors.values())
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(entry.parent).free
    except OSError as error:  # a file in the way, no permission: the load goes on
        log.warning("note: no repacked-weights cache written: %s", error)
        return 0
    if free < size + (size >> 4):
        log.warning(
            "note: no repacked-weights cache written: %s has %.2f GiB free, the entry needs "
            "%.2f GiB",
            entry.parent,
            free / 2**30,
            size / 2**30,
        )
        return 0
    archive = {
        "key": key.as_json(),
        "modules": json.dumps(describe_modules(model)),
        "tensors": tensors,
    }
    temporary = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    try:
        torch.save(archive, temporary)
        os.replace(temporary, entry)
    except (OSError, RuntimeError) as error:  # torch.save's write errors are RuntimeErrors
        log.warning("note: no repacked-weights cache written to %s: %s", entry.parent, error)
        return 0
    finally:
        temporary.unlink(missing_ok=True)
    _remove_stale(entry.parent, key, entry)
    return entry.stat().st_size


def _remove_stale(directory: Path, key: CacheKey, kept: Path) -> None:
    """Removes the entries of `key`'s source paths that can never be valid again: their
    source files or cellbatch's code have changed since they were written."""
    paths = {source[0] for source in key.sources}
    for other in directory.glob(f"*{ENTRY_SUFFIX}"):
        if other == kept:
            continue
        try:
            theirs = json.loads(_read_key(other))
        except Exception:  # unreadable: nothing can use it
            other.unlink(missing_ok=True)
            continue
        their_paths = {source[0] for source in theirs["sources"]}
        if their_paths == paths and (
            [list(s) for s in key.sources] != theirs["sources"] or theirs["code"] != key.code
        ):
            other.unlink(missing_ok=True)


def _read_key(entry: Path) -> str:
    archive = torch.load(entry, mmap=True, weights_only=True)
    return cast(str, archive["key"])


# -- reading ------------------------------------------------------------------------


def _model_class(name: str) -> type[nn.Module]:
    """A module class of cellbatch.model by its qualified name (and no other)."""
    module_name, _, class_name = name.rpartition(".")
    if not module_name.startswith("cellbatch.model."):
        raise ValueError(f"the entry names a class outside cellbatch.model: {name}")
    found = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ValueError(f"the entry names {name}, which is not a module class")
    return found


def _parameter(tensors: dict[str, torch.Tensor], name: str) -> nn.Parameter | None:
    tensor = tensors.get(name)
    return None if tensor is None else nn.Parameter(tensor, requires_grad=False)


def _product(spec: dict[str, Any], tensors: dict[str, torch.Tensor], path: str, ops: Any) -> Any:
    """The product module at `path` rebuilt from its attributes and tensors, without
    converting anything: what its constructor computed is in its attributes."""
    cls = _model_class(spec["class"])
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    module.__dict__.update(spec["attributes"])
    for name in ("codes", "scales", "bias"):
        setattr(module, name, _parameter(tensors, f"{path}.{name}"))
    module.matmul = getattr(ops, str(spec["attributes"]["op"]))
    return module


def restore(entry: Path, key: CacheKey, model: PackedTransformer) -> int | None:
    """Fills `model` (built on the meta device from the config) from the entry for `key`;
    returns the bytes it maps, or None when the entry is missing, for another key, or
    unreadable (then removed)."""
    if not entry.is_file():
        return None
    try:
        archive = torch.load(entry, mmap=True, weights_only=True)
        if archive["key"] != key.as_json():
            return None
        described = json.loads(archive["modules"])
        tensors: dict[str, torch.Tensor] = archive["tensors"]
        _fill(model, described, tensors)
    except Exception as error:  # a damaged or foreign entry: convert again
        log.warning(
            "note: repacked-weights cache %s unreadable (%s); converting again", entry, error
        )
        entry.unlink(missing_ok=True)
        return None
    return storage_bytes(tensors.values())


def _fill(
    model: PackedTransformer, described: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    products = described["products"]
    for path, spec in products.items():
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, _product(spec, tensors, path, model.ops))
    embedding = described.get("embedding")
    if embedding is not None:
        # Its constructor reads the codes, scales and plain attributes of its linear: the
        # head when tied, else the same fields as the embedding holds them.
        linear = (
            model.lm_head
            if embedding["tied"]
            else SimpleNamespace(
                **embedding["attributes"],
                codes=_parameter(tensors, "embed.codes"),
                scales=_parameter(tensors, "embed.scales"),
            )
        )
        cls = _model_class(embedding["class"])
        # An embedding that calls an op of the model's table (kquants' `kquant_rows`) takes
        # the table too.
        table = {"ops": model.ops} if "ops" in inspect.signature(cls).parameters else {}
        # setattr: the model's annotation names the float and int8 embeddings only.
        setattr(model, "embed", cls(linear, model.dtype, **table))  # noqa: B010
    quantised = (*products, "embed") if embedding is not None else tuple(products)
    floats = {
        name: tensor
        for name, tensor in tensors.items()
        if not any(name.startswith(f"{path}.") for path in quantised)
    }
    loaded = model.load_state_dict(floats, strict=False, assign=True)
    unfilled = [name for name, param in model.named_parameters() if param.is_meta]
    if loaded.unexpected_keys or unfilled:
        raise ValueError(
            f"entry and model differ: unexpected {loaded.unexpected_keys}, unfilled {unfilled}"
        )
