"""Programs: a model exported once into a self-contained file, and what loads it
(docs/design.md#programs-and-export).

Owns: the program file format and both of its sides. The writer, `exporter`
(`export_program`, what `cellbatch export` runs), needs the model's code; the reader
(`manifest`, `archive`, `custom_ops`, `program`: `load_program`) needs only torch, and
`cellbatch.executor.program_executor` runs what it loads.
Promises: importing this package or any reader module never imports `cellbatch.model`.
Never: holds state of its own.
"""

from cellbatch.export.archive import PROGRAM_SUFFIX

__all__ = ["PROGRAM_SUFFIX", "is_program"]


def is_program(path: object) -> bool:
    """Whether `path` names a program file (by its suffix: a program is a `.pt2` file)."""
    return str(path).endswith(PROGRAM_SUFFIX)
