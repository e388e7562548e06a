"""The manifest of a program file: what the runtime reads instead of model code.

Owns: `Manifest` and its parts (`MethodSpec`, `ConstantSpec`; its model is the
`cellbatch.types.ModelGeometry` every layer reads), the program format version
(`FORMAT_VERSION`), the order of a method's inputs (`METHOD_INPUTS`), their
JSON form, and `ProgramFormatError`.
Promises: `Manifest.from_json` returns a manifest only when the text is one this cellbatch
can run: a known format version (a newer one is refused, naming both versions and what to
do), every field present with the right type, methods that make sense (one prefill, decode
widths that are distinct, bounds within the step), constants that name stored tensors.
Every refusal is a `ProgramFormatError` saying what is wrong and how to fix it.
Never: imports torch or model code, or touches files.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from cellbatch.types import InvalidArgumentError, ModelGeometry

if TYPE_CHECKING:  # typeshed's name for "any dataclass", known to type checkers only
    from _typeshed import DataclassInstance

FORMAT_VERSION = 1
# A method's inputs, in order, then the K pool (one tensor per layer), then the V pool.
METHOD_INPUTS = (
    "tokens",
    "positions",
    "cells",
    "attention_cells",
    "attention_rows",
    "attention_positions",
    "attention_cell_offsets",
    "attention_block_starts",
    "logit_rows",
)
PREFILL = "prefill"
DECODE = "decode"
# What a method returns: float32 logits for the rows `logit_rows` names, nothing else.
LOGITS_MODE = "float32 rows"


class ProgramFormatError(InvalidArgumentError):
    """A program file this cellbatch cannot run (damaged, newer, or inconsistent)."""


@dataclass(frozen=True)
class MethodSpec:
    """One compiled method: `kind` "prefill" (a dynamic token count) or "decode" (one
    static width, min_tokens == max_tokens); `name` is its model in the package."""

    name: str
    kind: str
    min_tokens: int
    max_tokens: int

    @property
    def static(self) -> bool:
        return self.min_tokens == self.max_tokens


@dataclass(frozen=True)
class ConstantSpec:
    """A method constant: the stored tensor it is made of, and whether the runtime must
    reorder it for oneDNN's products first (`torch.ops.mkldnn._reorder_linear_weight`)."""

    tensor: str
    packed: bool


@dataclass(frozen=True)
class Manifest:
    format_version: int
    cellbatch_version: str
    torch_version: str
    cpu_capability: str  # torch's CPU capability the code was compiled for
    model: ModelGeometry
    dtype: str  # the activations' (and float weights') dtype
    kv_dtype: str
    methods: list[MethodSpec]
    min_prefill_tokens: int
    max_step_tokens: int
    max_pool_rows: int  # the most KV pool rows (cells + the scratch row) a method takes
    query_block: int  # queries per block of the attention op (FlatAttentionPlan)
    logits: str
    stop_tokens: list[int]
    source: dict[str, str]  # the source model's identity: path, kind, name, bytes, sha256
    constants: dict[str, ConstantSpec]  # method constant name -> how to make it
    custom_ops: dict[str, str]  # qualified op name -> schema, for the ops the methods call
    kernel_library: str  # record holding the compiled library of the custom ops
    tokenizer_files: list[str] = field(default_factory=list)  # records under tokenizer/
    export_seconds: dict[str, float] = field(default_factory=dict)  # per method
    # The weights as cellbatch.model.weights_summary.describe gave them (a program written
    # before these fields holds float weights of `dtype`).
    weights_format: str = ""  # in words, e.g. "int4, embedding int8, lm_head int8"
    weight_formats: dict[str, str] = field(default_factory=dict)  # role -> format
    weight_kernel: str = "none"  # the quantised products' kernel
    weight_bytes_by_format: dict[str, int] = field(default_factory=dict)
    # The kernels' C entry points the methods call directly, not through torch's proxy
    # executor (a program written before this field calls every custom op through it).
    c_shims: list[str] = field(default_factory=list)

    @property
    def prefill(self) -> MethodSpec:
        return next(method for method in self.methods if method.kind == PREFILL)

    @property
    def decode_methods(self) -> list[MethodSpec]:
        """The decode methods, narrowest first."""
        return sorted(
            (method for method in self.methods if method.kind == DECODE),
            key=lambda method: method.max_tokens,
        )

    @property
    def num_inputs(self) -> int:
        return len(METHOD_INPUTS) + 2 * self.model.num_layers

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ProgramFormatError(
                f"its manifest is not JSON ({error}); export it again"
            ) from None
        if not isinstance(data, dict):
            raise ProgramFormatError("its manifest is not a JSON object; export it again")
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ProgramFormatError("its manifest has no format_version; export it again")
        if version > FORMAT_VERSION:
            raise ProgramFormatError(
                f"it is program format {version}, written by a newer cellbatch "
                f"({data.get('cellbatch_version', '?')}); this cellbatch reads format "
                f"{FORMAT_VERSION} and older: upgrade cellbatch, or export the model again "
                "with this one"
            )
        if version < 1:
            raise ProgramFormatError(f"its format version {version} is not a valid one")
        manifest = _build(cls, data, "manifest")
        manifest.check()
        return manifest

    def check(self) -> None:
        """Refuses a manifest whose parts contradict each other."""
        prefills = [method for method in self.methods if method.kind == PREFILL]
        if len(prefills) != 1:
            raise ProgramFormatError(f"its manifest lists {len(prefills)} prefill methods, not 1")
        names = [method.name for method in self.methods]
        if len(set(names)) != len(names):
            raise ProgramFormatError(f"its manifest repeats a method name: {names}")
        for method in self.methods:
            if method.kind not in (PREFILL, DECODE):
                raise ProgramFormatError(f"method {method.name} has unknown kind {method.kind!r}")
            if not 1 <= method.min_tokens <= method.max_tokens <= self.max_step_tokens:
                raise ProgramFormatError(
                    f"method {method.name} takes [{method.min_tokens}, {method.max_tokens}] "
                    f"tokens, outside [1, max_step_tokens={self.max_step_tokens}]"
                )
            if method.kind == DECODE and not method.static:
                raise ProgramFormatError(f"decode method {method.name} has no static width")
        widths = [method.max_tokens for method in self.decode_methods]
        if len(set(widths)) != len(widths):
            raise ProgramFormatError(f"its manifest repeats a decode width: {widths}")
        if prefills[0].min_tokens != self.min_prefill_tokens or self.min_prefill_tokens < 2:
            raise ProgramFormatError(
                f"min_prefill_tokens={self.min_prefill_tokens} does not match the prefill "
                f"method's lower bound {prefills[0].min_tokens} (both must be >= 2)"
            )
        if self.model.num_layers != len(self.model.layer_windows):
            raise ProgramFormatError("its manifest gives a sliding window per layer, not per layer")


