"""The options `run`, `serve` and `export` share, and loading the engine they ask for.

Owns: `UsageError` (bad command-line input found before any work) and `usage_error` (a
checker's refusal turned into one), the engine options and their checks, the shape they
give, loading the engine with progress lines, and the exit on a signal while a phase
that cannot be stopped part-way runs.
Promises: an option that is wrong whatever the model is a `UsageError` before the model
loads; loading says on stderr what it did, phase by phase, with the time each took
(not with --quiet), and Ctrl-C or SIGTERM while it loads ends the process at once with
one line (exit status 130 or 143).
Never: reads prompts or prints a report.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellbatch.types import (
    ACTIVATION_CHOICES,
    DEFAULT_MAX_LORAS,
    QUANTIZE_CHOICES,
    InvalidArgumentError,
)

if TYPE_CHECKING:
    from cellbatch.engine import Engine
    from cellbatch.speculative import SpeculativeConfig


class UsageError(Exception):
    """Bad command-line input found before any work was done."""


@contextmanager
def usage_error(
    option: str = "", errors: type[Exception] | tuple[type[Exception], ...] = InvalidArgumentError
) -> Iterator[None]:
    """Inside the block, an exception of `errors` (a checker's refusal) becomes a
    UsageError with its message, after `option: ` when an option is named."""
    try:
        yield
    except errors as error:
        raise UsageError(f"{option}: {error}" if option else str(error)) from error


def note(message: str) -> None:
    print(f"cellbatch: note: {message}", file=sys.stderr)


# Engine options whose values are counts: none can be below 1, whatever the model.
_COUNT_OPTIONS = (
    "max_sessions",
    "max_session_tokens",
    "max_batch_tokens",
    "max_decode_sequences",
    "max_prefill_chunk",
    "max_cells",
    "threads",
)


def check_engine_options(args: argparse.Namespace) -> None:
    """Refuses engine options that are wrong whatever the model, before it loads."""
    for name in _COUNT_OPTIONS:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    lora_adapters(args)
    from cellbatch.machine import check_numa
    from cellbatch.model.device import device_quantize, resolve_device
    from cellbatch.model.transformer import resolve_dtype, resolve_kv_dtype

    with usage_error("--numa", ValueError):
        check_numa(args.numa)
    with usage_error("--dtype"):
        weights = resolve_dtype(args.dtype)
    with usage_error("--kv-dtype"):
        resolve_kv_dtype(args.kv_dtype, weights)
    with usage_error(f"--device {args.device}"):
        device = resolve_device(args.device)
    with usage_error(f"--quantize {args.quantize}"):
        device_quantize(args.quantize, device)
    speculative_config(args)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """--speculative-config, checked (a UsageError when it is wrong)."""
    from cellbatch.speculative import parse_speculative_config

    with usage_error("--speculative-config"):
        return parse_speculative_config(args.speculative_config)


@contextmanager
def exit_on_signal(doing: str) -> Iterator[None]:
    """While the block runs, Ctrl-C (SIGINT) or SIGTERM ends the process at once with one
    line and the status 128 + signal. For loading: it writes nothing that needs undoing, and
    its thread cannot be stopped part-way (an exception would wait for it, then trace)."""

    def on_signal(signum: int, frame: object) -> None:
        sys.stdout.flush()
        name = signal.Signals(signum).name
        print(f"cellbatch: interrupted by {name} while {doing}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    # A signal the process was started ignoring (nohup, a background job) stays ignored.
    signals = [
        sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) != signal.SIG_IGN
    ]
    previous = {sig: signal.signal(sig, on_signal) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def say_loaded(what: str, seconds: float) -> None:
    """The load's progress line for one phase."""
    print(f"cellbatch: {what} in {seconds:.1f} s", file=sys.stderr, flush=True)


def add_weight_options(parser: argparse.ArgumentParser) -> None:
    """How the weights are held and multiplied: the options of the engine (`run`, `serve`)
    that `export` fixes in a program."""
    parser.add_argument(
        "--quantize",
        default="auto",
        choices=QUANTIZE_CHOICES,
        help="weights: auto (a GGUF file keeps its precision class: Q4_0, Q4_1 and "
        "K-quant blocks as they are, Q8_0 as int8; other models stay float), none (float), "
        "int8 or int4",
    )
    parser.add_argument(
        "--activations",
        default="auto",
        choices=ACTIVATION_CHOICES,
        help="inputs of the int4 products: auto (int8 for some products where the CPU has "
        "AVX512-VNNI or AVX2 and the model runs in the dtype auto picks), float (the model's "
        "dtype) or int8 (quantised per group of 32)",
    )


def lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules item, NAME=PATH (vLLM's form), as (name, path)."""
    name, equals, path = text.partition("=")
    if not equals or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=PATH (a name for the adapter, then its PEFT folder)"
        )
    return name.strip(), path.strip()


def lora_adapters(args: argparse.Namespace) -> dict[str, str]:
    """The adapters --lora-modules names, by name; a name given twice or a folder that
    does not exist is a UsageError, before the model loads."""
    adapters: dict[str, str] = {}
    for name, path in args.lora_modules or ():
        if name in adapters:
            raise UsageError(f"--lora-modules names {name!r} twice; give each adapter one name")
        if not Path(path).is_dir():
            raise UsageError(
                f"--lora-modules {name}={path}: {path} is not a folder (give the folder PEFT "
                "saved: adapter_config.json + adapter_model.safetensors)"
            )
        adapters[name] = path
    if args.max_loras < 1:
        raise UsageError(f"--max-loras must be >= 1, got {args.max_loras}")
    if len(adapters) > args.max_loras:
        raise UsageError(
            f"--lora-modules names {len(adapters)} adapters, above --max-loras "
            f"{args.max_loras}; raise --max-loras"
        )
    return adapters


def add_adapter_options(parser: argparse.ArgumentParser) -> None:
    """The LoRA adapters `run` and `serve` load beside the model."""
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=lora_module,
        metavar="NAME=PATH",
        help="LoRA adapters to serve beside the model: a name and the folder PEFT saved "
        "(adapter_config.json + adapter_model.safetensors); repeat or list several",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=DEFAULT_MAX_LORAS,
        help=f"LoRA adapters loaded at once, at most (default {DEFAULT_MAX_LORAS})",
    )


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The model and engine-shape options `run` and `serve` share."""
    parser.add_argument("--model", help="Hugging Face folder or GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--max-sessions", type=int)
    parser.add_argument("--max-session-tokens", type=int)
    parser.add_argument("--max-batch-tokens", type=int, help="tokens per forward (W)")
    parser.add_argument("--max-decode-sequences", type=int)
    parser.add_argument("--max-prefill-chunk", type=int)
    parser.add_argument(
        "--cache-dir",
        help="where weights converted at load (a GGUF file's blocks, --quantize) are kept, so "
        "that the next start maps them instead of converting (default: $CELLBATCH_CACHE_DIR "
        "or ~/.cache/cellbatch)",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="neither read nor write the weights cache"
    )
    parser.add_argument(
        "--max-cells",
        type=int,
        help="KV cells at most (default: what every session at its longest would fill, within "
        "the memory left once the weights are in)",
    )
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument(
        "--kv-dtype",
        help="KV cache dtype: auto, float32, bfloat16, float16, or int8 (per-head scales per "
        "cell: about half bf16's memory per session; default: the weight dtype)",
    )
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "compiled", "torch"),
        help="attention and per-layer ops: compiled for this CPU (built when cellbatch was "
        "installed), pure torch, or auto (compiled where they were built)",
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: one per physical core)"
    )
    parser.add_argument(
        "--numa",
        default="auto",
        help="auto (on a machine with several NUMA nodes, bind the threads to the node with "
        "the most cores, whose memory then holds the model), off, or a node number",
    )
    add_device_options(parser)
    add_weight_options(parser)
    parser.add_argument(
        "--admission",
        default="optimistic",
        choices=("optimistic", "reserve"),
        help="optimistic: start what fits now, preempt under KV pressure; reserve: start "
        "only what fits at its worst case",
    )
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding, vLLM\'s spelling: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        '(prompt lookup) or \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}\' (a smaller model with the same tokenizer); the '
        "tokens are the same as without it, only faster where drafts are accepted",
    )
    add_adapter_options(parser)


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """Where the model runs, and how a GPU runs it (`run`, `serve`)."""
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N; on a "
        "GPU the weights are float (bf16 by default)",
    )
    parser.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU: capture each decode width once as a CUDA graph and replay it (default "
        "on; --no-cuda-graph runs every forward eagerly)",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="vLLM's spelling of --no-cuda-graph"
    )
    parser.add_argument(
        "--weight-sharing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU: one copy of the weights for every method and graph (default on; "
        "--no-weight-sharing gives each its own)",
    )


def engine_shape(args: argparse.Namespace, max_sessions: int | None) -> dict[str, Any]:
    """The EngineShape fields the user set."""
    return {
        name: value
        for name, value in (
            ("max_sessions", max_sessions),
            ("max_session_tokens", args.max_session_tokens),
            ("max_batch_tokens", args.max_batch_tokens),
            ("max_decode_sequences", args.max_decode_sequences),
            ("max_prefill_chunk", args.max_prefill_chunk),
            ("max_cells", args.max_cells),
        )
        if value is not None
    }


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """How the model runs, as the options set it: the same for one engine and for each
    replica."""
    return {
        "dtype": args.dtype,
        "kv_dtype": args.kv_dtype,
        "kernels": args.kernels,
        "quantize": args.quantize,
        "activations": args.activations,
        "admission": args.admission,
        "device": args.device,
        "cuda_graph": args.cuda_graph and not args.enforce_eager,
        "weight_sharing": args.weight_sharing,
        "weights_cache": None if args.no_cache else args.cache_dir or "auto",
        "speculative": speculative_config(args),
        "lora_adapters": lora_adapters(args),
        "max_loras": args.max_loras,
    }


def load_engine(args: argparse.Namespace, shape: dict[str, Any], **options: Any) -> Engine:
    """The Engine the shared options ask for; a bad option is a UsageError, before anything
    loads. Unless --quiet, each phase of the load says what it did on stderr."""
    check_engine_options(args)
    # ValueError: InvalidArgumentError among them.
    with usage_error(errors=(ValueError, FileNotFoundError)), exit_on_signal("loading the model"):
        if not args.quiet:
            print(f"cellbatch: loading {args.model or 'the default model'}", file=sys.stderr)
        from cellbatch.engine import Engine

        return Engine.from_pretrained(
            args.model,
            threads=args.threads,
            numa=args.numa,
            progress=None if args.quiet else say_loaded,
            **model_options(args),
            **options,
            **shape,
        )
