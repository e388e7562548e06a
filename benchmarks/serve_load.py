"""Load on `cellbatch serve`: requests/s, TTFT, inter-token latency and aggregate tokens/s
at several numbers of concurrent streaming clients, against offline `Engine.generate` on
the same prompts and, optionally, any other OpenAI-compatible server (llama.cpp's, say).

    python benchmarks/serve_load.py                       # default model, 1/8/32/64 clients
    python benchmarks/serve_load.py --clients 1,8 --requests 16 --max-tokens 32
    python benchmarks/serve_load.py --peer http://127.0.0.1:8080/v1 --peer-name llama.cpp
    python benchmarks/serve_load.py --clients 1,32 --peer vllm   # vLLM's CPU build (make peers)
    python benchmarks/serve_load.py --servers 1x2,2x1 --clients 32,64   # replicas on Ray

Each client sends its requests one after another (streaming chat completions, greedy,
the chat benchmark's prompts in turn); a level's figures cover every request of every
client. The offline baseline runs before the server starts, in this process, on the same
prompts and token budget, so that the two never share the CPU. `--servers` measures
several servers in turn, one after another: `plain` is `cellbatch serve` (with
`--threads`), `RxT` is `cellbatch serve --replicas R --threads-per-replica T` on a local
Ray instance. `--peer vllm` starts `vllm serve` from the virtualenv `make peers` builds,
on the same model, threads and session count, after cellbatch's servers are done. The
load generator shares the machine with the server, so it is plain httpx and json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cellbatch.bench.results import (
    Headline,
    Results,
    ResultTable,
    command_line,
    machine,
    results_fields,
)
from cellbatch.bench.workload import CHAT_PROMPTS, DEFAULT_PEER_CACHE, DEFAULT_VLLM_PYTHON
from cellbatch.types import ACTIVATION_CHOICES, QUANTIZE_CHOICES

STARTUP_TIMEOUT_S = 300.0
# The offline baseline is one batch of a few seconds: the best of this many runs, so that
# one slow run on a shared machine does not flatter the server's ratio.
OFFLINE_ROUNDS = 3


@dataclass
class Level:
    """One server at one concurrency."""

    server: str
    clients: int
    requests: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    counted_from_deltas: int = 0  # requests whose tokens were counted from their deltas
    # CPU time of the server's own process (with replicas, the front alone: HTTP,
    # tokenizing, routing, streaming); None where /proc cannot tell.
    server_cpu_s: float | None = None
    client_cpu_s: float = 0.0  # this load generator's own CPU time over the level

    def summary(self) -> dict[str, float | int | str]:
        cpu = self.server_cpu_s
        return {
            "server": self.server,
            "clients": self.clients,
            "requests": self.requests,
            "requests_per_s": self.requests / self.wall_s,
            "tokens_per_s": self.generated_tokens / self.wall_s,
            "tokens_per_request": self.generated_tokens / max(1, self.requests),
            "counted_from_deltas": self.counted_from_deltas,
            "ttft_p50_ms": 1000 * _percentile(self.ttft_s, 50),
            "ttft_p99_ms": 1000 * _percentile(self.ttft_s, 99),
            "itl_p50_ms": 1000 * _percentile(self.itl_s, 50),
            "itl_p99_ms": 1000 * _percentile(self.itl_s, 99),
            "server_cpu_ms_per_token": float("nan")
            if cpu is None or not self.generated_tokens
            else 1000 * cpu / self.generated_tokens,
            "client_cpu_share": self.client_cpu_s / self.wall_s,
        }


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _one_request(client: httpx.AsyncClient, model: str, prompt: str, args, level: Level):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for attempt in (1, 2):
        started = time.perf_counter()
        answered = False
        try:
            async with client.stream("POST", "/chat/completions", json=body) as response:
                answered = True
                tokens, deltas, ttft, itl = await _read_events(response, started)
            break
        except httpx.RemoteProtocolError:
            # A kept-alive connection the server had closed before answering (llama-server
            # closes one after a few requests): the request goes once more.
            if answered or attempt == 2:
                raise
    level.ttft_s.extend(ttft)
    level.itl_s.extend(itl)
    level.requests += 1
    # A server that sends no usage chunk (llama-cpp-python's ignores include_usage) is
    # counted by its content deltas: one per token where it streams token by token.
    level.generated_tokens += tokens if tokens else deltas
    level.counted_from_deltas += 0 if tokens else 1


async def _read_events(
    response: httpx.Response, started: float
) -> tuple[int, int, list[float], list[float]]:
    """A streamed answer's (usage tokens or 0, content deltas, TTFT, inter-token gaps)."""
    if response.status_code != 200:
        await response.aread()
        raise SystemExit(f"{response.status_code} from the server: {response.text}")
    tokens = deltas = 0
    last = None
    ttft: list[float] = []
    itl: list[float] = []
    # Server-sent events, one `data: {json}` line each (the OpenAI stream's framing).
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        now = time.perf_counter()
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        choices = chunk.get("choices")
        if choices and (choices[0].get("delta") or {}).get("content"):
            deltas += 1
            if last is None:
                ttft.append(now - started)
            else:
                itl.append(now - last)
            last = now
    return tokens, deltas, ttft, itl


