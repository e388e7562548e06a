"""Throughput benchmark: cellbatch against Hugging Face transformers (`cellbatch bench`).

Owns: the benchmark's chat prompts; one timed run of each peer over them (transformers one
prompt at a time, transformers on a left-padded batch, transformers continuous batching
`generate_batch`, cellbatch); the agreement of each peer's greedy tokens with transformers'
one-prompt-at-a-time greedy tokens (its padded batch's when that run is skipped: it is the
slowest); cellbatch's decode-only throughput at several session counts; and the JSON and
PNG of those figures.
Promises: in one run every peer gets the same prompt tokens, dtype, threads and token budget,
decodes greedily and stops at the model's stop tokens; a peer's tokens/s is the tokens it
generated (stop tokens included) over the wall time of its generate call, after a short
warm-up. A peer that fails is reported with its error; the others still run.
Never: judges the figures against targets (it prints them), or changes the engine's limits
beyond the session count the benchmark needs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import itertools
import json
import math
import os
import platform
import re
import struct
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import torch

from cellbatch.engine import DEFAULT_MAX_BATCH_TOKENS
from cellbatch.metrics import EngineMetrics
from cellbatch.types import FinishReason, GenConfig, Token

# Varied chat requests, 35 to 130 tokens each once SmolLM2's chat template (with its
# system prompt) wraps them: short questions, long briefs, code, arithmetic, rewriting.
CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "Explain in two sentences why the sky looks blue during the day.",
    "Give me a short recipe for pancakes, with the ingredients first.",
    "What is the difference between a list and a tuple in Python?",
    "Translate into French: 'The library opens at nine and closes at six.'",
    "Suggest five names for a small bakery that sells bread and coffee.",
    "How do plants turn sunlight into energy? Keep the answer simple.",
    "Write a polite email to a colleague asking to move our Tuesday meeting to Thursday afternoon.",
    (
        "I run a small online shop selling handmade candles. Sales were steady for a year, but "
        "in the last three months visits to the site have dropped by half while the conversion "
        "rate stayed the same. I have not changed prices or products, but I did redesign the "
        "home page and switch to a new hosting provider. What should I check first, in what "
        "order, and which numbers would tell me whether the redesign or the hosting change is "
        "to blame?"
    ),
    "What are the main causes of inflation, and how do central banks usually respond to it?",
    (
        "I have 3 apples, I eat one and buy five more, then give half of them away. How many "
        "are left? Show your steps."
    ),
    "Describe a sunrise over the sea to someone who has never seen one, using all five senses.",
    "Write a Python function that returns the n-th Fibonacci number, and explain its running time.",
    (
        "Here is my situation: I work from home four days a week, I live in a one-bedroom flat "
        "with a small balcony, and I would like to adopt a pet. I am away one weekend a month, "
        "my building allows cats and small dogs, and my budget is about one hundred euros a "
        "month for food and care. Which kind of pet would suit me best, what should I prepare "
        "before it arrives, and what mistakes do first-time owners often make in the first "
        "weeks?"
    ),
    (
        "My tomato plants have yellow leaves at the bottom and brown spots on the fruit. The "
        "weather has been rainy for two weeks. What could be wrong, and what should I do "
        "first?"
    ),
    (
        "Summarize the plot of Romeo and Juliet in a paragraph that a ten-year-old could "
        "follow, without spoiling the ending too bluntly."
    ),
    (
        "You are planning a three-day trip to Rome on a small budget. Suggest an itinerary "
        "with one museum, one church and one place to eat cheaply each day."
    ),
    (
        "Explain what a hash table is, how collisions are handled with chaining and with open "
        "addressing, and when you would choose each approach."
    ),
    (
        "A train leaves the station at 9:15 and travels at 80 kilometres per hour. A second "
        "train leaves the same station at 10:00 on the same track at 100 kilometres per hour. "
        "At what time does the second train catch up with the first?"
    ),
    (
        "Write a short story opening, about four sentences, in which a lighthouse keeper finds "
        "a message in a bottle that seems to be addressed to her by name, written in her own "
        "handwriting."
    ),
    (
        "Here is a sentence with mistakes: 'Their going too the market tomorow, weather or not "
        "it rains, becuase they needs vegetables.' Correct it and list each mistake you fixed."
    ),
    (
        "I am learning to play the guitar and my fingertips hurt after ten minutes of "
        "practice. How long does this usually last, how often should I practise, and are there "
        "exercises that help build calluses faster without injury?"
    ),
    (
        "Explain the difference between weather and climate. Then give one example of a "
        "weather event and one example of a climate trend, and say how scientists measure each "
        "of them over time."
    ),
    (
        "Draft a short product description for a reusable water bottle that keeps drinks cold "
        "for twenty-four hours and hot for twelve, is made of stainless steel, weighs 350 "
        "grams and comes in four colours."
    ),
    (
        "What are the steps to change a flat tyre on a car? Assume I have a spare wheel, a "
        "jack and a wrench in the boot, and I have never done it before, so please include the "
        "safety precautions."
    ),
    (
        "Write a SQL query that finds, for each customer, the total amount spent in 2023, from "
        "tables customers(id, name) and orders(id, customer_id, amount, created_at), sorted by "
        "the total in descending order, and explain each clause."
    ),
    (
        "A friend says that we only use ten percent of our brains. Explain politely why this "
        "is a myth, what brain imaging actually shows, and where the idea might have come "
        "from, in a way that does not make my friend feel foolish."
    ),
    (
        "Give me a weekly plan to start running as a complete beginner: three sessions a week "
        "for four weeks, mixing walking and jogging, with the duration of each interval, and "
        "advice on shoes, warming up and avoiding injuries."
    ),
    (
        "Read this short note and answer the questions. Note: 'Meeting moved to Friday at 3pm "
        "in room 204. Bring the quarterly figures and the draft budget. Lunch will not be "
        "provided. Maria will present the marketing plan.' Questions: When is the meeting? "
        "What should I bring? Who presents, and what?"
    ),
    (
        "Explain how public-key cryptography lets two people who have never met agree on a "
        "secret over an open channel. Use the analogy of padlocks and boxes, then describe "
        "what really happens with the numbers in the Diffie-Hellman exchange, and say why an "
        "eavesdropper cannot recover the shared secret."
    ),
)

SINGLE = "transformers-single"
PADDED = "transformers-padded"
CONTINUOUS = "transformers-continuous"
CELLBATCH = "cellbatch"
# The same engine feeding every prompt whole: what sharing the chat template's prefix buys.
CELLBATCH_UNSHARED = "cellbatch-unshared"
PADDED_FP32 = "transformers-padded-fp32"
SWEEP = "sweep"
SKIPPABLE = (SINGLE, PADDED, CONTINUOUS, CELLBATCH, CELLBATCH_UNSHARED, SWEEP)
# Whose greedy tokens the others are checked against: the first of these that ran.
REFERENCES = (SINGLE, PADDED)

DEFAULT_PROMPTS = 32
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_SESSIONS = (1, 8, 32, 64)
QUICK_PROMPTS = 8
QUICK_MAX_NEW_TOKENS = 16
QUICK_SESSIONS = (1, 4)
WARMUP_PROMPTS = 2
WARMUP_TOKENS = 4
# The parity rule of the default-model test: a divergence is excused only when the
# reference's two best logits there are closer than this and our token is one of them.
NEAR_TIE_LOGIT_GAP = 0.01
# Tokens per page of transformers' paged cache in `generate_batch`.
CONTINUOUS_PAGE_SIZE = 32


# -- figures -----------------------------------------------------------------------


def until_stop(tokens: Sequence[Token], stop_tokens: frozenset[Token]) -> list[Token]:
    """`tokens` through the first stop token (kept, as cellbatch keeps it); all if none."""
    for index, token in enumerate(tokens):
        if token in stop_tokens:
            return [int(t) for t in tokens[: index + 1]]
    return [int(t) for t in tokens]


def first_divergence(ours: Sequence[Token], reference: Sequence[Token]) -> int | None:
    """The first index where the two differ (the shorter one's length when one is a prefix
    of the other); None when they are identical."""
    for index, (a, b) in enumerate(zip(ours, reference, strict=False)):
        if a != b:
            return index
    return None if len(ours) == len(reference) else min(len(ours), len(reference))


@dataclass
class Divergence:
    """Where one prompt's tokens first leave the reference's."""

    prompt: int
    index: int
    ours: Token | None  # None: our tokens ended here
    reference: Token | None  # None: the reference's tokens ended here
    top2_gap: float | None = None  # the reference model's best minus second-best logit here
    ours_in_top2: bool | None = None

    @property
    def near_tie(self) -> bool:
        return (
            self.top2_gap is not None
            and self.top2_gap < NEAR_TIE_LOGIT_GAP
            and bool(self.ours_in_top2)
        )


@dataclass
class Agreement:
    """How many prompts gave exactly the reference's tokens, and where the others left it."""

    total: int
    divergences: list[Divergence]

    @property
    def identical(self) -> int:
        return self.total - len(self.divergences)

    @property
    def meets_parity_rule(self) -> bool:
        """Identical everywhere, or one prompt off, at a near-tie (issue 4's rule)."""
        return not self.divergences or (len(self.divergences) == 1 and self.divergences[0].near_tie)


