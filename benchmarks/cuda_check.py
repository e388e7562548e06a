"""The GPU check of issue 39: cellbatch's CUDA executor on one GPU, in one command, under
6 minutes on an H100 or H200, a short table printed last (docs/design.md#the-cuda-executor).

What it runs, in order (a part that fails is reported in the table and the others run):
1. memory: `cellbatch run --device cuda --report-json` in this process, first (so
   "before load" is a clean GPU): allocated and reserved bytes before load, after load and
   after generation, and the executor's graph counters.
2. parity, 32 chat prompts, greedy: graph replay against eager (bf16), token for token and
   logprob for logprob (the logits' bits); fp32 with TF32 off against transformers fp32
   on the same GPU (its padded batch), at least 30 of 32 identical and the rest parting
   only at near-ties (the top-2 gap of transformers' logits printed where they part).
3. sampler: 8 seeded prompts (temperature 0.8, top-p 0.95, top-k 50) sampled on the GPU
   and from a host copy of the same logits: the same tokens.
4. throughput: decode tokens/s at 1, 8, 32, 64 and 256 sessions, cellbatch with and without
   graphs, transformers' padded `generate` and continuous-batching `generate_batch`, on
   the default model's shape and on a random ~1B Llama (hidden 2048, 16 layers, 32 heads,
   8 KV heads, MLP 8192) built on the GPU; the device's copy bandwidth.
5. attention: SDPA over gathered cells against FlexAttention over the pool (graphs on),
   the measurement that picks the default (skipped when the time budget is spent).
Targets, printed met / not met: graphs >= 3x eager at 1 session (default model);
at 256 sessions >= 10x transformers' padded generate and >= 2x its generate_batch (bf16);
the 1B model at 256 sessions within 2x of the time its weights and KV take to read at the
measured bandwidth.

The default model's weights (SmolLM2-135M-Instruct Q4_1, 94 MiB) are more than one device
call carries (64 MiB), so by default "the default model" is its exact shape (30 layers,
hidden 576, 9 heads, 3 KV heads, tied embeddings, vocab 49,152) with random weights
(seed 0, transformers' init), built here, prompted with the 32 chat prompts' token ids
through its chat template (benchmarks/data/chat_prompt_tokens.json). `--model PATH` runs
a real checkpoint instead (its tokenizer and chat template then make the prompts).

The one call a GPU session makes (a later session, with a lease of 15 minutes):
  run(command="bash benchmarks/cuda_check.sh", carry=[".whl"], timeout_s=600)
benchmarks/cuda_check.sh installs the carried wheels (.whl/: llguidance and gguf for
Python 3.12, manylinux; download them beforehand with `bash benchmarks/cuda_check.sh
--download`, which uses the pip command of the device notes) and the checkout
(`pip install --no-deps --no-build-isolation -e .`, without the CPU kernels), then runs
this script under `timeout 560` with PYTHONUNBUFFERED=1, its log and JSON in $OUT
(cuda_check.log, cuda_check.json). What it prints last: the table, one line per check
and target.

On the CPU (`--device cpu --tiny`, what `make test` runs through
tests/benchmarks/test_cuda_check.py): the same parts on tiny random models, with the
CPU stand-in for CUDA graphs, in seconds; its figures mean nothing.

Usage: python benchmarks/cuda_check.py [--device cuda] [--tiny] [--model PATH]
       [--output-json PATH] [--budget-seconds 540]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cellbatch.bench.peers import (
    decode_sweep_point,
    left_padded,
    probe_divergences,
    transformers_continuous,
    until_stop,
)
from cellbatch.bench.report import compare
from cellbatch.engine import Engine
from cellbatch.engine.backend import ModuleBackend
from cellbatch.executor.cell_executor import ExecutorShape
from cellbatch.executor.cuda_executor import CudaExecutor, CudaOptions
from cellbatch.executor.graphs import RecordedCapture
from cellbatch.generation_config import GenConfig, SamplingParams
from cellbatch.model.loading import load_model
from cellbatch.types import Token

PROMPT_TOKENS = Path(__file__).parent / "data" / "chat_prompt_tokens.json"
SESSIONS = (1, 8, 32, 64, 256)
SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
LLAMA_1B = dict(
    vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
TINY_1B = {**TINY, "hidden_size": 128, "intermediate_size": 256, "tie_word_embeddings": False}


@dataclass(frozen=True)
class Sizes:
    """How much each part runs (the GPU's, or the tiny CPU rehearsal's)."""

    parity_prompts: int
    parity_tokens: int
    sampler_prompts: int
    sampler_tokens: int
    sessions: tuple[int, ...]
    sweep_tokens: int
    attention_sessions: tuple[int, ...]
    run_prompts: int  # `cellbatch run`'s, in the memory part
    run_tokens: int


GPU_SIZES = Sizes(32, 48, 8, 32, SESSIONS, 64, (8, 64), 32, 32)
TINY_SIZES = Sizes(6, 6, 3, 5, (1, 4), 4, (4,), 4, 4)


@dataclass
class Check:
    """The run's findings: table rows (part, figure, verdict) and the JSON."""

    started: float = field(default_factory=time.perf_counter)
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def row(self, part: str, figure: str, verdict: str = "") -> None:
        self.rows.append((part, figure, verdict))
        say(f"{part}: {figure} {verdict}".rstrip())

    def part(self, name: str, body: Callable[[], None]) -> None:
        say(f"--- {name} (at {self.elapsed():.0f} s)")
        try:
            body()
        except Exception as error:  # reported; the other parts still run
            self.failed.append(name)
            self.row(name, f"FAILED: {type(error).__name__}: {str(error)[:300]}", "FAILED")
            import traceback

            traceback.print_exc()

    def table(self) -> str:
        width = max(len(part) for part, _, _ in self.rows) if self.rows else 10
        lines = [f"{'check':<{width}}  {'result':<8}  figures"]
        for part, figure, verdict in self.rows:
            lines.append(f"{part:<{width}}  {verdict:<8}  {figure}")
        return "\n".join(lines)


