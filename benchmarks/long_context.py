"""Long prompts and long contexts: cellbatch against transformers in one run (issue 14).

Three parts, all on the default model (or --model), one dtype, one thread count:

- prefill: prompt tokens/s for 1 x 500, 1 x 2,000, 1 x 4,000 and 8 x 1,000 tokens, each
  prompt with 1 new token: transformers' one forward (SDPA, logits of the last position
  only), transformers `generate` with 1 new token, and cellbatch `Engine.generate` (no prefix
  sharing: the prompts share none). The first tokens of cellbatch and `generate` are compared.
- decode: decode-only tokens/s of 1, 8 and 32 sessions holding 2,000 tokens of context each:
  cellbatch (the engine's decode-only steps) against transformers' batched `generate`
  continuing from a cache already filled with the same contexts.
- profile: one packed step of the model (no engine) under torch's profiler: 32 decodes at
  128 and at 2,000 tokens of context, and a 512-token prompt chunk whose context ends at 128
  and at 2,000; the share of attention, of the matrix products and of the rest, and the time
  the cache takes to build the step's attention plan.

Prompts join the tokens of the throughput benchmark's chat prompts (chat template applied),
each prompt starting at another place of that stream, so that no two share a prefix.
bf16 runs only where the CPU has native bf16 products (it is skipped, saying so, elsewhere).

Each peer is timed right beside the others on the same workload (best of --repeats, the
order alternating), as the machine's load drifts.

Usage: .venv/bin/python benchmarks/long_context.py [--dtype float32] [--threads N] [--quick]
       [--skip prefill|decode|profile|transformers] [--repeats N] [--max-prefill-chunk N]
       [--max-batch-tokens N] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cellbatch.bench.peers import load_transformers_model
from cellbatch.bench.workload import CHAT_PROMPTS
from cellbatch.cache import CellCache
from cellbatch.engine import DEFAULT_MAX_BATCH_TOKENS
from cellbatch.generation_config import GenConfig
from cellbatch.kv_pool import KVPool
from cellbatch.model.cpu import cpu_has_fast_bf16
from cellbatch.model.default import default_model_path
from cellbatch.threads import in_short_lived_thread
from cellbatch.types import FinishReason, Token

PREFILL_ROWS = ((1, 500), (1, 2000), (1, 4000), (8, 1000))
QUICK_PREFILL_ROWS = ((1, 500), (2, 300))
DECODE_SESSIONS = (1, 8, 32)
QUICK_DECODE_SESSIONS = (1, 4)
DECODE_CONTEXT = 2000
QUICK_DECODE_CONTEXT = 300
DECODE_NEW_TOKENS = 16
QUICK_DECODE_NEW_TOKENS = 8
PROFILE_CONTEXTS = (128, 2000)
QUICK_PROFILE_CONTEXTS = (64, 300)
PROFILE_DECODES = 32
PROFILE_CHUNK = 512
PROFILE_REPEATS = 3
# Each prompt starts this many tokens further into the joined stream than the one before.
PROMPT_STRIDE = 97


def _progress(message: str) -> None:
    print(f"[long_context] {message}", file=sys.stderr, flush=True)


# -- prompts -----------------------------------------------------------------------


def token_stream(tokenizer: Any, length: int) -> list[Token]:
    """The chat prompts' tokens (chat template applied), joined and repeated to `length`."""
    pieces = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in CHAT_PROMPTS]
    stream: list[Token] = []
    while len(stream) < length:
        for piece in pieces:
            stream += piece
    return stream[:length]


def long_prompts(stream: Sequence[Token], count: int, length: int) -> list[list[Token]]:
    """`count` prompts of `length` tokens, each starting PROMPT_STRIDE tokens further on."""
    needed = (count - 1) * PROMPT_STRIDE + length
    if needed > len(stream):
        raise ValueError(f"the token stream holds {len(stream)} tokens, {needed} are needed")
    return [list(stream[i * PROMPT_STRIDE : i * PROMPT_STRIDE + length]) for i in range(count)]


# -- results -----------------------------------------------------------------------


@dataclass
class PrefillRow:
    prompts: int
    tokens_each: int
    seconds: dict[str, float] = field(default_factory=dict)  # peer -> best seconds
    first_tokens_agree: int | None = None  # cellbatch vs transformers generate
    first_tokens: list[Token] = field(default_factory=list, repr=False)
    reference_tokens: list[Token] = field(default_factory=list, repr=False)

    def tokens_per_s(self, peer: str) -> float:
        return self.prompts * self.tokens_each / self.seconds[peer]