def compare(outputs: Sequence[Sequence[Token]], reference: Sequence[Sequence[Token]]) -> Agreement:
    if len(outputs) != len(reference):
        raise ValueError(
            f"{len(outputs)} outputs against {len(reference)} reference outputs: "
            "compare runs over the same prompts"
        )
    divergences = []
    for prompt, (ours, theirs) in enumerate(zip(outputs, reference, strict=True)):
        index = first_divergence(ours, theirs)
        if index is not None:
            divergences.append(
                Divergence(
                    prompt,
                    index,
                    ours[index] if index < len(ours) else None,
                    theirs[index] if index < len(theirs) else None,
                )
            )
    return Agreement(len(outputs), divergences)


@dataclass
class PeerRun:
    """One peer's timed generation over the prompt set."""

    name: str
    label: str
    concurrency: int  # generations in flight at once
    dtype: str
    seconds: float = 0.0
    outputs: list[list[Token]] = field(default_factory=list)
    error: str = ""
    agreement: Agreement | None = None
    idle_fraction: float | None = None  # cellbatch only: engine time outside its steps

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def generated_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        agreement = self.agreement
        return {
            "label": self.label,
            "concurrency": self.concurrency,
            "dtype": self.dtype,
            "seconds": self.seconds,
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": self.tokens_per_s,
            "error": self.error,
            "idle_fraction": self.idle_fraction,
            "agreement": None
            if agreement is None
            else {
                "identical": agreement.identical,
                "total": agreement.total,
                "meets_parity_rule": agreement.meets_parity_rule,
                "divergences": [
                    {**dataclasses.asdict(d), "near_tie": d.near_tie} for d in agreement.divergences
                ],
            },
            "outputs": self.outputs,
        }


