"""The custom ops a program calls, made callable in this process without model code.

Owns: `ensure_custom_ops`, which defines the program's custom ops from the schemas its
manifest carries (where nothing defined them yet), loads the compiled library the
program carries when their CPU kernels are missing here, and makes the kernels' C entry
points that the methods call directly (`Manifest.c_shims`) visible to them.
Promises: afterwards every op of the manifest has a CPU kernel and every entry point of
`c_shims` resolves, or a `ProgramFormatError` says which does not and why. An op
already defined in the process (by `cellbatch.model.ops`, or by an earlier program) is
kept when its schema is the program's, and refused when it differs (the program was
exported by another cellbatch).
A library is loaded at most once per process: the kernels already loaded here (the
installed ones) are used as they are.
Never: imports model code, or defines fake or pure-torch implementations (a program is
not traced again).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import tempfile
from collections.abc import Callable, Sequence

import torch

from cellbatch.export.manifest import ProgramFormatError

# Registrations live as long as their Library objects: these stay for the process.
_LIBRARIES: list[torch.library.Library] = []


def ensure_custom_ops(
    schemas: dict[str, str], read_library: Callable[[], bytes], c_shims: Sequence[str] = ()
) -> None:
    """Makes each op of `schemas` (qualified name -> schema) runnable on the CPU here, and
    each C entry point of `c_shims` (what the methods' compiled code calls directly)
    visible to the methods loaded next; `read_library` gives the compiled library to load
    when the kernels are missing."""
    for qualified, schema in schemas.items():
        _define(qualified, schema)
    if not all(_has_cpu_kernel(name) for name in schemas):
        _load_program_library(schemas, read_library)
    _expose(c_shims)


def _load_program_library(schemas: dict[str, str], read_library: Callable[[], bytes]) -> None:
    with tempfile.NamedTemporaryFile(prefix="cellbatch-kernels-", suffix=".so", delete=False) as f:
        f.write(read_library())
    try:
        # torch leaves load_library unannotated.
        torch.ops.load_library(f.name)  # type: ignore[no-untyped-call]
        _make_global(f.name)
    except OSError as error:
        raise ProgramFormatError(
            f"the program's compiled kernels do not load here ({error}); export the model "
            "again on a machine like this one"
        ) from error
    finally:
        os.unlink(f.name)  # the loaded library stays mapped
    missing = [name for name in schemas if not _has_cpu_kernel(name)]
    if missing:
        raise ProgramFormatError(
            f"the program's compiled kernels lack the CPU kernels of {missing}; export the "
            "model again"
        )


def _expose(symbols: Sequence[str]) -> None:
    """The compiled kernels' libraries made global (torch loads them local to themselves),
    so that a method's library resolves `symbols` in them when it is loaded."""
    if not symbols:
        return
    for path in torch.ops.loaded_libraries:
        if "cellbatch" in str(path):
            _make_global(str(path))
    process = ctypes.CDLL(None)
    missing = [symbol for symbol in symbols if not hasattr(process, symbol)]
    if missing:
        raise ProgramFormatError(
            f"the program's methods call {', '.join(missing)}, which the compiled kernels "
            "loaded here lack (an older cellbatch): upgrade cellbatch, or export the model "
            "again with this one"
        )


def _make_global(path: str) -> None:
    """A loaded library's symbols made visible to libraries loaded after it."""
    with contextlib.suppress(OSError):  # not loaded by that name: nothing to expose
        ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)


def _define(qualified: str, schema: str) -> None:
    namespace, _, name = qualified.partition("::")
    existing = _schema(namespace, name)
    if existing is None:
        # torch leaves Library's constructor and define unannotated.
        library = torch.library.Library(namespace, "FRAGMENT")  # type: ignore[no-untyped-call]
        library.define(schema.removeprefix(f"{namespace}::"))  # type: ignore[no-untyped-call]
        _LIBRARIES.append(library)
    elif existing != schema:
        raise ProgramFormatError(
            f"the program calls {qualified} as `{schema}`, but this process defines it as "
            f"`{existing}`: the program was exported by another cellbatch; export it again"
        )


def _schema(namespace: str, name: str) -> str | None:
    """The schema of op namespace::name (its default overload), None if undefined."""
    try:
        return str(getattr(getattr(torch.ops, namespace), name).default._schema)
    except (AttributeError, RuntimeError):
        return None


def _has_cpu_kernel(qualified: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU")