_Part = TypeVar("_Part", bound="DataclassInstance")  # a manifest part: a dataclass


def _build(cls: type[_Part], data: Any, where: str) -> _Part:
    """A dataclass from its JSON object, every field present and of the right kind."""
    if not isinstance(data, dict):
        raise ProgramFormatError(f"its manifest's {where} is not an object")
    missing = [f.name for f in fields(cls) if f.name not in data and _required(f)]
    if missing:
        raise ProgramFormatError(
            f"its manifest's {where} lacks {', '.join(missing)}: not a cellbatch program, or "
            "a damaged one; export it again"
        )
    values = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if f.name == "model":
            value = _build(ModelGeometry, value, "model")
        elif f.name == "methods":
            value = [_build(MethodSpec, item, "method") for item in _listed(value, f.name)]
        elif f.name == "constants":
            if not isinstance(value, dict):
                raise ProgramFormatError("its manifest's constants are not an object")
            value = {name: _build(ConstantSpec, spec, name) for name, spec in value.items()}
        elif f.type in _TUPLES and _fits(value, _TUPLES[str(f.type)]):
            value = tuple(value)  # JSON has lists; the geometry holds tuples
        elif not _fits(value, str(f.type)):
            raise ProgramFormatError(
                f"its manifest's {where}.{f.name} is {value!r}, not of type {f.type}"
            )
        values[f.name] = value
    return cls(**values)


# Tuple fields (annotated as text) and the JSON list type they are written as.
_TUPLES = {"tuple[int, ...]": "list[int]", "tuple[int | None, ...]": "list[int | None]"}


def _required(f: Any) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _listed(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProgramFormatError(f"its manifest's {name} is not a list")
    return value


def _fits(value: Any, type_name: str) -> bool:
    """Whether a JSON value has the (annotated, as text) type of a manifest field."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    checks = {
        "int": is_int,
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "list[int]": isinstance(value, list) and all(_fits(v, "int") for v in value),
        "list[str]": isinstance(value, list) and all(isinstance(v, str) for v in value),
        "list[int | None]": isinstance(value, list)
        and all(v is None or _fits(v, "int") for v in value),
        "dict[str, str]": isinstance(value, dict)
        and all(isinstance(v, str) for v in value.values()),
        "dict[str, int]": isinstance(value, dict) and all(_fits(v, "int") for v in value.values()),
        "dict[str, float]": isinstance(value, dict)
        and all(isinstance(v, (int, float)) for v in value.values()),
    }
    return checks.get(type_name, False)