@dataclass(frozen=True)
class EngineWindow:
    """The engine's counters over one stretch of work, from two metrics snapshots."""

    steps: int
    step_seconds: float
    wall_seconds: float  # from the caller's start to the end of the last step
    decode_only_steps: int
    decode_only_tokens: int
    decode_only_seconds: float

    @classmethod
    def between(cls, before: EngineMetrics, after: EngineMetrics, started: float) -> EngineWindow:
        """`started` is the perf_counter() reading taken just before the work was submitted,
        so submission and scheduling overhead count as idle time."""
        last = after.last_step_end
        return cls(
            steps=after.steps - before.steps,
            step_seconds=after.step_time_sum - before.step_time_sum,
            wall_seconds=max(0.0, last - started) if last is not None else 0.0,
            decode_only_steps=after.decode_only_steps - before.decode_only_steps,
            decode_only_tokens=after.decode_only_tokens - before.decode_only_tokens,
            decode_only_seconds=after.decode_only_time - before.decode_only_time,
        )

    @property
    def idle_fraction(self) -> float:
        if self.wall_seconds <= 0:
            return 0.0
        return max(0.0, 1.0 - self.step_seconds / self.wall_seconds)

    @property
    def decode_only_tokens_per_s(self) -> float:
        if self.decode_only_seconds <= 0:
            return 0.0
        return self.decode_only_tokens / self.decode_only_seconds

    @property
    def sessions_per_decode_step(self) -> float:
        return self.decode_only_tokens / self.decode_only_steps if self.decode_only_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "idle_fraction": self.idle_fraction,
            "decode_only_tokens_per_s": self.decode_only_tokens_per_s,
            "sessions_per_decode_step": self.sessions_per_decode_step,
        }


@dataclass(frozen=True)
class ConcurrencyPoint:
    """cellbatch decoding with `sessions` generations in lockstep."""

    sessions: int
    window: EngineWindow


@dataclass
class BenchReport:
    """Everything one benchmark run measured."""

    options: BenchOptions
    environment: dict[str, Any]
    prompt_lengths: list[int]
    runs: list[PeerRun]
    sweep: list[ConcurrencyPoint] = field(default_factory=list)
    sweep_error: str = ""

    def run(self, name: str) -> PeerRun | None:
        return next((run for run in self.runs if run.name == name), None)

    def reference(self) -> PeerRun | None:
        """The run whose tokens the others are compared with (None: none of REFERENCES ran)."""
        runs = (self.run(name) for name in REFERENCES)
        return next((run for run in runs if run is not None and run.ok), None)

    def ratios(self) -> dict[str, float]:
        """cellbatch's tokens/s over each other peer's that ran."""
        ours = self.run(CELLBATCH)
        if ours is None or not ours.ok:
            return {}
        return {
            f"{CELLBATCH}/{run.name}": ours.tokens_per_s / run.tokens_per_s
            for run in self.runs
            if run.name != CELLBATCH and run.ok and run.tokens_per_s > 0
        }

    def as_dict(self) -> dict[str, Any]:
        options = dataclasses.asdict(self.options)
        options.update(
            model=str(self.options.model) if self.options.model else None,
            output_json=str(self.options.output_json),
            plot=str(self.options.plot) if self.options.plot else None,
            skip=sorted(self.options.skip),
        )
        return {
            "options": options,
            "environment": self.environment,
            "prompts": [
                {"text": text, "tokens": length}
                for text, length in zip(CHAT_PROMPTS, self.prompt_lengths, strict=False)
            ],
            "peers": {run.name: run.as_dict() for run in self.runs},
            "ratios": self.ratios(),
            "concurrency": [
                {"sessions": point.sessions, **point.window.as_dict()} for point in self.sweep
            ],
            "concurrency_error": self.sweep_error,
        }


def write_json(report: BenchReport, path: Path) -> None:
    """Indented JSON, with each list of numbers (token ids, mostly) kept on one line."""
    text = json.dumps(report.as_dict(), indent=2)
    text = _NUMBER_LIST.sub(lambda match: "[" + " ".join(match[1].split()) + "]", text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.e+-]+(?:,\s*-?[\d.e+-]+)*)\s*\]")


# -- options -----------------------------------------------------------------------


@dataclass(frozen=True)
class BenchOptions:
    model: Path | None  # None: the embedded default model
    dtype: str  # "float32" | "bfloat16", already resolved from "auto"
    threads: int
    prompts: int
    max_new_tokens: int
    sessions: tuple[int, ...]
    max_batch_tokens: int
    skip: frozenset[str]
    fp32_baseline: bool
    quick: bool
    output_json: Path
    plot: Path | None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cellbatch bench",
        description="Generated tokens/s of cellbatch against transformers on the same "
        "prompts, dtype and threads, with a token-agreement check and a concurrency sweep.",
    )
    parser.add_argument("--model", type=Path, help="HF folder or .gguf (default: SmolLM2-135M)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="weights and KV of every peer (auto: bfloat16 where this CPU runs it fast)",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--prompts", type=int, help=f"how many of the {len(CHAT_PROMPTS)} prompts (default all)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, help=f"per prompt (default {DEFAULT_MAX_NEW_TOKENS})"
    )
    parser.add_argument(
        "--sessions",
        help="comma-separated session counts of the decode sweep (default "
        f"{','.join(map(str, DEFAULT_SESSIONS))})",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        help="tokens per forward, for cellbatch and transformers' generate_batch alike",
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=SKIPPABLE,
        help="leave out a peer or the sweep (repeatable)",
    )
    parser.add_argument(
        "--fp32-baseline",
        action=argparse.BooleanOptionalAction,
        help=f"also time {PADDED} in float32 (default: when --dtype is not float32)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_PROMPTS} prompts, {QUICK_MAX_NEW_TOKENS} new tokens, "
        f"sessions {','.join(map(str, QUICK_SESSIONS))}",
    )
    parser.add_argument(
        "--output-json",
        type=Path,
        help="default benchmarks/results/throughput-<dtype>[-quick].json",
    )
    parser.add_argument("--plot", type=Path, help="PNG path (default: the JSON's, as .png)")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    return parser