def say(message: str) -> None:
    print(f"cuda_check: {message}", file=sys.stderr, flush=True)


def verdict(met: bool) -> str:
    return "met" if met else "NOT MET"


# -- models ------------------------------------------------------------------------------


def random_llama(shape: dict[str, Any], folder: Path, dtype: torch.dtype, device: str) -> Any:
    """A Llama of `shape` with transformers' random init (seed 0), saved to `folder`;
    returns the transformers model (on `device`, in `dtype`)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = None  # sweeps generate exactly their budget
    model.save_pretrained(folder, safe_serialization=True)
    return model.eval()


def transformers_from(folder: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    from cellbatch.model.loading import locate_model

    files = locate_model(folder)
    extra = {"gguf_file": files.path.name} if files.kind == "gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(str(files.folder), dtype=dtype, **extra)
    return model.to(device).eval()


class StandInBackend(ModuleBackend):
    """On the CPU: the CUDA executor with the CPU stand-in for graphs (RecordedCapture)."""

    def executor(
        self, shape: ExecutorShape, constraints: Any = None, drafter: Any = None
    ) -> CudaExecutor:
        assert self.cuda is not None
        capture = RecordedCapture() if self.cuda.cuda_graph else None
        return CudaExecutor(
            self.module, self.config, shape, self.cuda, constraints, capture, drafter
        )


def engine_over(module: Any, config: Any, options: CudaOptions, **shape: Any) -> Engine:
    device = module.norm.weight.device
    kind = ModuleBackend if device.type == "cuda" else StandInBackend
    return Engine(kind(module, config, options), None, **_shape(shape))


def _shape(shape: dict[str, Any]) -> dict[str, Any]:
    from cellbatch.engine.limits import EngineShape

    return {"shape": EngineShape(**shape)}


@dataclass
class Workload:
    """What every part runs on: the default model's folder, its prompts and stop tokens."""

    folder: Path
    prompts: list[list[Token]]
    stop: frozenset[Token]
    pad: Token
    random_weights: bool


