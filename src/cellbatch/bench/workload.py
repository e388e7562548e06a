"""The throughput benchmark's workload: its chat prompts, the peers it can time, its sizes,
and its command-line options (`cellbatch bench`, also `benchmarks/throughput.py`).

Owns: the 32 chat prompts; the peers' and the sweep's names; the default, --quick and
warm-up sizes; `BenchOptions` and the parsing of the options into it.
Promises: every option comes back resolved (no "auto", no None where a default exists);
a bad value, a missing --model or a plot without matplotlib exits with a usage error
naming the option and the fix, before any model loads.
Never: loads a model or times anything.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cellbatch.engine import DEFAULT_MAX_BATCH_TOKENS
from cellbatch.types import ACTIVATION_CHOICES, QUANTIZE_CHOICES

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
VLLM = "vllm"  # a peer in its own virtualenv, timed only when asked (--peer)
OPTIONAL_PEERS = (VLLM,)
DEFAULT_VLLM_PYTHON = Path(".venv-peers/vllm/bin/python")
DEFAULT_PEER_CACHE = Path(".venv-peers")
# Whose greedy tokens the others are checked against: the first of these that ran.
REFERENCES = (SINGLE, PADDED)

DEFAULT_PROMPTS = 32
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_SESSIONS = (1, 8, 32, 64)
QUICK_PROMPTS = 8
QUICK_MAX_NEW_TOKENS = 16
QUICK_SESSIONS = (1, 4)
WARMUP_PROMPTS = 2  # benchmarks/kv_pressure.py's warm-up
WARMUP_TOKENS = 4


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
    peers: frozenset[str] = frozenset()  # OPTIONAL_PEERS asked for
    vllm_python: Path = DEFAULT_VLLM_PYTHON
    peer_cache: Path = DEFAULT_PEER_CACHE
    quantize: str = "none"  # cellbatch's weights: float as the peers', or as `run` takes it
    activations: str = "auto"  # what cellbatch's int4 products do with their inputs, as `run`
    ignore_eos: bool = False  # every prompt generates exactly max_new_tokens (no stop tokens)
    device: str = "cpu"  # where cellbatch and transformers run, resolved from "auto"


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
    parser.add_argument(
        "--quantize",
        default="none",
        choices=QUANTIZE_CHOICES,
        help="cellbatch's weights: none (float, as every peer has them; the default), or as "
        "`cellbatch run --quantize` takes it (auto, run's default, keeps a GGUF's int4/int8)",
    )
    parser.add_argument(
        "--activations",
        default="auto",
        choices=ACTIVATION_CHOICES,
        help="inputs of cellbatch's int4 products, as `cellbatch run --activations` takes it",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--device",
        default="auto",
        help="where cellbatch and transformers run: auto (a CUDA GPU when torch sees one, "
        "else the CPU), cpu, cuda or cuda:N",
    )
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
        "--peer",
        action="append",
        default=[],
        choices=OPTIONAL_PEERS,
        help="also time this peer, from its own virtualenv (`make peers` builds them)",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=DEFAULT_VLLM_PYTHON,
        help=f"the Python of vLLM's virtualenv (default {DEFAULT_VLLM_PYTHON})",
    )
    parser.add_argument(
        "--peer-cache",
        type=Path,
        default=DEFAULT_PEER_CACHE,
        help="where the peers' copies of the model are kept (default .venv-peers)",
    )
    parser.add_argument(
        "--fp32-baseline",
        action=argparse.BooleanOptionalAction,
        help=f"also time {PADDED} in float32 (default: when --dtype is not float32)",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="no stop tokens: every prompt generates exactly --max-new-tokens, every peer "
        "alike (the decode-bound run: 32 prompts x 128 tokens with --max-new-tokens 128)",
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
    parser.add_argument(
        "--report",
        action="store_true",
        help="run nothing: render docs/results/*.json into README.md and docs/benchmarks.md "
        "(cellbatch bench --report --help for its options)",
    )
    return parser


def parse_options(argv: Sequence[str] | None = None) -> BenchOptions:
    """Options with every default resolved; bad values exit with a usage error."""
    from cellbatch.model.device import resolve_device
    from cellbatch.model.transformer import resolve_dtype
    from cellbatch.types import InvalidArgumentError

    parser = _parser()
    args = parser.parse_args(argv)
    if args.model is not None and not args.model.exists():
        parser.error(f"--model {args.model} does not exist: give a model folder or a .gguf file")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    prompts = args.prompts
    if prompts is None:
        prompts = QUICK_PROMPTS if args.quick else DEFAULT_PROMPTS
    if not 1 <= prompts <= len(CHAT_PROMPTS):
        parser.error(f"--prompts must be in 1..{len(CHAT_PROMPTS)}, got {prompts}")
    max_new = args.max_new_tokens
    if max_new is None:
        max_new = QUICK_MAX_NEW_TOKENS if args.quick else DEFAULT_MAX_NEW_TOKENS
    if max_new < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {max_new}")
    if args.max_batch_tokens < 2:
        parser.error(f"--max-batch-tokens must be >= 2, got {args.max_batch_tokens}")
    sessions: tuple[int, ...] = QUICK_SESSIONS if args.quick else DEFAULT_SESSIONS
    if args.sessions is not None:
        try:
            sessions = tuple(int(word) for word in args.sessions.split(","))
        except ValueError:
            parser.error(
                f"--sessions takes comma-separated integers like 1,8,32, got {args.sessions!r}"
            )
        if not sessions or min(sessions) < 1:
            parser.error(f"--sessions counts must be >= 1, got {args.sessions!r}")
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(
            "the plot needs matplotlib, which is not installed: install cellbatch's bench "
            "extra (pip install -e '.[bench]' in the checkout), or pass --no-plot"
        )
    try:
        device = resolve_device(args.device)
    except InvalidArgumentError as error:
        parser.error(f"--device {args.device}: {error}")
    dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    output = args.output_json or Path("benchmarks/results") / (
        f"throughput-{dtype}{'-quick' if args.quick else ''}.json"
    )
    return BenchOptions(
        model=args.model,
        dtype=dtype,
        threads=args.threads if args.threads is not None else torch.get_num_threads(),
        prompts=prompts,
        max_new_tokens=max_new,
        sessions=sessions,
        max_batch_tokens=args.max_batch_tokens,
        skip=frozenset(args.skip),
        fp32_baseline=args.fp32_baseline if args.fp32_baseline is not None else dtype != "float32",
        quick=args.quick,
        output_json=output,
        plot=None if args.no_plot else (args.plot or output.with_suffix(".png")),
        peers=frozenset(args.peer),
        vllm_python=args.vllm_python,
        peer_cache=args.peer_cache,
        quantize=args.quantize,
        activations=args.activations,
        ignore_eos=args.ignore_eos,
        device=str(device),
    )