def _served_model(base_url: str) -> str:
    """The first name the server answers to (it refuses a model it does not serve)."""
    return str(httpx.get(f"{base_url}/models", timeout=30).json()["data"][0]["id"])


async def _run_level(base_url: str, name: str, model: str, clients: int, args) -> Level:
    """Every client's requests, one after another per client; the clients share one
    connection pool. The load generator shares the CPU with the server, so it is kept
    lean: plain httpx and json (about 5% of one of the two cores at 32 clients), not the
    openai package's typed chunks (about 20%)."""
    level = Level(name, clients)
    per_client = max(1, args.requests // clients) if args.requests else 2
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"Authorization": "Bearer bench"}
    async with httpx.AsyncClient(
        base_url=base_url, timeout=600, limits=limits, headers=headers
    ) as client:

        async def run_client(index: int) -> None:
            for turn in range(per_client):
                prompt = CHAT_PROMPTS[(index * per_client + turn) % len(CHAT_PROMPTS)]
                await _one_request(client, model, prompt, args, level)

        cpu_before = time.process_time()
        started = time.perf_counter()
        await asyncio.gather(*(run_client(i) for i in range(clients)))
        level.wall_s = time.perf_counter() - started
        level.client_cpu_s = time.process_time() - cpu_before
    return level


def _measure(base_url: str, name: str, model: str, args, pid: int | None = None) -> list[Level]:
    """A warm-up, then each concurrency level, printed as it ends; with `pid`, each
    level's CPU time of that server process too."""
    warm_up = argparse.Namespace(**{**vars(args), "requests": 2})
    asyncio.run(_run_level(base_url, name, model, 2, warm_up))
    levels = []
    for clients in args.levels:
        before = None if pid is None else _cpu_seconds(pid)
        level = asyncio.run(_run_level(base_url, name, model, clients, args))
        after = None if pid is None else _cpu_seconds(pid)
        if before is not None and after is not None:
            level.server_cpu_s = after - before
        print(json.dumps(level.summary()), flush=True)
        levels.append(level)
    return levels


def _offline(args, prompts: list[str]) -> dict[str, float]:
    from cellbatch.engine import Engine
    from cellbatch.generation_config import GenConfig

    with Engine.from_pretrained(
        args.model,
        dtype=args.dtype,
        quantize=args.quantize,
        activations=args.activations,
        threads=args.threads,
        max_sessions=len(prompts),
    ) as engine:
        engine.chat(prompts[:4], GenConfig(max_new_tokens=4))  # warm-up
        walls = []
        for _ in range(OFFLINE_ROUNDS):
            started = time.perf_counter()
            results = engine.chat(prompts, GenConfig(max_new_tokens=args.max_tokens))
            walls.append(time.perf_counter() - started)
    tokens = sum(len(result.tokens) for result in results)
    wall = min(walls)
    return {"prompts": len(prompts), "tokens_per_s": tokens / wall, "wall_s": wall}


def _server_name(config: str) -> str:
    return "cellbatch serve" if config == "plain" else f"serve ray {config}"


