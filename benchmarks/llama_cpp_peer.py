"""llama.cpp as a benchmark peer, through llama-cpp-python, in a process of its own.

Run by benchmarks/perplexity.py and benchmarks/quantized.py with the Python of a separate
environment where llama-cpp-python is built (never cellbatch's .venv), so it imports only
llama_cpp, numpy and the standard library. Reads one JSON request on stdin, writes one
JSON answer on stdout:

    {"task": "perplexity", "model": PATH, "threads": N, "tokens": [...], "context": 512}
        -> {"nll": [...]}: the negative log-likelihood of each scored token (the second
           half of each full chunk of `context` tokens, as llama-perplexity scores)
    {"task": "generate", "model": PATH, "threads": N, "prompts": [[...], ...],
     "max_new_tokens": 64, "stop": [...]}
        -> {"outputs": [[...], ...], "seconds": S, "prefill_seconds": P,
            "decode_tokens": D, "decode_seconds": T}: greedy tokens of each prompt alone
           (through the first stop token), the wall time of all of them, and the time spent
           in single-token decode steps (decode-only tokens/s at one sequence = D / T).

`ask(python, request)` is the other side: it runs this file with that Python and returns
the answer (the benchmarks call it from cellbatch's environment).

Owns: driving llama.cpp the same way for every figure. Never: tokenises (it is given token
ids, so every peer reads the same tokens) or samples anything but greedily.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def ask(python: str, request: dict, timeout: float = 3600) -> dict:
    """Runs `request` in a llama.cpp process under `python`; raises with its stderr."""
    done = subprocess.run(
        [python, str(Path(__file__).resolve())],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp peer failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def _load(request: dict, context: int, all_logits: bool):
    from llama_cpp import Llama

    return Llama(
        model_path=request["model"],
        n_ctx=context,
        n_batch=context,
        n_threads=request["threads"],
        n_threads_batch=request["threads"],
        logits_all=all_logits,
        verbose=False,
    )


def perplexity(request: dict) -> dict:
    import numpy as np

    context = request["context"]
    tokens = request["tokens"]
    llm = _load(request, context, all_logits=True)
    nll: list[float] = []
    for start in range(0, len(tokens) - context + 1, context):
        chunk = tokens[start : start + context]
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[:context], dtype=np.float64)
        for position in range(context // 2, context - 1):
            row = logits[position]
            top = row.max()
            log_total = top + math.log(np.exp(row - top).sum())
            nll.append(float(log_total - row[chunk[position + 1]]))
    return {"nll": nll}


def _greedy(llm: Any) -> int:
    """The argmax of the last evaluated token's logits. Read from the context itself:
    without logits_all, llama-cpp-python 0.3 leaves `Llama.scores` unwritten (zeros)."""
    import llama_cpp
    import numpy as np

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).argmax())


def generate(request: dict) -> dict:
    stop = set(request["stop"])
    budget = request["max_new_tokens"]
    longest = max(len(p) for p in request["prompts"]) + budget + 8
    llm = _load(request, longest, all_logits=False)
    outputs, prefill, decode_seconds, decode_tokens = [], 0.0, 0.0, 0
    started = time.perf_counter()
    for prompt in request["prompts"]:
        llm.reset()
        began = time.perf_counter()
        llm.eval(prompt)
        token = _greedy(llm)
        prefill += time.perf_counter() - began
        out = [token]
        while token not in stop and len(out) < budget:
            began = time.perf_counter()
            llm.eval([token])
            token = _greedy(llm)
            decode_seconds += time.perf_counter() - began
            decode_tokens += 1
            out.append(token)
        outputs.append(out)
    return {
        "outputs": outputs,
        "seconds": time.perf_counter() - started,
        "prefill_seconds": prefill,
        "decode_tokens": decode_tokens,
        "decode_seconds": decode_seconds,
    }


def main() -> int:
    request = json.loads(sys.stdin.read())
    task = {"perplexity": perplexity, "generate": generate}[request["task"]]
    json.dump(task(request), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