@dataclass
class DecodeRow:
    sessions: int
    context: int
    tokens_per_s: dict[str, float] = field(default_factory=dict)


@dataclass
class ProfileRow:
    kind: str  # "decode" or "prefill"
    context: int
    tokens: int
    step_ms: float
    attention_ms: float
    products_ms: float
    plan_ms: float

    @property
    def attention_share(self) -> float:
        return self.attention_ms / self.step_ms


@dataclass
class Report:
    environment: dict[str, Any]
    options: dict[str, Any]
    prefill: list[PrefillRow] = field(default_factory=list)
    decode: list[DecodeRow] = field(default_factory=list)
    profile: list[ProfileRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


HF_FORWARD = "transformers forward (SDPA)"
HF_GENERATE = "transformers generate"
CELLBATCH = "cellbatch"


# -- transformers -------------------------------------------------------------------


def timed(function: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def hf_prefill(model: torch.nn.Module, prompts: list[list[Token]], pad: Token) -> dict:
    """Seconds of one forward and of `generate` with 1 new token; generate's tokens."""
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        forward_s, _ = timed(lambda: model(input_ids=ids, attention_mask=mask, logits_to_keep=1))
        generate_s, generated = timed(
            lambda: model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=1,
                do_sample=False,
                pad_token_id=pad,
            )
        )
    return {"forward": forward_s, "generate": generate_s, "tokens": generated[:, -1].tolist()}


class HFDecoder:
    """transformers' cache of the contexts (all one length), filled once; `tokens_per_s`
    times batched `generate` continuing from a copy of its first rows (from the cache itself
    for all rows, last), so that it runs decode steps only."""

    def __init__(self, model: torch.nn.Module, contexts: list[list[Token]], pad: Token) -> None:
        from transformers import DynamicCache

        self.model, self.pad = model, pad
        self.ids = torch.tensor(contexts, dtype=torch.long)
        self.filled = DynamicCache()
        with torch.inference_mode():
            # Fed 500 positions at a time: all at once, the activations would cost
            # gigabytes more than the cache.
            for start in range(0, self.ids.shape[1] - 1, 500):
                end = min(start + 500, self.ids.shape[1] - 1)
                model(input_ids=self.ids[:, start:end], cache=self.filled, logits_to_keep=1)

    def tokens_per_s(self, count: int, new: int) -> float:
        """Decode tokens/s of the first `count` rows; all rows use up the filled cache."""
        from transformers import DynamicCache

        if count < self.ids.shape[0]:
            cache = DynamicCache(
                [
                    (layer.keys[:count].clone(), layer.values[:count].clone())
                    for layer in self.filled.layers
                ]
            )
        else:
            cache, self.filled = self.filled, None
        rows = self.ids[:count]
        with torch.inference_mode():
            seconds, _ = timed(
                lambda: self.model.generate(
                    input_ids=rows,
                    attention_mask=torch.ones_like(rows),
                    cache=cache,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=self.pad,
                )
            )
        return count * new / seconds


# -- cellbatch ---------------------------------------------------------------------


def cellbatch_prefill(engine: Any, prompts: list[list[Token]]) -> tuple[float, list[Token]]:
    config = GenConfig(max_new_tokens=1, stop_tokens=frozenset())
    seconds, results = timed(lambda: engine.generate(prompts, config, share_prefix=False))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"cellbatch prefill failed: {failed[0]}")
    return seconds, [r.tokens[0] for r in results]


class CellbatchDecoder:
    """One session per context, fed once by prefill turns; `tokens_per_s` runs a turn on the
    first `count` sessions (the context's last token, again after the first turn, then `new`
    tokens), so that they decode in lockstep, and reads the engine's decode-only rate."""

    def __init__(self, engine: Any, contexts: list[list[Token]]) -> None:
        self.engine = engine
        self.sessions = [engine.open_session() for _ in contexts]
        self.last = [context[-1] for context in contexts]
        for handle in [
            s.prefill_async(c[:-1]) for s, c in zip(self.sessions, contexts, strict=True)
        ]:
            handle.wait()

    def tokens_per_s(self, count: int, new: int) -> float:
        before = self.engine.metrics()
        config = GenConfig(max_new_tokens=new, stop_tokens=frozenset())
        handles = [
            s.generate_async([self.last[i]], config) for i, s in enumerate(self.sessions[:count])
        ]
        for handle in handles:
            handle.wait()
            if handle.finish_reason() != FinishReason.TOKEN_LIMIT:
                raise RuntimeError(f"decode ended {handle.finish_reason()}: {handle.error()}")
        after = self.engine.metrics()
        tokens = after.decode_only_tokens - before.decode_only_tokens
        return tokens / (after.decode_only_time - before.decode_only_time)

    def close(self) -> None:
        for session in self.sessions:
            session.close()