def parse_options(argv: Sequence[str] | None = None) -> BenchOptions:
    """Options with every default resolved; bad values exit with a usage error."""
    from cellbatch.model.transformer import resolve_dtype

    parser = _parser()
    args = parser.parse_args(argv)
    if args.model is not None and not args.model.exists():
        parser.error(f"--model {args.model} does not exist: give a model folder or a .gguf file")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    prompts = args.prompts or (QUICK_PROMPTS if args.quick else DEFAULT_PROMPTS)
    if not 1 <= prompts <= len(CHAT_PROMPTS):
        parser.error(f"--prompts must be in 1..{len(CHAT_PROMPTS)}, got {prompts}")
    max_new = args.max_new_tokens or (
        QUICK_MAX_NEW_TOKENS if args.quick else DEFAULT_MAX_NEW_TOKENS
    )
    if max_new < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {max_new}")
    if args.max_batch_tokens < 2:
        parser.error(f"--max-batch-tokens must be >= 2, got {args.max_batch_tokens}")
    sessions = QUICK_SESSIONS if args.quick else DEFAULT_SESSIONS
    if args.sessions is not None:
        try:
            sessions = tuple(int(word) for word in args.sessions.split(","))
        except ValueError:
            parser.error(
                f"--sessions takes comma-separated integers like 1,8,32, got {args.sessions!r}"
            )
        if not sessions or min(sessions) < 1:
            parser.error(f"--sessions counts must be >= 1, got {args.sessions!r}")
    dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")
    output = args.output_json or Path("benchmarks/results") / (
        f"throughput-{dtype}{'-quick' if args.quick else ''}.json"
    )
    return BenchOptions(
        model=args.model,
        dtype=dtype,
        threads=args.threads or torch.get_num_threads(),
        prompts=prompts,
        max_new_tokens=max_new,
        sessions=sessions,
        max_batch_tokens=args.max_batch_tokens,
        skip=frozenset(args.skip),
        fp32_baseline=args.fp32_baseline if args.fp32_baseline is not None else dtype != "float32",
        quick=args.quick,
        output_json=output,
        plot=None if args.no_plot else (args.plot or output.with_suffix(".png")),
    )


# -- the peers ---------------------------------------------------------------------


def load_transformers_model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The same checkpoint through transformers (a GGUF is dequantised as cellbatch does)."""
    from transformers import AutoModelForCausalLM

    from cellbatch.model.loading import locate_model

    files = locate_model(path)
    extra = {"gguf_file": files.path.name} if files.kind == "gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(files.folder), dtype=dtype, attn_implementation="sdpa", **extra
    )
    return model.eval()


def greedy_config(max_new_tokens: int, stop_tokens: frozenset[Token], pad: Token) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=sorted(stop_tokens),
        pad_token_id=pad,
    )


def left_padded(
    prompts: Sequence[Sequence[Token]], pad: Token
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask), both [prompts, longest], prompts flush right."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def transformers_single(
    model: torch.nn.Module, prompts: Sequence[Sequence[Token]], config: Any, stop: frozenset[Token]
) -> list[list[Token]]:
    """Each prompt alone, batch 1, no padding: the reference greedy tokens."""
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], dtype=torch.long)
            generated = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
            outputs.append(until_stop(generated[0, len(prompt) :].tolist(), stop))
    return outputs


def transformers_padded(
    model: torch.nn.Module, prompts: Sequence[Sequence[Token]], config: Any, stop: frozenset[Token]
) -> list[list[Token]]:
    """All prompts as one left-padded batch."""
    ids, mask = left_padded(prompts, config.pad_token_id)
    with torch.inference_mode():
        generated = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return [until_stop(row, stop) for row in generated[:, ids.shape[1] :].tolist()]


def transformers_continuous(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[Token]],
    config: Any,
    stop: frozenset[Token],
    max_batch_tokens: int,
) -> list[list[Token]]:
    """transformers' continuous batching, its paged cache sized by hand: by default it
    sizes itself from free accelerator memory, which a CPU does not report."""
    from transformers import ContinuousBatchingConfig

    pages = sum(
        math.ceil((len(prompt) + config.max_new_tokens) / CONTINUOUS_PAGE_SIZE)
        for prompt in prompts
    )
    batching = ContinuousBatchingConfig(
        page_size=CONTINUOUS_PAGE_SIZE,
        num_blocks=pages + len(prompts),  # one spare page per request
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=len(prompts),
    )
    with torch.inference_mode():
        results = list(
            model.generate_batch(
                [list(prompt) for prompt in prompts],
                generation_config=config,
                continuous_batching_config=batching,
            ).values()
        )
    if len(results) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompts)} results")
    for prompt, result in zip(prompts, results, strict=True):
        if result.error is not None or list(result.prompt_ids) != list(prompt):
            raise RuntimeError(f"generate_batch request {result.request_id} failed: {result.error}")
    return [until_stop(result.generated_tokens, stop) for result in results]


def cellbatch_generate(
    engine: Any, prompts: Sequence[Sequence[Token]], config: GenConfig, share_prefix: bool = True
) -> tuple[list[list[Token]], EngineWindow]:
    """All prompts through `Engine.generate`, and the engine's counters over that call."""
    before = engine.metrics()
    started = perf_counter()
    results = engine.generate(prompts, config, share_prefix=share_prefix)
    window = EngineWindow.between(before, engine.metrics(), started)
    failed = [
        f"prompt {i}: {r.finish_reason}: {r.error}" for i, r in enumerate(results) if not r.ok
    ]
    if failed:
        raise RuntimeError("; ".join(failed))
    return [list(result.tokens) for result in results], window


