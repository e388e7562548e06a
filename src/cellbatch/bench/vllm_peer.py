"""vLLM's CPU build as a peer of the throughput benchmark.

Owns: the model as vLLM reads it (the GGUF dequantised once by transformers into a
Hugging Face folder of safetensors, kept for later runs), the call of `vllm_driver.py`
under the Python of vLLM's own virtualenv (`make peers`; `call_driver`, which the scale,
speculation and LoRA benchmarks use too) and the peer built on it.
Promises: the peer reads the same prompt tokens, dtype, threads and token budget as the
others, decodes greedily and stops at the same stop tokens (kept in its output); its
time is its generation alone, measured in its process after a warm-up.
Never: imports vLLM into this process (its torch pins and threads are its own).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cellbatch.bench.peers import Peer, load_transformers_model, progress
from cellbatch.bench.workload import VLLM, WARMUP_TOKENS
from cellbatch.types import Token

DRIVER = Path(__file__).with_name("vllm_driver.py")
ANSWER_MARK = "cellbatch-vllm-answer "  # as vllm_driver.py writes it (it imports nothing)
# A generation through vLLM: its start, the model load and the compile take a while.
TIMEOUT_S = 3600.0


def vllm_folder(model: Path, cache: Path) -> Path:
    """`model` as a Hugging Face folder under `cache` (written the first time)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cellbatch.model.loading import locate_model

    files = locate_model(model)
    if files.kind != "gguf":
        return files.folder
    folder = cache / f"{files.path.stem}-hf"
    if not (folder / "config.json").exists():
        progress(f"vllm: writing {model} as a Hugging Face folder in {folder}")
        # The GGUF-loaded model is marked quantized and refuses to save: its dequantised
        # weights go into a plain model of the same config.
        loaded = load_transformers_model(model, torch.float32)
        config = loaded.config
        del config.quantization_config
        weights = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]  # transformers: untyped
        weights.load_state_dict(loaded.state_dict())
        weights.save_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(str(files.folder), gguf_file=files.path.name)
        tokenizer.save_pretrained(folder)
    return folder


def require_environment(python: Path) -> None:
    """Raises, saying how to build one, when vLLM's Python is not there."""
    if not python.exists():
        raise FileNotFoundError(
            f"no vLLM environment at {python}: run `make peers` (it builds .venv-peers/vllm), "
            "or point --vllm-python at one"
        )


def call_driver(python: Path, command: str, request: dict[str, Any]) -> dict[str, Any]:
    """`vllm_driver.py COMMAND` under vLLM's Python, fed `request`: its answer line."""
    require_environment(python)
    done = subprocess.run(
        [str(python), str(DRIVER), command],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"vLLM failed ({done.returncode}): {done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith(ANSWER_MARK)]
    if not lines:
        raise RuntimeError(f"vLLM gave no answer: {done.stdout[-2000:]}")
    answer: dict[str, Any] = json.loads(lines[-1].removeprefix(ANSWER_MARK))
    return answer


def vllm_peer(
    python: Path, folder: Path, count: int, dtype: str, threads: int, stop: frozenset[Token]
) -> Peer:
    """vLLM over `count` prompts, all submitted at once, in a process of its own."""
    require_environment(python)
    timed: list[float] = []

    def generate(prompts: Sequence[Sequence[Token]], new: int) -> list[list[Token]]:
        request = {
            "model": str(folder),
            "dtype": dtype,
            "threads": threads,
            "prompts": [list(p) for p in prompts],
            "max_new_tokens": new,
            "stop": sorted(stop),
            "warmup_tokens": WARMUP_TOKENS,
        }
        answer = call_driver(python, "generate", request)
        timed[:] = [float(answer["seconds"])]
        return [list(output) for output in answer["outputs"]]

    label = f"vLLM-CPU, {count} prompts at once"
    return Peer(VLLM, label, count, dtype, generate, own_seconds=lambda: timed[0])