def workload(options: argparse.Namespace, scratch: Path) -> Workload:
    if options.model is not None:
        from cellbatch.bench.workload import CHAT_PROMPTS
        from cellbatch.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(options.model)
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": text}])
            for text in CHAT_PROMPTS
        ]
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        return Workload(options.model, prompts, tokenizer.stop_tokens, pad, False)
    folder = scratch / "default-shape"
    if options.tiny:
        random_llama(TINY, folder, torch.float32, "cpu")
        generator = torch.Generator().manual_seed(1)
        prompts = [
            torch.randint(3, TINY["vocab_size"], (int(n),), generator=generator).tolist()
            for n in torch.randint(3, 40, (32,), generator=generator)
        ]
        return Workload(folder, prompts, frozenset({2}), 2, True)
    random_llama(SMOLLM2, folder, torch.float32, "cpu")
    data = json.loads(PROMPT_TOKENS.read_text())
    return Workload(
        folder, data["prompts"], frozenset(data["stop_tokens"]), data["pad_token"], True
    )


# -- the parts -----------------------------------------------------------------------------


def memory_part(check: Check, work: Workload, device: str, scratch: Path, sizes: Sizes) -> None:
    """`cellbatch run` with the report: its memory figures and executor counters."""
    from cellbatch.cli import main

    prompts_file = scratch / "prompts.txt"
    lines = [" ".join(map(str, p)) for p in work.prompts[: sizes.run_prompts]]
    prompts_file.write_text("\n".join(lines) + "\n")
    tokens = sizes.run_tokens
    report_file = scratch / "run-report.json"
    argv = ["run", "--device", device, "--model", str(work.folder), "--quiet"]
    argv += ["--prompt-tokens-file", str(prompts_file), "--max-new-tokens", str(tokens)]
    argv += ["--report-json", str(report_file)]
    with contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    if status not in (0, 1):
        raise RuntimeError(f"cellbatch run exited {status}")
    report = json.loads(report_file.read_text())
    memory = report["memory"]
    check.data["memory"] = memory
    check.data["run_cuda"] = report.get("cuda")
    mib = 2**20
    if "cuda_allocated_bytes" not in memory["after_load"]:
        figures = ", ".join(
            f"{stage} RSS {memory[stage]['rss_bytes'] / mib:.0f}"
            for stage in ("before_load", "after_load", "after_generate")
        )
        check.row("run report memory (MiB)", figures + " (no GPU: no CUDA figures)", "ok")
        return
    figures = ", ".join(
        f"{stage.replace('_', ' ')} {memory[stage]['cuda_allocated_bytes'] / mib:.0f}/"
        f"{memory[stage]['cuda_reserved_bytes'] / mib:.0f}"
        for stage in ("before_load", "after_load", "after_generate")
    )
    graphs = report["cuda"]["graphs"]
    check.row(
        "run report GPU memory (MiB alloc/reserved)",
        f"{figures}; graphs {graphs['captures']} captured, {graphs['replays']} replays",
        "ok",
    )


def greedy(engine: Engine, prompts: Sequence[Sequence[Token]], tokens: int, stop: frozenset[Token],
           logprobs: bool = False) -> list[Any]:  # fmt: skip
    """Every prompt on a session of its own, all at once: tokens (with their logprobs)."""
    sampling = SamplingParams(logprobs=0) if logprobs else SamplingParams()
    config = GenConfig(max_new_tokens=tokens, stop_tokens=stop, sampling=sampling)
    sessions = [engine.open_session() for _ in prompts]
    try:
        handles = [
            s.generate_async(list(p), config) for s, p in zip(sessions, prompts, strict=True)
        ]
        for handle in handles:
            handle.wait()
    finally:
        for session in sessions:
            session.close()
    bad = [h.error() for h in handles if h.error()]
    if bad:
        raise RuntimeError(f"{len(bad)} generations failed: {bad[0]}")
    if logprobs:
        return [(h.tokens(), [entry.logprob for entry in h.logprobs()]) for h in handles]
    return [h.tokens() for h in handles]


