"""The program file on disk: one PT2 archive (a zip, PyTorch's package format).

Owns: the layout of a program file and both directions of it. `write_program` puts into
one archive the compiled methods (AOTInductor's files, one model per method, written by
PyTorch's own packaging), the manifest, the tokenizer's files, the weights (stored once,
as safetensors, for every method) and the compiled library of the custom ops.
`ProgramArchive` opens one and checks it before anything in it runs.
Promises: a write goes to a temporary file renamed into place, so an interrupted export
leaves no half program behind. `ProgramArchive(path)` refuses, with a
`ProgramFormatError` naming the file, the problem and the fix: a missing file, a file that
is not a zip or is truncated, a missing manifest or record, a manifest from a newer
format (`Manifest.from_json`), and methods in the archive that differ from the
manifest's. `read_bytes` checks each record's CRC-32, so a corrupt record is refused
rather than loaded.
Never: imports model code, loads compiled code or registers ops (`program.py` does).
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import save as save_safetensors

from cellbatch.export.manifest import Manifest, ProgramFormatError

MANIFEST = "extra/cellbatch_manifest.json"
TOKENIZER_DIR = "extra/tokenizer/"
WEIGHTS = "data/cellbatch/weights.safetensors"
METHODS_DIR = "data/aotinductor/"
PROGRAM_SUFFIX = ".pt2"


def write_program(
    path: Path,
    manifest: Manifest,
    methods: dict[str, list[str]],
    weights: dict[str, torch.Tensor],
    tokenizer: dict[str, str],
    kernel_library: bytes,
) -> None:
    """Writes the program file at `path` (a `.pt2` name): `methods` maps each method's
    name to the files AOTInductor generated for it (compiled with its constants left
    out); `weights` are the tensors every method's constants come from."""
    # PyTorch's packaging of AOTInductor files (one folder per model); it is what
    # aoti_compile_and_package itself calls.
    from torch.export.pt2_archive._package import (
        AOTI_FILES,
        PT2ArchiveWriter,
        _package_aoti_files,
    )

    # Written beside its destination under the same name (the archive's top folder is
    # named after the file), then moved into place.
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as folder:
        partial = Path(folder) / path.name
        with PT2ArchiveWriter(str(partial)) as writer:
            # Lists of paths are AOTI_FILES (lists of paths or Weights) to a reader, and the
            # packaging only reads them.
            _package_aoti_files(writer, cast(AOTI_FILES, methods))
            writer.write_string(MANIFEST, manifest.to_json())
            for name, text in tokenizer.items():
                writer.write_string(TOKENIZER_DIR + name, text)
            writer.write_bytes(WEIGHTS, save_safetensors(weights))
            writer.write_bytes(manifest.kernel_library, kernel_library)
        os.replace(partial, path)


class ProgramArchive:
    """An opened program file whose manifest and records have been checked."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"program {self.path} does not exist")
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError) as error:
            raise self._damaged(f"it is not a zip archive ({error})") from error
        names = self._zip.namelist()
        # PyTorch's archives keep every record under one top folder, named at write time.
        self._root = names[0].split("/", 1)[0] + "/" if names else ""
        self._records = {name[len(self._root) :] for name in names if name.startswith(self._root)}
        if MANIFEST not in self._records:
            raise self._damaged("it has no cellbatch manifest (is it a cellbatch program?)")
        try:
            self.manifest = Manifest.from_json(self.read_bytes(MANIFEST).decode("utf-8"))
        except ProgramFormatError as error:
            raise ProgramFormatError(f"cannot run program {self.path}: {error}") from None
        self._check_records()

    def read_bytes(self, record: str) -> bytes:
        """A record's bytes, its CRC-32 checked."""
        try:
            return self._zip.read(self._root + record)
        except KeyError:
            raise self._damaged(f"it has no record {record}") from None
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            raise self._damaged(f"its record {record} is corrupt ({error})") from error

    def read_text(self, record: str) -> str:
        return self.read_bytes(record).decode("utf-8")

    def method_records(self, method: str) -> list[str]:
        prefix = f"{METHODS_DIR}{method}/"
        return sorted(name for name in self._records if name.startswith(prefix))

    def verify_method(self, method: str) -> None:
        """Checks the CRC-32 of every file of `method` before its code is loaded."""
        for record in self.method_records(method):
            self.read_bytes(record)

    def close(self) -> None:
        self._zip.close()

    def _check_records(self) -> None:
        manifest = self.manifest
        stored = {
            name[len(METHODS_DIR) :].split("/", 1)[0]
            for name in self._records
            if name.startswith(METHODS_DIR)
        }
        listed = {method.name for method in manifest.methods}
        if stored != listed:
            raise self._damaged(
                f"its manifest lists methods {sorted(listed)} but it holds {sorted(stored)}"
            )
        needed = [WEIGHTS, manifest.kernel_library] + [
            TOKENIZER_DIR + name for name in manifest.tokenizer_files
        ]
        missing = [record for record in needed if record not in self._records]
        if missing:
            raise self._damaged(f"it lacks the records {missing}")

    def _damaged(self, problem: str) -> ProgramFormatError:
        return ProgramFormatError(
            f"cannot run program {self.path}: {problem}; the file is damaged (truncated or "
            "corrupt) or not a cellbatch program: export the model again with "
            "`cellbatch export`"
        )