def decode_sweep_point(
    engine: Any, prompts: Sequence[Sequence[Token]], sessions: int, new_tokens: int
) -> ConcurrencyPoint:
    """`sessions` generations decoding in lockstep (prompts reused round-robin).

    Turn 1 prefills every prompt and takes one token; turn 2 feeds one more token and
    generates `new_tokens` without stop tokens, so after its first step every step
    decodes all the sessions at once. Only turn 2 is measured.
    """
    opened = [engine.open_session() for _ in range(sessions)]
    contexts = [prompts[index % len(prompts)] for index in range(sessions)]
    try:
        _wait_all(
            [
                session.generate_async(list(context), GenConfig(max_new_tokens=1))
                for session, context in zip(opened, contexts, strict=True)
            ],
            FinishReason.TOKEN_LIMIT,
        )
        before = engine.metrics()
        started = perf_counter()
        _wait_all(
            [
                session.generate_async([context[-1]], GenConfig(max_new_tokens=new_tokens))
                for session, context in zip(opened, contexts, strict=True)
            ],
            FinishReason.TOKEN_LIMIT,
        )
        window = EngineWindow.between(before, engine.metrics(), started)
    finally:
        for session in opened:
            session.close()
    return ConcurrencyPoint(sessions, window)


def _wait_all(handles: Sequence[Any], expected: FinishReason) -> None:
    for handle in handles:
        handle.wait()
    wrong = [
        f"{handle.finish_reason()}: {handle.error()}"
        for handle in handles
        if handle.finish_reason() != expected
    ]
    if wrong:
        raise RuntimeError(f"{len(wrong)} generations did not end by {expected}: {wrong[0]}")


def probe_divergences(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[Token]],
    reference: Sequence[Sequence[Token]],
    agreement: Agreement,
) -> None:
    """Fills each divergence's top-2 logit gap, from the reference model's logits after
    the prompt and the reference tokens before the divergence."""
    with torch.inference_mode():
        for divergence in agreement.divergences:
            context = list(prompts[divergence.prompt]) + list(
                reference[divergence.prompt][: divergence.index]
            )
            logits = model(torch.tensor([context], dtype=torch.long)).logits[0, -1].float()
            top = torch.topk(logits, 2)
            divergence.top2_gap = float(top.values[0] - top.values[1])
            divergence.ours_in_top2 = divergence.ours in top.indices.tolist()


# -- the run -----------------------------------------------------------------------

GenerateFn = Callable[[Sequence[Sequence[Token]], int], list[list[Token]]]


@dataclass(frozen=True)
class Peer:
    """Something to time: `generate(prompts, max_new_tokens)` -> tokens per prompt."""

    name: str
    label: str
    concurrency: int  # generations in flight at once
    dtype: str
    generate: GenerateFn


def time_peer(peer: Peer, prompts: Sequence[Sequence[Token]], max_new_tokens: int) -> PeerRun:
    """Warms the peer up on a few prompts, then times it on all of them."""
    run = PeerRun(peer.name, peer.label, peer.concurrency, peer.dtype)
    _progress(f"{peer.label}: {len(prompts)} prompts, at most {max_new_tokens} new tokens each")
    try:
        peer.generate(prompts[:WARMUP_PROMPTS], WARMUP_TOKENS)
        started = perf_counter()
        run.outputs = peer.generate(prompts, max_new_tokens)
        run.seconds = perf_counter() - started
    except Exception as error:  # a failing peer is reported, and the others still run
        run.error = f"{type(error).__name__}: {error}"
        _progress(f"{peer.label}: failed: {run.error}")
        return run
    _progress(f"{peer.label}: {run.generated_tokens} tokens in {run.seconds:.2f} s")
    return run