def parity_part(check: Check, work: Workload, device: str, sizes: Sizes) -> None:
    prompts = work.prompts[: sizes.parity_prompts]
    count, tokens = len(prompts), sizes.parity_tokens
    config, module = load_model(work.folder, "bfloat16", "auto", "auto", device=device)
    runs = []
    for graphs in (True, False):
        with engine_over(module, config, CudaOptions(cuda_graph=graphs), max_sessions=count) as e:
            runs.append(greedy(e, prompts, tokens, work.stop, logprobs=True))
    same = sum(a == b for a, b in zip(*runs, strict=True))
    check.data["graph_vs_eager_identical"] = same
    check.row(
        "greedy bf16: graph replay = eager (tokens, logprobs)",
        f"{same}/{count} identical",
        verdict(same == count),
    )
    del module

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    config, module = load_model(work.folder, "float32", "auto", "auto", device=device)
    with engine_over(module, config, CudaOptions(), max_sessions=count) as engine:
        ours = greedy(engine, prompts, tokens, work.stop)
    del module
    reference_model = transformers_from(work.folder, torch.float32, device)
    ids, mask = left_padded(prompts, work.pad)
    from transformers import GenerationConfig

    generation = GenerationConfig(
        max_new_tokens=tokens, do_sample=False, eos_token_id=sorted(work.stop),
        pad_token_id=work.pad,
    )  # fmt: skip
    with torch.inference_mode():
        out = reference_model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=generation
        )
    theirs = [until_stop(row, work.stop) for row in out[:, ids.shape[1] :].tolist()]
    agreement = compare(ours, theirs)
    probe_divergences(reference_model, prompts, theirs, agreement)
    del reference_model
    parts = "; ".join(
        f"prompt {d.prompt} token {d.index}: top-2 gap {d.top2_gap:.2g}"
        + ("" if d.ours_in_top2 else " (ours not in top 2)")
        for d in agreement.divergences
    )
    needed = math.ceil(count * 30 / 32)
    near_ties = all(d.near_tie for d in agreement.divergences)
    check.data["fp32_vs_transformers"] = {
        "identical": agreement.identical,
        "prompts": count,
        "divergences": [vars(d) for d in agreement.divergences],
    }
    check.row(
        "greedy fp32 (TF32 off) = transformers fp32",
        f"{agreement.identical}/{count} identical" + (f"; {parts}" if parts else ""),
        verdict(agreement.identical >= needed and near_ties),
    )
    _free(device)


def sampler_part(check: Check, work: Workload, device: str, sizes: Sizes) -> None:
    prompts = work.prompts[: sizes.sampler_prompts]
    config, module = load_model(work.folder, "bfloat16", "auto", "auto", device=device)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, top_k=50)
    gen = GenConfig(max_new_tokens=sizes.sampler_tokens, sampling=sampling, seed=1234,
                    stop_tokens=work.stop)  # fmt: skip
    runs = []
    for on_host in (False, True):
        options = CudaOptions(sample_on_host=on_host)
        with engine_over(module, config, options, max_sessions=len(prompts)) as engine:
            runs.append([r.tokens for r in engine.generate(prompts, gen, share_prefix=False)])
    same = sum(a == b for a, b in zip(*runs, strict=True))
    check.data["sampler_identical"] = same
    check.row(
        "device sampler = host sampler (seeded)",
        f"{same}/{len(prompts)} prompts identical",
        verdict(same == len(prompts)),
    )
    del module
    _free(device)


def bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves, reads and writes counted."""
    if not device.startswith("cuda"):
        return 0.0
    size = 1 << 30
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del source, target
    return 2 * size * 10 / seconds


def transformers_rate(model: Any, kind: str, prompts: Sequence[Sequence[Token]], tokens: int,
                      pad: Token) -> float:  # fmt: skip
    """Generated tokens per second of transformers' padded `generate` or `generate_batch`."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=tokens, do_sample=False, pad_token_id=pad,
                              eos_token_id=None)  # fmt: skip
    device = model.device

    def padded(batch: Sequence[Sequence[Token]], new: int) -> int:
        ids, mask = left_padded(batch, pad)
        config.max_new_tokens = new
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 generation_config=config)  # fmt: skip
        return (out.shape[1] - ids.shape[1]) * len(batch)

    def continuous(batch: Sequence[Sequence[Token]], new: int) -> int:
        config.max_new_tokens = new
        outputs = transformers_continuous(model, batch, config, frozenset(), 2048)
        return sum(len(row) for row in outputs)

    run = padded if kind == "padded" else continuous
    run(prompts[:2], 4)  # warm-up
    _sync(str(device))
    started = time.perf_counter()
    generated = run(prompts, tokens)
    _sync(str(device))
    return generated / (time.perf_counter() - started)