# -- profile -----------------------------------------------------------------------

_PRODUCT_OPS = ("mkldnn::_linear_pointwise", "aten::linear")


class Stepper:
    """Packed steps straight through the model over a CellCache + KVPool (the K/V of the
    context are left as the pool holds them: only the timing is of interest)."""

    def __init__(self, model: Any, cells: int) -> None:
        config = model.config
        self.model = model
        self.cache = CellCache(cells)
        self.pool = KVPool(
            config.num_layers, config.num_kv_heads, config.head_dim, cells, dtype=model.dtype
        )

    def fill(self, seq: int, length: int) -> None:
        ids = np.full(length, seq)
        assert self.cache.declare_step(ids)
        self.cache.place_step(ids, np.arange(length))

    def step(self, seq_ids: np.ndarray, positions: np.ndarray) -> tuple[float, Callable]:
        """Places the step; returns (seconds to build its plan, run) where run() runs it."""
        assert self.cache.declare_step(seq_ids)
        cells = self.cache.place_step(seq_ids, positions)
        self.pool.ensure(self.cache.high_water())
        started = time.perf_counter()
        plan = self.cache.attention_plan(seq_ids, positions, cells)
        plan_s = time.perf_counter() - started
        tokens = torch.zeros(len(seq_ids), dtype=torch.long)
        args = (
            tokens,
            torch.from_numpy(positions),
            plan,
            self.pool,
            torch.from_numpy(cells),
            torch.tensor([len(seq_ids) - 1]),
        )
        return plan_s, lambda: self.model(*args)