def transformers_peer(
    name: str,
    model: torch.nn.Module,
    count: int,
    stop: frozenset[Token],
    pad: Token,
    max_batch_tokens: int,
) -> Peer:
    """One of the transformers peers over `count` prompts, with `model` in its dtype."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    kinds: dict[str, tuple[str, int, Callable[..., list[list[Token]]]]] = {
        SINGLE: ("transformers one prompt at a time", 1, transformers_single),
        PADDED: (f"transformers padded batch of {count}", count, transformers_padded),
        PADDED_FP32: (
            f"transformers padded batch of {count} in float32",
            count,
            transformers_padded,
        ),
        CONTINUOUS: (
            "transformers generate_batch",
            count,
            functools.partial(transformers_continuous, max_batch_tokens=max_batch_tokens),
        ),
    }
    label, concurrency, generate = kinds[name]
    return Peer(
        name,
        label,
        concurrency,
        dtype,
        lambda prompts, new: generate(model, prompts, greedy_config(new, stop, pad), stop),
    )


def cellbatch_peer(
    engine: Any, count: int, dtype: str, stop: frozenset[Token], share_prefix: bool = True
) -> tuple[Peer, list[EngineWindow]]:
    """cellbatch over `count` prompts, and the list that holds the engine's counters over
    its latest call."""
    windows: list[EngineWindow] = []

    def generate(prompts: Sequence[Sequence[Token]], new: int) -> list[list[Token]]:
        config = GenConfig(max_new_tokens=new, stop_tokens=stop)
        outputs, window = cellbatch_generate(engine, prompts, config, share_prefix)
        windows[:] = [window]
        return outputs

    if share_prefix:
        return Peer(CELLBATCH, "cellbatch", count, dtype, generate), windows
    label = "cellbatch, prompt prefix not shared"
    return Peer(CELLBATCH_UNSHARED, label, count, dtype, generate), windows


def run_benchmark(options: BenchOptions) -> BenchReport:
    from cellbatch.engine import Engine
    from cellbatch.model.default import default_model_path
    from cellbatch.model.tokenizer import load_tokenizer
    from cellbatch.threads import in_short_lived_thread

    torch.set_num_threads(options.threads)
    path = options.model or default_model_path()
    tokenizer = load_tokenizer(path)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}])
        for text in CHAT_PROMPTS[: options.prompts]
    ]
    stop = tokenizer.stop_tokens
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(stop)
    count = len(prompts)
    report = BenchReport(options, _environment(path, options), [len(p) for p in prompts], [])

    reference_model = None
    hf_names = [name for name in (SINGLE, PADDED, CONTINUOUS) if name not in options.skip]
    if hf_names or options.fp32_baseline:

        def run_transformers() -> torch.nn.Module:
            _progress(f"loading {path} in transformers")
            fp32_model = load_transformers_model(path, torch.float32)
            reference = fp32_model
            if options.dtype != "float32":
                reference = copy.deepcopy(fp32_model).to(getattr(torch, options.dtype))
            peers = [
                transformers_peer(name, model, count, stop, pad, options.max_batch_tokens)
                for name, model in (
                    *([(PADDED_FP32, fp32_model)] if options.fp32_baseline else []),
                    *((name, reference) for name in hf_names),
                )
            ]
            report.runs += [time_peer(peer, prompts, options.max_new_tokens) for peer in peers]
            return reference

        # Off the main thread, as cellbatch's forwards are: see cellbatch.threads.
        reference_model = in_short_lived_thread(run_transformers)

    if {CELLBATCH, CELLBATCH_UNSHARED, SWEEP} - set(options.skip):
        _progress(f"loading {path} in cellbatch")
        with Engine.from_pretrained(
            path,
            dtype=options.dtype,
            threads=options.threads,
            max_sessions=max((count, *options.sessions)),
            max_batch_tokens=options.max_batch_tokens,
        ) as engine:
            for name, share in ((CELLBATCH, True), (CELLBATCH_UNSHARED, False)):
                if name not in options.skip:
                    peer, windows = cellbatch_peer(engine, count, options.dtype, stop, share)
                    run = time_peer(peer, prompts, options.max_new_tokens)
                    run.idle_fraction = windows[0].idle_fraction if run.ok else None
                    report.runs.append(run)
            if SWEEP not in options.skip:
                _sweep(engine, prompts, options, report)

    reference = report.reference()
    if reference is not None:
        for run in report.runs:
            if run is not reference and run.ok and run.dtype == reference.dtype:
                run.agreement = compare(run.outputs, reference.outputs)
                probe_divergences(reference_model, prompts, reference.outputs, run.agreement)
    report.environment["load_average_1min_at_end"] = _load_average()
    return report


def _sweep(
    engine: Any, prompts: list[list[Token]], options: BenchOptions, report: BenchReport
) -> None:
    try:
        decode_sweep_point(engine, prompts, 1, WARMUP_TOKENS)
        for sessions in options.sessions:
            _progress(f"cellbatch decode sweep: {sessions} sessions")
            point = decode_sweep_point(engine, prompts, sessions, options.max_new_tokens)
            report.sweep.append(point)
            _progress(
                f"cellbatch decode sweep: {sessions} sessions: "
                f"{point.window.decode_only_tokens_per_s:.1f} decode-only tokens/s"
            )
    except Exception as error:  # keep the figures already measured
        report.sweep_error = f"{type(error).__name__}: {error}"
        _progress(f"cellbatch decode sweep failed: {report.sweep_error}")


def _environment(path: Path, options: BenchOptions) -> dict[str, Any]:
    import transformers

    return {
        "model": str(path),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "threads": options.threads,
        # The machine may be shared: a load above the cores' count makes every figure low.
        "cores": os.cpu_count(),
        "load_average_1min_at_start": _load_average(),
    }


def _load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _progress(message: str) -> None:
    print(f"cellbatch bench: {message}", file=sys.stderr, flush=True)


# -- text report -------------------------------------------------------------------


def format_report(report: BenchReport) -> str:
    options = report.options
    lengths = report.prompt_lengths
    reference = report.reference()
    lines = [
        f"model {report.environment['model']}",
        f"{options.dtype}, {options.threads} threads, {len(lengths)} chat prompts "
        f"({min(lengths)}-{max(lengths)} tokens), greedy, at most {options.max_new_tokens} "
        "new tokens, stop at the model's stop tokens",
        "",
        f"{'peer':<44} {'dtype':>8} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} "
        f"{'cellbatch x':>11}  same tokens as {reference.name if reference else 'n/a'}",
    ]
    ratios = report.ratios()
    for run in report.runs:
        if not run.ok:
            lines.append(f"{run.label:<44} failed: {run.error}")
            continue
        ratio = ratios.get(f"{CELLBATCH}/{run.name}")
        lines.append(
            f"{run.label:<44} {run.dtype:>8} {run.seconds:>8.2f} {run.generated_tokens:>7} "
            f"{run.tokens_per_s:>9.1f} {'' if ratio is None else f'{ratio:.2f}x':>11}  "
            f"{_agreement_text(run, reference)}"
        )
    ours = report.run(CELLBATCH)
    if ours is not None and ours.idle_fraction is not None:
        lines.append(f"cellbatch engine idle fraction over that run: {ours.idle_fraction:.1%}")
    for run in report.runs:
        for d in run.agreement.divergences if run.agreement else ():
            gap = "n/a" if d.top2_gap is None else f"{d.top2_gap:.4f}"
            lines.append(
                f"  {run.name}: prompt {d.prompt} first differs at token {d.index} "
                f"(ours {d.ours}, reference {d.reference}; reference top-2 gap {gap}"
                f"{', near-tie' if d.near_tie else ''})"
            )
    if report.sweep:
        lines += [
            "",
            f"cellbatch decode-only throughput ({options.max_new_tokens} tokens per session, "
            "sessions in lockstep)",
            f"{'sessions':>8} {'tokens/s':>9} {'steps':>6} {'sessions/step':>13} {'idle':>6}",
        ]
        for point in report.sweep:
            window = point.window
            lines.append(
                f"{point.sessions:>8} {window.decode_only_tokens_per_s:>9.1f} "
                f"{window.decode_only_steps:>6} {window.sessions_per_decode_step:>13.1f} "
                f"{window.idle_fraction:>6.1%}"
            )
    if report.sweep_error:
        lines.append(f"decode sweep failed: {report.sweep_error}")
    loads = [report.environment.get(f"load_average_1min_at_{when}") for when in ("start", "end")]
    cores = report.environment.get("cores")
    if cores and any(load is not None and load > cores for load in loads):
        start, end = ("n/a" if load is None else f"{load:.1f}" for load in loads)
        lines.append(
            f"warning: the machine was busy (1-minute load {start} at start, {end} at end, on "
            f"{cores} cores): every figure is lower than on an idle machine"
        )
    return "\n".join(lines)


def _agreement_text(run: PeerRun, reference: PeerRun | None) -> str:
    if run is reference:
        return "(reference)"
    if run.agreement is None:
        return "n/a"
    agreement = run.agreement
    verdict = "meets" if agreement.meets_parity_rule else "misses"
    return f"{agreement.identical}/{agreement.total} ({verdict} the parity rule)"


# -- plot --------------------------------------------------------------------------

# 3x5 pixel glyphs: five rows, each a digit whose three bits are the pixels left to right.
_FONT: dict[str, str] = {
    "0": "75557", "1": "26227", "2": "71747", "3": "71717", "4": "55711", "5": "74717",
    "6": "74757", "7": "71222", "8": "75757", "9": "75717", "A": "25755", "B": "65656",
    "C": "34443", "D": "65556", "E": "74647", "F": "74644", "G": "34553", "H": "55755",
    "I": "72227", "J": "11152", "K": "55655", "L": "44447", "M": "57755", "N": "65555",
    "O": "25552", "P": "65644", "Q": "25563", "R": "65655", "S": "34216", "T": "72222",
    "U": "55557", "V": "55552", "W": "55775", "X": "55255", "Y": "55222", "Z": "71247",
    " ": "00000", "-": "00700", ".": "00002", "/": "11244", "(": "12221", ")": "42224",
    ":": "02020", ",": "00024", "_": "00007", "=": "07070", "%": "51245", "?": "71202",
}  # fmt: skip
_WHITE = (255, 255, 255)
_INK = (40, 40, 40)
_GRID = (225, 225, 225)
_COLOURS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189))


@dataclass(frozen=True)
class Series:
    label: str
    points: tuple[tuple[float, float], ...]  # (x, y), x > 0
    joined: bool  # draw a line through the points


class Canvas:
    """An RGB raster with just what a small chart needs: boxes, lines and 3x5-pixel text."""

    def __init__(self, width: int, height: int) -> None:
        self.pixels = np.full((height, width, 3), _WHITE, dtype=np.uint8)

    def box(self, x0: int, y0: int, x1: int, y1: int, colour: tuple[int, int, int]) -> None:
        """Fills [x0, x1) x [y0, y1), clipped to the canvas."""
        height, width, _ = self.pixels.shape
        self.pixels[max(0, y0) : min(height, y1), max(0, x0) : min(width, x1)] = colour

    def line(
        self, x0: float, y0: float, x1: float, y1: float, colour: tuple[int, int, int], width: int
    ) -> None:
        steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        xs = np.rint(np.linspace(x0, x1, steps)).astype(int)
        ys = np.rint(np.linspace(y0, y1, steps)).astype(int)
        height, canvas_width, _ = self.pixels.shape
        for dy in range(-(width // 2), width - width // 2):
            for dx in range(-(width // 2), width - width // 2):
                keep = (
                    (ys + dy >= 0) & (ys + dy < height) & (xs + dx >= 0) & (xs + dx < canvas_width)
                )
                self.pixels[ys[keep] + dy, xs[keep] + dx] = colour

    def text(
        self,
        x: int,
        y: int,
        text: str,
        colour: tuple[int, int, int] = _INK,
        scale: int = 2,
        align: str = "left",
    ) -> None:
        """Draws `text` (upper-cased) with its top at y; x is its left, centre or right."""
        x -= {"left": 0, "center": text_width(text, scale) // 2, "right": text_width(text, scale)}[
            align
        ]
        block = np.ones((scale, scale), dtype=bool)
        for index, char in enumerate(text.upper()):
            rows = _FONT.get(char, _FONT["?"])
            glyph = np.array([[int(row) >> (2 - col) & 1 for col in range(3)] for row in rows])
            ys, xs = np.nonzero(np.kron(glyph, block))
            ys, xs = ys + y, xs + x + index * 4 * scale
            height, width, _ = self.pixels.shape
            keep = (ys >= 0) & (ys < height) & (xs >= 0) & (xs < width)
            self.pixels[ys[keep], xs[keep]] = colour


def text_width(text: str, scale: int) -> int:
    return max(0, len(text) * 4 * scale - scale)


def nice_step(span: float, ticks: int = 5) -> float:
    """A 1, 2 or 5 times a power of ten step that cuts `span` into about `ticks` parts."""
    raw = span / ticks if span > 0 else 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def render_chart(
    series: Sequence[Series],
    title: str,
    x_label: str,
    y_label: str,
    width: int = 760,
    height: int = 460,
) -> np.ndarray:
    """A chart of `series` on a log2 x axis and a linear y axis from 0; [height, width, 3]."""
    canvas = Canvas(width, height)
    left, right, top, bottom = 90, width - 20, 50, height - 60
    xs = sorted({x for s in series for x, _ in s.points})
    ys = [y for s in series for _, y in s.points]
    if not xs:
        raise ValueError("nothing to plot: every series is empty")
    lo, hi = math.log2(xs[0]), math.log2(xs[-1])
    if hi == lo:
        lo, hi = lo - 1, hi + 1
    step = nice_step(max(ys))
    y_top = step * max(1, math.ceil(max(ys) / step))

    def px(x: float) -> float:
        return left + (math.log2(x) - lo) / (hi - lo) * (right - left - 40) + 20

    def py(y: float) -> float:
        return bottom - y / y_top * (bottom - top)

    ticks = round(y_top / step)
    for tick in range(ticks + 1):
        value = tick * step
        y = round(py(value))
        canvas.box(left, y, right, y + 1, _GRID)
        canvas.text(left - 8, y - 5, f"{value:g}", align="right")
    for x in xs:
        canvas.box(round(px(x)), bottom, round(px(x)) + 1, bottom + 6, _INK)
        canvas.text(round(px(x)), bottom + 10, f"{x:g}", align="center")
    canvas.box(left, top, left + 1, bottom + 1, _INK)
    canvas.box(left, bottom, right, bottom + 1, _INK)
    canvas.text(width // 2, 14, title, scale=3, align="center")
    canvas.text((left + right) // 2, bottom + 32, x_label, align="center")
    canvas.text(8, top - 22, y_label)
    for index, item in enumerate(series):
        colour = _COLOURS[index % len(_COLOURS)]
        points = [(px(x), py(y)) for x, y in item.points]
        if item.joined:
            for (x0, y0), (x1, y1) in itertools.pairwise(points):
                canvas.line(x0, y0, x1, y1, colour, width=3)
        for x, y in points:
            canvas.box(round(x) - 4, round(y) - 4, round(x) + 5, round(y) + 5, colour)
        legend_y = top + 8 + index * 18
        canvas.box(left + 14, legend_y, left + 26, legend_y + 10, colour)
        canvas.text(left + 34, legend_y, item.label)
    return canvas.pixels


def encode_png(pixels: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of `pixels` [height, width, 3] uint8."""
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ValueError(
            f"expected a [height, width, 3] uint8 array, got {pixels.shape} {pixels.dtype}"
        )
    height, width, _ = pixels.shape
    # Each scanline starts with filter type 0 (none).
    scanlines = np.concatenate(
        [np.zeros((height, 1), dtype=np.uint8), pixels.reshape(height, width * 3)], axis=1
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(scanlines.tobytes(), 9))
        + chunk(b"IEND", b"")
    )