def _start_server(args, config: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    command = [
        str(Path(sys.executable).with_name("cellbatch")), "serve", "--port", str(port),
        "--dtype", args.dtype, "--quantize", args.quantize, "--activations", args.activations,
        "--max-sessions", str(max(args.levels)), "--quiet",
    ]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    if config != "plain":
        replicas, threads = config.split("x")
        command += ["--replicas", replicas, "--threads-per-replica", threads]
    elif args.threads:
        command += ["--threads", str(args.threads)]
    server = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return server, _wait_until_serving(server, f"http://127.0.0.1:{port}", "cellbatch serve")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_until_serving(server: subprocess.Popen, base: str, name: str) -> str:
    """The server's /v1 URL once its /health answers 200."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if server.poll() is not None:
            raise SystemExit(f"{name} exited with {server.returncode}")
        try:
            if httpx.get(base + "/health").status_code == 200:
                return base + "/v1"
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            raise SystemExit(f"{name} did not come up in {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.5)


def _start_vllm(args) -> tuple[subprocess.Popen, str]:
    """vLLM's CPU build serving the same model (the folder the throughput benchmark's
    peer reads) from `make peers`' virtualenv, on the same threads."""
    from cellbatch.bench.vllm_peer import DRIVER, vllm_folder
    from cellbatch.model.default import default_model_path

    if not args.vllm_python.exists():
        raise SystemExit(f"no vLLM environment at {args.vllm_python}: run `make peers`")
    folder = vllm_folder(Path(args.model) if args.model else default_model_path(), args.peer_cache)
    port = _free_port()
    threads = args.threads or os.cpu_count() or 1
    command = [
        str(args.vllm_python), str(DRIVER), "serve", str(folder), args.peer_dtype,
        str(threads), str(port), str(max(args.levels)),
    ]  # fmt: skip
    server = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return server, _wait_until_serving(server, f"http://127.0.0.1:{port}", "vllm serve")


def main(argv: list[str] | None = None) -> int:
    argv_given = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model path (default: the embedded SmolLM2-135M)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="activations' dtype, server and offline baseline alike (as `cellbatch serve`)",
    )
    parser.add_argument(
        "--quantize",
        default="auto",
        choices=QUANTIZE_CHOICES,
        help="weight format, for the server and the offline baseline alike (as `cellbatch serve`)",
    )
    parser.add_argument(
        "--activations",
        default="auto",
        choices=ACTIVATION_CHOICES,
        help="inputs of the int4 products, for the server and the offline baseline alike (as "
        "`cellbatch serve`)",
    )
    parser.add_argument("--threads", type=int)
    parser.add_argument("--clients", default="1,8,32,64", help="concurrency levels")
    parser.add_argument("--requests", type=int, default=64, help="requests per level (total)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--peer",
        help="another OpenAI-compatible server's /v1 URL, or `vllm`: vLLM's CPU build "
        "(`make peers`) started here on the same model and threads",
    )
    parser.add_argument("--peer-dtype", default="bfloat16", help="--peer vllm: its dtype")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--peer-cache", type=Path, default=DEFAULT_PEER_CACHE)
    parser.add_argument("--peer-name", default="peer")
    parser.add_argument("--peer-model", default="default")
    parser.add_argument(
        "--servers",
        default="plain",
        help="servers to measure in turn: plain (cellbatch serve) and/or RxT (R replicas x T "
        "threads on a local Ray), comma-separated; empty for --peer alone",
    )
    parser.add_argument("--no-offline", action="store_true", help="skip the offline baseline")
    parser.add_argument(
        "--offline-prompts", type=int, default=32, help="prompts of the offline baseline"
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="write the figures here (docs/results/serve_load.json publishes them)",
    )
    args = parser.parse_args(argv_given)
    args.levels = [int(part) for part in args.clients.split(",")]
    if args.peer == "vllm" and args.peer_name == "peer":
        args.peer_name = f"vllm serve {args.peer_dtype}"
    if any(level < 1 for level in args.levels) or args.max_tokens < 1:
        parser.error("--clients levels and --max-tokens must be >= 1")
    args.configs = [config for config in args.servers.split(",") if config]
    for config in args.configs:
        counts = config.split("x")
        if config != "plain" and not (
            len(counts) == 2 and all(c.isdigit() and int(c) >= 1 for c in counts)
        ):
            parser.error(f"--servers takes plain or RxT (say 2x1), got {config!r}")

    figures: dict[str, object] = {"config": {k: v for k, v in vars(args).items() if k != "json"}}
    prompts = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(args.offline_prompts)]
    if not args.no_offline:
        figures["offline"] = _offline(args, prompts)
        print(f"offline Engine.chat, {len(prompts)} prompts: {figures['offline']}", flush=True)
    levels: list[Level] = []
    for config in args.configs:
        server, base = _start_server(args, config)
        try:
            levels += _measure(base, _server_name(config), _served_model(base), args, server.pid)
        finally:
            server.terminate()
            server.wait(60)
    if args.peer:
        peer: subprocess.Popen | None = None
        url, name, model = args.peer, args.peer_name, args.peer_model
        if args.peer == "vllm":
            peer, url = _start_vllm(args)
            model = "vllm-peer"
        try:
            levels += _measure(url, name, model, args)
        finally:
            if peer is not None:
                peer.terminate()
                peer.wait(60)
    figures["levels"] = [level.summary() for level in levels]
    figures["raw"] = [asdict(level) for level in levels]
    print(
        f"{'server':<20} {'clients':>7} {'req/s':>7} {'tok/s':>8} {'tok/req':>7} "
        f"{'TTFT p50/p99 ms':>18} {'ITL p50/p99 ms':>16} {'server CPU ms/token':>19}"
    )
    for level in levels:
        row = level.summary()
        print(
            f"{row['server']:<20} {row['clients']:>7} {row['requests_per_s']:>7.2f} "
            f"{row['tokens_per_s']:>8.1f} {row['tokens_per_request']:>7.1f} "
            f"{row['ttft_p50_ms']:>8.0f}/{row['ttft_p99_ms']:<9.0f} "
            f"{row['itl_p50_ms']:>7.1f}/{row['itl_p99_ms']:<8.1f} "
            f"{row['server_cpu_ms_per_token']:>19.2f}"
        )
    # Each other server against the first one, level by level (measured in the same run).
    names = [_server_name(config) for config in args.configs]
    names += [args.peer_name] if args.peer else []
    first = {level.clients: level.summary() for level in levels if level.server == names[0]}
    for level in levels:
        if level.server in names[1:] and level.clients in first:
            row, peer = level.summary(), first[level.clients]
            print(
                f"{row['server']} / {names[0]} at {level.clients} clients: tokens/s "
                f"{row['tokens_per_s'] / peer['tokens_per_s']:.2f}, TTFT p50 "  # type: ignore[operator]
                f"{row['ttft_p50_ms'] / peer['ttft_p50_ms']:.2f}"  # type: ignore[operator]
            )
    if "offline" in figures:
        offline = figures["offline"]["tokens_per_s"]  # type: ignore[index]
        for level in levels:
            if level.server == "cellbatch serve" and level.clients == args.offline_prompts:
                share = level.summary()["tokens_per_s"] / offline  # type: ignore[operator]
                print(f"serve at {level.clients} clients / offline Engine.chat: {share:.2f}")
    if args.json is not None:
        published = _published(args, levels, names, figures.get("offline"), argv_given)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({**results_fields(published), **figures}, indent=2, default=str)
        args.json.write_text(text + "\n")
    return 0


