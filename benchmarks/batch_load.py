"""Batch jobs on `cellbatch serve` and offline: a batch through `/v1/batches` against the
same requests from concurrent streaming clients, an interactive request's time to first
token while the batch runs against an idle server's, and `cellbatch run-batch` against
vLLM's `run_batch` on the same file.

    python benchmarks/batch_load.py                        # 1,000 requests, default model
    python benchmarks/batch_load.py --requests 200 --skip-peer
    python benchmarks/batch_load.py --threads 2 --peer-requests 500

The requests are chat completions of the chat benchmark's prompts in turn, greedy, each
`--max-tokens` long (`ignore_eos`), so that every run produces the same tokens. One
`cellbatch serve` (default settings but `--threads` and a fresh `--data-dir`) serves,
in order: `--idle-probes` interactive streaming requests one at a time (TTFT of an idle
server); the requests as `--clients` concurrent streaming clients (tokens/s); the same
requests as one batch (tokens/s from its creation until it completes), while an
interactive streaming request goes every `--probe-every` seconds (TTFT during the
batch). Probes carry their own question, so no probe finds its whole prompt cached.
Then, offline and one after the other, `cellbatch run-batch` and vLLM's `run_batch`
(the CPU build `make peers` installs, on the same model as a float folder, the same
threads) answer the first `--peer-requests` requests; each one's time counts its run
over the file, not its model load. Every figure is printed as a JSON line, then a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cellbatch.bench.workload import CHAT_PROMPTS, DEFAULT_PEER_CACHE, DEFAULT_VLLM_PYTHON
from serve_load import _free_port, _read_events, _wait_until_serving

TERMINAL = ("completed", "failed", "cancelled", "expired")
HEADERS = {"Authorization": "Bearer bench"}


def requests_file(path: Path, count: int, max_tokens: int) -> None:
    lines = []
    for index in range(count):
        body = {
            "messages": [{"role": "user", "content": CHAT_PROMPTS[index % len(CHAT_PROMPTS)]}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        url = "/v1/chat/completions"
        lines.append({"custom_id": f"r{index}", "method": "POST", "url": url, "body": body})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


async def stream_one(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, float | None]:
    """(completion tokens, seconds to the first content) of one streamed request."""
    started = time.perf_counter()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/chat/completions", json=streamed) as response:
        tokens, _, ttft, _ = await _read_events(response, started)
    return tokens, ttft[0] if ttft else None


def probe_body(index: int) -> dict[str, Any]:
    prompt = CHAT_PROMPTS[index % len(CHAT_PROMPTS)]
    return {
        "messages": [{"role": "user", "content": f"{prompt} (question {index})"}],
        "max_tokens": 8,
        "temperature": 0,
    }


async def idle_ttft(base: str, probes: int) -> list[float]:
    async with httpx.AsyncClient(base_url=base, timeout=600, headers=HEADERS) as client:
        await stream_one(client, probe_body(10_000))  # warm-up
        found = []
        for index in range(probes):
            _, ttft = await stream_one(client, probe_body(index))
            if ttft is not None:
                found.append(ttft)
        return found


async def streaming_clients(base: str, lines: list[dict[str, Any]], clients: int) -> dict[str, Any]:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for line in lines:
        queue.put_nowait(line["body"])
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    tokens = 0
    async with httpx.AsyncClient(
        base_url=base, timeout=600, limits=limits, headers=HEADERS
    ) as client:

        async def run_client() -> None:
            nonlocal tokens
            while not queue.empty():
                count, _ = await stream_one(client, queue.get_nowait())
                tokens += count

        started = time.perf_counter()
        await asyncio.gather(*(run_client() for _ in range(clients)))
        wall = time.perf_counter() - started
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


async def batch_run(base: str, path: Path, probe_every: float) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, timeout=600, headers=HEADERS) as client:
        with path.open("rb") as handle:
            uploaded = await client.post(
                "/files", files={"file": ("requests.jsonl", handle)}, data={"purpose": "batch"}
            )
        file_id = uploaded.raise_for_status().json()["id"]
        started = time.perf_counter()
        created = await client.post(
            "/batches",
            json={
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        batch_id = created.raise_for_status().json()["id"]
        probes: list[float] = []
        done = asyncio.Event()

        async def probe() -> None:
            index = 20_000
            while not done.is_set():
                await asyncio.sleep(probe_every)
                if done.is_set():
                    break
                _, ttft = await stream_one(client, probe_body(index))
                index += 1
                if ttft is not None and not done.is_set():
                    probes.append(ttft)

        prober = asyncio.create_task(probe())
        while True:
            batch = (await client.get(f"/batches/{batch_id}")).raise_for_status().json()
            if batch["status"] in TERMINAL:
                break
            await asyncio.sleep(0.25)
        wall = time.perf_counter() - started
        done.set()
        await prober
    tokens = batch["usage"]["output_tokens"]
    return {
        "status": batch["status"],
        "counts": batch["request_counts"],
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "probe_ttft_s": probes,
    }


def serve_part(args: argparse.Namespace, path: Path, lines: list[dict[str, Any]]) -> dict[str, Any]:
    data = Path(tempfile.mkdtemp(prefix="batch-load-"))
    port = _free_port()
    command = [
        str(Path(sys.executable).with_name("cellbatch")), "serve", "--port", str(port),
        "--data-dir", str(data), "--quiet",
    ]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    if args.threads:
        command += ["--threads", str(args.threads)]
    server = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        base = _wait_until_serving(server, f"http://127.0.0.1:{port}", "cellbatch serve")
        idle = asyncio.run(idle_ttft(base, args.idle_probes))
        print(json.dumps({"idle_ttft_s": idle}), flush=True)
        streamed = asyncio.run(streaming_clients(base, lines, args.clients))
        print(json.dumps({"streaming_clients": streamed}), flush=True)
        batch = asyncio.run(batch_run(base, path, args.probe_every))
        print(json.dumps({"batch": batch}), flush=True)
    finally:
        server.terminate()
        server.wait(60)
    return {"idle_ttft_s": idle, "streaming": streamed, "batch": batch}


def offline_part(args: argparse.Namespace, lines: list[dict[str, Any]]) -> dict[str, Any]:
    from cellbatch.bench.vllm_driver import ANSWER_MARK
    from cellbatch.bench.vllm_peer import DRIVER, vllm_folder
    from cellbatch.model.default import default_model_path

    work = Path(tempfile.mkdtemp(prefix="batch-peer-"))
    source = work / "requests.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    threads = args.threads or os.cpu_count() or 1
    report = work / "report.json"
    command = [
        str(Path(sys.executable).with_name("cellbatch")), "run-batch", "-i", str(source),
        "-o", str(work / "cellbatch.jsonl"), "--report-json", str(report), "--quiet",
        "--threads", str(threads),
    ]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    timing = json.loads(report.read_text())["timing"]
    ours = {
        "tokens": timing["generated_tokens"],
        "run_s": timing["run_seconds"],
        "tokens_per_s": timing["tokens_per_second"],
    }
    print(json.dumps({"cellbatch run-batch": ours}), flush=True)
    if not args.vllm_python.exists():
        raise SystemExit(f"no vLLM environment at {args.vllm_python}: run `make peers`")
    folder = vllm_folder(Path(args.model) if args.model else default_model_path(), args.peer_cache)
    target = work / "vllm.jsonl"
    peer = [
        str(args.vllm_python), str(DRIVER), "run-batch", str(folder), args.peer_dtype,
        str(threads), str(args.max_seqs), str(source), str(target),
    ]  # fmt: skip
    finished = subprocess.run(
        peer, check=True, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    answer = next(
        json.loads(line[len(ANSWER_MARK) :])
        for line in finished.stdout.splitlines()
        if line.startswith(ANSWER_MARK)
    )
    tokens = sum(
        json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
        for line in target.read_text().splitlines()
    )
    theirs = {
        "tokens": tokens,
        "run_s": answer["seconds"],
        "tokens_per_s": tokens / answer["seconds"],
        "version": answer["version"],
    }
    print(json.dumps({"vllm run_batch": theirs}), flush=True)
    return {"cellbatch": ours, "vllm": theirs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--threads", type=int, help="torch threads (default: every core)")
    parser.add_argument("--idle-probes", type=int, default=12)
    parser.add_argument("--probe-every", type=float, default=2.0)
    parser.add_argument("--peer-requests", type=int, default=1000)
    parser.add_argument("--max-seqs", type=int, default=64, help="vLLM's --max-num-seqs")
    parser.add_argument("--peer-dtype", default="bfloat16")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--peer-cache", type=Path, default=DEFAULT_PEER_CACHE)
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="batch-load-file-"))
    path = work / "requests.jsonl"
    requests_file(path, args.requests, args.max_tokens)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    results: dict[str, Any] = {"requests": args.requests, "max_tokens": args.max_tokens}
    if not args.skip_serve:
        results["serve"] = serve_part(args, path, lines)
    if not args.skip_peer:
        results["offline"] = offline_part(args, lines[: args.peer_requests])
    print()
    if "serve" in results:
        serve = results["serve"]
        batch, streamed = serve["batch"], serve["streaming"]
        idle = statistics.median(serve["idle_ttft_s"])
        during = serve["batch"]["probe_ttft_s"]
        print(f"| {args.requests} chat requests x {args.max_tokens} tokens | tokens/s |")
        print("|---|---|")
        print(f"| one batch through /v1/batches | {batch['tokens_per_s']:.1f} |")
        print(f"| {args.clients} streaming clients | {streamed['tokens_per_s']:.1f} |")
        print(f"batch / streaming: {batch['tokens_per_s'] / streamed['tokens_per_s']:.2f}x")
        if during:
            median = statistics.median(during)
            p90 = sorted(during)[int(0.9 * (len(during) - 1))]
            print(
                f"TTFT p50 idle {idle * 1000:.1f} ms, during the batch {median * 1000:.1f} ms "
                f"({median / idle:.2f}x; p90 {p90 * 1000:.1f} ms, {len(during)} probes)"
            )
    if "offline" in results:
        ours, theirs = results["offline"]["cellbatch"], results["offline"]["vllm"]
        print(
            f"run-batch ({args.peer_requests} requests): cellbatch {ours['tokens_per_s']:.1f} "
            f"tokens/s, vLLM {theirs['tokens_per_s']:.1f} "
            f"({ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x)"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