def profile_step(model: Any, kind: str, context: int) -> ProfileRow:
    """One decode step of PROFILE_DECODES sequences at `context`, or one PROFILE_CHUNK chunk
    (shorter when `context` is) whose context ends at `context`, under the profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function

    stepper = Stepper(model, PROFILE_DECODES * (context + 1) + PROFILE_CHUNK)
    if kind == "decode":
        seqs = [stepper.cache.seq_alloc() for _ in range(PROFILE_DECODES)]
        for seq in seqs:
            stepper.fill(seq, context)
        seq_ids, positions = np.array(seqs), np.full(len(seqs), context)
    else:
        seq = stepper.cache.seq_alloc()
        chunk = min(PROFILE_CHUNK, context)
        stepper.fill(seq, context - chunk)
        seqs = [seq]
        seq_ids, positions = np.full(chunk, seq), np.arange(context - chunk, context)
    attention = model.attention
    attend = attention.attend

    def labelled(*args: Any, **kwargs: Any) -> torch.Tensor:
        with record_function("attention"):
            return attend(*args, **kwargs)

    attention.attend = labelled
    rows: list[ProfileRow] = []
    try:
        with torch.inference_mode():
            for repeat in range(PROFILE_REPEATS + 1):
                for seq in seqs:
                    stepper.cache.seq_rewind(seq, int(positions[seq_ids == seq][0]))
                plan_s, run = stepper.step(seq_ids, positions)
                if repeat == 0:
                    run()  # warm-up
                    continue
                with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("step"):
                    run()
                totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
                rows.append(
                    ProfileRow(
                        kind=kind,
                        context=context,
                        tokens=len(seq_ids),
                        step_ms=totals["step"] / 1e3,
                        attention_ms=totals.get("attention", 0.0) / 1e3,
                        products_ms=sum(totals.get(op, 0.0) for op in _PRODUCT_OPS) / 1e3,
                        plan_ms=plan_s * 1e3,
                    )
                )
    finally:
        del attention.attend
    return min(rows, key=lambda row: row.step_ms)


# -- the run -----------------------------------------------------------------------


def run(options: argparse.Namespace) -> Report:
    """Every part, each peer measured right beside the others on the same workload (the
    machine's load drifts), best of `--repeats`, alternating which goes first."""
    from cellbatch.engine import Engine
    from cellbatch.model.loading import load_model
    from cellbatch.model.tokenizer import load_tokenizer

    torch.set_num_threads(options.threads)
    path = Path(options.model) if options.model else default_model_path()
    dtype = getattr(torch, options.dtype)
    report = Report(
        environment={
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": options.threads,
            "model": str(path),
        },
        options={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items()},
    )
    tokenizer = load_tokenizer(path)
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    prefill_rows = QUICK_PREFILL_ROWS if options.quick else PREFILL_ROWS
    sessions = QUICK_DECODE_SESSIONS if options.quick else DECODE_SESSIONS
    context = QUICK_DECODE_CONTEXT if options.quick else DECODE_CONTEXT
    new_tokens = QUICK_DECODE_NEW_TOKENS if options.quick else DECODE_NEW_TOKENS
    longest = max([n * PROMPT_STRIDE + length for n, length in prefill_rows])
    stream = token_stream(tokenizer, max(longest, max(sessions) * PROMPT_STRIDE + context))
    workloads = [long_prompts(stream, n, length) for n, length in prefill_rows]
    contexts = long_prompts(stream, max(sessions), context)
    parts = {"prefill", "decode"} - set(options.skip)

    hf_model = None
    if parts and "transformers" not in options.skip:
        _progress(f"loading {path} in transformers ({options.dtype})")
        hf_model = in_short_lived_thread(lambda: load_transformers_model(path, dtype))
    if parts:
        _progress(f"loading {path} in cellbatch")
        shape = {"max_batch_tokens": options.max_batch_tokens}
        if options.max_prefill_chunk:
            shape["max_prefill_chunk"] = options.max_prefill_chunk
        with Engine.from_pretrained(
            path, dtype=options.dtype, threads=options.threads, **_weights(Engine), **shape
        ) as engine:
            report.options["engine_shape"] = asdict(engine.shape)
            report.options["kernels"] = engine.kernels
            cellbatch_prefill(engine, [stream[:64], stream[64:128]])  # warm-up
            if hf_model is not None:
                in_short_lived_thread(lambda: hf_prefill(hf_model, [stream[:64]], pad))
            if "prefill" in parts:
                for prompts in workloads:
                    report.prefill.append(
                        _prefill_row(engine, hf_model, prompts, pad, options.repeats)
                    )
            if "decode" in parts:
                report.decode += _decode_rows(engine, hf_model, contexts, sessions, new_tokens, pad)

    if "profile" not in options.skip:

        def profile_part() -> None:
            _, model = load_model(path, dtype, **_weights(load_model))
            for kind in ("decode", "prefill"):
                for ctx in QUICK_PROFILE_CONTEXTS if options.quick else PROFILE_CONTEXTS:
                    _progress(f"profile: {kind} step at {ctx} tokens of context")
                    report.profile.append(profile_step(model, kind, ctx))

        in_short_lived_thread(profile_part)
    return report


def _weights(loader: Callable[..., Any]) -> dict[str, str]:
    """Float weights, as transformers runs them, from loaders that would keep a GGUF
    file's quantised blocks by default (older ones have no such choice)."""
    target = getattr(loader, "from_pretrained", loader)
    return {"quantize": "none"} if "quantize" in inspect.signature(target).parameters else {}


def _prefill_row(
    engine: Any, hf_model: Any, prompts: list[list[Token]], pad: Token, repeats: int
) -> PrefillRow:
    row = PrefillRow(len(prompts), len(prompts[0]))
    _progress(f"prefill {row.prompts} x {row.tokens_each}")
    for repeat in range(repeats):

        def ours() -> None:
            seconds, firsts = cellbatch_prefill(engine, prompts)
            row.seconds[CELLBATCH] = min(seconds, row.seconds.get(CELLBATCH, seconds))
            row.first_tokens = firsts

        def theirs() -> None:
            measured = in_short_lived_thread(lambda: hf_prefill(hf_model, prompts, pad))
            for peer, key in ((HF_FORWARD, "forward"), (HF_GENERATE, "generate")):
                row.seconds[peer] = min(measured[key], row.seconds.get(peer, measured[key]))
            row.reference_tokens = measured["tokens"]

        measures = [ours] if hf_model is None else [ours, theirs]
        for measure in measures if repeat % 2 == 0 else measures[::-1]:
            measure()
    if row.reference_tokens:
        row.first_tokens_agree = sum(
            a == b for a, b in zip(row.first_tokens, row.reference_tokens, strict=True)
        )
    return row


def _decode_rows(
    engine: Any,
    hf_model: Any,
    contexts: list[list[Token]],
    sessions: Sequence[int],
    new: int,
    pad: Token,
) -> list[DecodeRow]:
    """transformers' counts, then cellbatch's, back to back: each peer holds its caches
    of every context (about 3 GB at 32 x 2,000 in float32) only while it runs."""
    rows = [DecodeRow(count, len(contexts[0])) for count in sessions]
    if hf_model is not None:

        def theirs() -> None:
            _progress(f"decode: transformers fed {len(contexts)} x {len(contexts[0])} tokens")
            decoder = HFDecoder(hf_model, contexts, pad)
            for row in rows:
                _progress(f"decode: transformers, {row.sessions} sessions")
                row.tokens_per_s[HF_GENERATE] = decoder.tokens_per_s(row.sessions, new)

        in_short_lived_thread(theirs)
    _progress(f"decode: cellbatch fed {len(contexts)} x {len(contexts[0])} tokens")
    ours = CellbatchDecoder(engine, contexts)
    try:
        for row in rows:
            _progress(f"decode: cellbatch, {row.sessions} sessions")
            row.tokens_per_s[CELLBATCH] = ours.tokens_per_s(row.sessions, new)
    finally:
        ours.close()
    return rows


# -- output ------------------------------------------------------------------------


def table(report: Report) -> str:
    lines = []
    if report.prefill:
        lines += [
            "prefill (prompt tokens/s, 1 new token)",
            f"| workload | {CELLBATCH} | {HF_FORWARD} | {HF_GENERATE} | ratio vs forward "
            "| ratio vs generate | first tokens agree |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in report.prefill:
            ours = row.tokens_per_s(CELLBATCH)
            cells = [f"{ours:.0f}"]
            for peer in (HF_FORWARD, HF_GENERATE):
                cells.append(f"{row.tokens_per_s(peer):.0f}" if peer in row.seconds else "-")
            for peer in (HF_FORWARD, HF_GENERATE):
                cells.append(
                    f"{ours / row.tokens_per_s(peer):.2f}x" if peer in row.seconds else "-"
                )
            agree = "-" if row.first_tokens_agree is None else f"{row.first_tokens_agree}"
            lines.append(
                f"| {row.prompts} x {row.tokens_each} | {' | '.join(cells)} "
                f"| {agree}/{row.prompts} |"
            )
    if report.decode:
        lines += [
            "",
            "decode-only tokens/s",
            f"| sessions x context | {CELLBATCH} | {HF_GENERATE} (padded batch) | ratio |",
            "|---|---|---|---|",
        ]
        for row in report.decode:
            ours = row.tokens_per_s[CELLBATCH]
            theirs = row.tokens_per_s.get(HF_GENERATE)
            lines.append(
                f"| {row.sessions} x {row.context} | {ours:.1f} | "
                + (f"{theirs:.1f} | {ours / theirs:.2f}x |" if theirs else "- | - |")
            )
    if report.profile:
        lines += [
            "",
            "one step under the profiler (ms)",
            "| step | context | tokens | step | attention | share | products | plan |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in report.profile:
            lines.append(
                f"| {p.kind} | {p.context} | {p.tokens} | {p.step_ms:.1f} | "
                f"{p.attention_ms:.1f} | {p.attention_share:.0%} | {p.products_ms:.1f} | "
                f"{p.plan_ms:.2f} |"
            )
    lines += report.notes
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--model", help="a Hugging Face folder or GGUF file (default: SmolLM2)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["prefill", "decode", "profile", "transformers"],
        help="leave out a part, or the transformers peers (repeatable)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="best of this many (default 2)")
    parser.add_argument(
        "--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS, help="the engine's step"
    )
    parser.add_argument(
        "--max-prefill-chunk", type=int, help="the engine's prompt chunk (default: its own)"
    )
    parser.add_argument("--output-json", type=Path, help="also write the figures as JSON")
    options = parser.parse_args(argv)
    if options.dtype == "bfloat16" and not cpu_has_fast_bf16():
        print("bfloat16 skipped: this CPU has no native bf16 products", file=sys.stderr)
        return 0
    report = run(options)
    text = table(report)
    print(text)
    if options.output_json:
        options.output_json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "environment": report.environment,
            "options": report.options,
            "prefill": [
                {**asdict(r), "tokens_per_s": {p: r.tokens_per_s(p) for p in r.seconds}}
                for r in report.prefill
            ],
            "decode": [asdict(r) for r in report.decode],
            "profile": [
                {**asdict(p), "attention_share": p.attention_share} for p in report.profile
            ],
            "table": text,
        }
        options.output_json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