def sweep_part(check: Check, name: str, folder: Path, hf_model: Any, work: Workload,
               device: str, sizes: Sizes) -> dict[str, Any]:  # fmt: skip
    """cellbatch with and without graphs, and transformers, at each session count."""
    config, module = load_model(folder, "bfloat16", "auto", "auto", device=device)
    figures: dict[str, Any] = {"sessions": list(sizes.sessions)}
    widest = max(sizes.sessions)
    for graphs in (True, False):
        label = "graphs" if graphs else "eager"
        options = CudaOptions(cuda_graph=graphs)
        with engine_over(module, config, options, max_sessions=widest) as engine:
            decode_sweep_point(engine, work.prompts, 1, 2)  # warm-up
            points = [
                decode_sweep_point(engine, work.prompts, s, sizes.sweep_tokens)
                for s in sizes.sessions
            ]
            figures[f"cellbatch_{label}"] = [p.window.decode_only_tokens_per_s for p in points]
            figures[f"cellbatch_{label}_wall"] = [
                s * sizes.sweep_tokens / p.window.wall_seconds if p.window.wall_seconds else 0.0
                for s, p in zip(sizes.sessions, points, strict=True)
            ]
            if graphs:
                figures["weights_bytes"] = engine.weights_bytes
                figures["bytes_per_cell"] = engine.kv_usage().bytes_per_cell
                figures["executor"] = engine.executor.stats()  # type: ignore[attr-defined]
    del module
    _free(device)
    for kind in ("padded", "generate_batch"):
        rates = []
        for sessions in sizes.sessions:
            batch = [work.prompts[i % len(work.prompts)] for i in range(sessions)]
            try:
                rates.append(transformers_rate(hf_model, kind, batch, sizes.sweep_tokens, work.pad))
            except Exception as error:  # the other counts and kinds still run
                say(f"transformers {kind} at {sessions} sessions failed: {error}")
                rates.append(0.0)
        figures[f"transformers_{kind}"] = rates
    for key in ("cellbatch_graphs", "cellbatch_eager", "transformers_padded",
                "transformers_generate_batch"):  # fmt: skip
        check.row(
            f"{name}: {key.replace('_', ' ')} tok/s",
            " ".join(f"{s}:{r:.0f}" for s, r in zip(sizes.sessions, figures[key], strict=True)),
        )
    check.data[name] = figures
    return figures


def targets(check: Check, default: dict[str, Any] | None, big: dict[str, Any] | None,
            work: Workload, sizes: Sizes, band: float) -> None:  # fmt: skip
    if default is not None:
        one = sizes.sessions.index(1)
        eager = default["cellbatch_eager"][one]
        ratio = default["cellbatch_graphs"][one] / eager if eager else 0.0
        check.row("target: graphs >= 3x eager at 1 session", f"{ratio:.2f}x", verdict(ratio >= 3))
        most = len(sizes.sessions) - 1
        ours = default["cellbatch_graphs_wall"][most]
        for kind, floor in (("padded", 10), ("generate_batch", 2)):
            theirs = default[f"transformers_{kind}"][most]
            ratio = ours / theirs if theirs else 0.0
            check.row(
                f"target: {sizes.sessions[most]} sessions >= {floor}x transformers {kind}",
                f"{ratio:.2f}x ({ours:.0f} vs {theirs:.0f} tok/s)",
                verdict(ratio >= floor),
            )
    if big is not None and band > 0:
        most = len(sizes.sessions) - 1
        sessions = sizes.sessions[most]
        rate = big["cellbatch_graphs"][most]
        step = sessions / rate if rate else math.inf
        prompt = sum(len(work.prompts[i % len(work.prompts)]) for i in range(sessions)) / sessions
        context = prompt + 1 + sizes.sweep_tokens / 2  # the turn's mean context
        read = big["weights_bytes"] + sessions * context * big["bytes_per_cell"]
        floor = read / band
        ratio = step / floor
        check.data["bandwidth_target"] = {"bandwidth": band, "bytes_per_step": read,
                                          "step_seconds": step, "floor_seconds": floor}  # fmt: skip
        check.row(
            f"target: 1B at {sessions} sessions within 2x of weights+KV read",
            f"step {step * 1e3:.2f} ms vs {read / 2**30:.2f} GiB at {band / 1e12:.2f} TB/s = "
            f"{floor * 1e3:.2f} ms: {ratio:.2f}x",
            verdict(ratio <= 2),
        )