def _published(
    args: argparse.Namespace,
    levels: list[Level],
    names: list[str],
    offline: object,
    argv: list[str],
) -> Results:
    """The tables and headline figures the docs show of this run: every server at every
    level, and cellbatch against each other server at the levels both ran."""
    rows = []
    for level in levels:
        row = level.summary()
        rows.append(
            (
                row["server"],
                row["clients"],
                row["tokens_per_s"],
                row["ttft_p50_ms"],
                row["itl_p50_ms"],
                row["requests_per_s"],
            )
        )
    tables = [
        ResultTable(
            caption=f"streaming chat clients, {args.requests} requests per level, at most "
            f"{args.max_tokens} new tokens each, greedy",
            columns=("server", "clients", "tokens/s", "TTFT p50 ms", "ITL p50 ms", "requests/s"),
            rows=rows,
        )
    ]
    if isinstance(offline, dict):
        tables[0] = dataclasses.replace(
            tables[0],
            note=f"Offline `Engine.chat` on {args.offline_prompts} of the same prompts, in the "
            f"same run: {offline['tokens_per_s']:.1f} tokens/s.",
        )
    ours = {level.clients: level for level in levels if level.server == "cellbatch serve"}
    headline = [
        Headline(
            f"`cellbatch serve`, {level.clients} streaming client"
            + ("s" if level.clients > 1 else ""),
            ours[level.clients].summary()["tokens_per_s"],  # type: ignore[arg-type]
            level.server,
            level.summary()["tokens_per_s"],  # type: ignore[arg-type]
        )
        for level in levels
        if args.peer and level.server == args.peer_name and level.clients in ours
    ]
    return Results(
        benchmark=args.json.stem,
        title="Serving (benchmarks/serve_load.py)",
        command=command_line("python benchmarks/serve_load.py", argv),
        tables=tables,
        headline=headline,
        machine=machine(args.threads),
    )


if __name__ == "__main__":
    sys.exit(main())