def throughput_series(report: BenchReport) -> list[Series]:
    """cellbatch's decode-only tokens/s against sessions, then each peer's end-to-end
    generated tokens/s at its concurrency."""
    series = []
    if report.sweep:
        series.append(
            Series(
                "cellbatch decode-only",
                tuple((p.sessions, p.window.decode_only_tokens_per_s) for p in report.sweep),
                joined=True,
            )
        )
    series += [
        Series(f"{run.label} (end to end)", ((run.concurrency, run.tokens_per_s),), joined=False)
        for run in report.runs
        if run.ok
    ]
    return series


def write_plot(report: BenchReport, path: Path) -> None:
    pixels = render_chart(
        throughput_series(report),
        f"generated tokens/s ({report.options.dtype}, {report.options.threads} threads)",
        "concurrent generations",
        "tokens/s",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_png(pixels))


# -- entry point -------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """`cellbatch bench [options]`; 0 when every part ran, 1 when one failed."""
    options = parse_options(argv)
    report = run_benchmark(options)
    print(format_report(report))
    write_json(report, options.output_json)
    _progress(f"figures written to {options.output_json}")
    if options.plot is not None and (report.sweep or any(run.ok for run in report.runs)):
        write_plot(report, options.plot)
        _progress(f"plot written to {options.plot}")
    failed = report.sweep_error or any(not run.ok for run in report.runs)
    return 1 if failed else 0