def attention_part(check: Check, work: Workload, device: str, sizes: Sizes) -> None:
    config, module = load_model(work.folder, "bfloat16", "auto", "auto", device=device)
    figures = {}
    for kind in ("sdpa", "flex"):
        with engine_over(module, config, CudaOptions(attention=kind),
                         max_sessions=max(sizes.attention_sessions)) as engine:  # fmt: skip
            decode_sweep_point(engine, work.prompts, 2, 2)  # warm-up (FlexAttention compiles)
            figures[kind] = [
                decode_sweep_point(
                    engine, work.prompts, s, sizes.sweep_tokens
                ).window.decode_only_tokens_per_s
                for s in sizes.attention_sessions
            ]
    check.data["attention"] = figures
    best = max(figures, key=lambda kind: sum(figures[kind]))
    check.row(
        "attention: decode tok/s sdpa vs flex",
        "; ".join(
            f"{s} sessions {figures['sdpa'][i]:.0f} vs {figures['flex'][i]:.0f}"
            for i, s in enumerate(sizes.attention_sessions)
        ),
        f"{best} wins",
    )
    del module
    _free(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# -- the run --------------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cuda_check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (the check), or cpu with --tiny")
    parser.add_argument("--tiny", action="store_true", help="tiny random models (a rehearsal)")
    parser.add_argument("--model", type=Path, help="a real checkpoint for the default model")
    parser.add_argument("--output-json", type=Path, help="default $OUT/cuda_check.json")
    parser.add_argument(
        "--budget-seconds", type=float, default=540, help="skip the optional parts past this"
    )
    options = parser.parse_args(argv)
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --device cpu --tiny for the CPU rehearsal")
    return options


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    sizes = TINY_SIZES if options.tiny else GPU_SIZES
    device = options.device
    check = Check()
    import transformers

    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    check.data["environment"] = {
        "device": where, "torch": torch.__version__, "transformers": transformers.__version__,
        "tiny": options.tiny,
    }  # fmt: skip
    say(f"{where}, torch {torch.__version__}, transformers {transformers.__version__}")
    with tempfile.TemporaryDirectory(prefix="cuda-check-") as folder:
        scratch = Path(folder)
        work = workload(options, scratch)
        check.data["default_model"] = (
            f"{work.folder} (random weights)" if work.random_weights else str(work.folder)
        )
        check.part("memory", lambda: memory_part(check, work, device, scratch, sizes))
        check.part("parity", lambda: parity_part(check, work, device, sizes))
        check.part("sampler", lambda: sampler_part(check, work, device, sizes))
        band = bandwidth(device)
        check.data["bandwidth_bytes_per_s"] = band
        found: dict[str, dict[str, Any] | None] = {"default": None, "1b": None}

        def default_sweep() -> None:
            hf = transformers_from(work.folder, torch.bfloat16, device)
            found["default"] = sweep_part(check, "default", work.folder, hf, work, device, sizes)

        def big_sweep() -> None:
            big_folder = scratch / "llama-1b"
            hf = random_llama(TINY_1B if options.tiny else LLAMA_1B, big_folder,
                              torch.bfloat16, device)  # fmt: skip
            found["1b"] = sweep_part(check, "1B", big_folder, hf, work, device, sizes)

        check.part("throughput, default model", default_sweep)
        _free(device)
        check.part("throughput, 1B model", big_sweep)
        _free(device)
        check.part(
            "targets",
            lambda: targets(check, found["default"], found["1b"], work, sizes, band),
        )
        if check.elapsed() < options.budget_seconds * 0.7:
            check.part("attention", lambda: attention_part(check, work, device, sizes))
        else:
            check.row("attention: sdpa vs flex", f"skipped at {check.elapsed():.0f} s", "skipped")
    output = options.output_json or Path(os.environ.get("OUT", "benchmarks/results")) / (
        "cuda_check.json"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    check.data["rows"] = check.rows
    check.data["seconds"] = check.elapsed()
    output.write_text(json.dumps(check.data, indent=2, default=str) + "\n")
    print(f"== cuda_check: {where}, {check.elapsed():.0f} s, JSON in {output} ==")
    print(check.table())
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
