"""The `cellbatch` command line: `run` (a list of prompts through one model), `serve`,
`export` (a model compiled into a program file that `run --model` runs) and `bench`
(throughput against transformers: runs benchmarks/throughput.py of the source checkout).

Owns: argument parsing, reading prompt files, printing, the JSON run report.
Promises: a missing or unreadable prompt file, and an option that is wrong whatever the
model, are errors before the model loads (exit status 2); loading says on stderr what it
did, phase by phase, with the time each took (not with --quiet), and Ctrl-C or SIGTERM
while it loads ends the process at once with one line (exit status 130 or 143);
a bad prompt line fails alone with its line number and the others still run; the
exit status is 0 only when every generation ended by a stop token, a stop string or
the token limit.
Never: generates anything itself; the Engine does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellbatch.types import QUANTIZE_CHOICES, Token

if TYPE_CHECKING:
    from cellbatch.engine import GenerationBatch

# More sessions than this are rarely faster on a CPU and cost KV memory up front.
SESSION_CAP = 256


@dataclass
class PromptLine:
    """One prompt as read from the input, with where it came from."""

    source: str  # e.g. "prompts.txt:3"
    raw: str  # the prompt as the user wrote it
    text: str | None  # None for token prompts
    tokens: list[Token] | None  # None for text prompts
    chat: bool
    problem: str = ""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The benchmark is not part of the package: it lives in the source checkout.
        import runpy

        script = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"
        if not script.is_file():
            print(
                f"cellbatch bench: error: no {script}: the benchmark ships with cellbatch's "
                "source, not with the installed package. In a checkout, run "
                "`pip install -e '.[bench]'`, then `cellbatch bench` or "
                "`python benchmarks/throughput.py`.",
                file=sys.stderr,
            )
            return 2
        sys.path.insert(0, str(script.parent))  # its sibling modules
        return runpy.run_path(str(script))["main"](argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as error:
        print(f"cellbatch: error: {error}", file=sys.stderr)
        return 2


class UsageError(Exception):
    """Bad command-line input found before any work was done."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cellbatch",
        description="Many generations of one language model at once, sharing every forward.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="generate for a list of prompts and print a report")
    run.add_argument("prompts", nargs="*", help="prompts, each like a --prompts-file line")
    source = run.add_mutually_exclusive_group()
    source.add_argument("--prompt-file", type=Path, help="one prompt, used verbatim")
    source.add_argument("--prompts-file", type=Path, help="one prompt per line (\\n = newline)")
    source.add_argument(
        "--prompt-tokens-file", type=Path, help="one prompt per line as whitespace-separated ids"
    )
    run.add_argument("--raw", action="store_true", help="no chat template for prompt lines")
    run.add_argument("--max-new-tokens", type=int, default=256)
    run.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--seed", type=int, default=42, help="per-prompt seeds derive from it")
    run.add_argument("--stop", action="append", default=[], help="a text stop string")
    add_engine_options(run)
    run.add_argument("--report-json", type=Path, help="write the whole report here")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=run_command)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server on the engine")
    add_engine_options(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the model names clients may use; answers carry the first (default: the "
        "model file's name, and its path as given)",
    )
    serve.add_argument(
        "--api-key", help="require Authorization: Bearer KEY (default: $CELLBATCH_API_KEY)"
    )
    serve.add_argument("--max-queued-requests", type=int, default=256)
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20)
    serve.add_argument(
        "--prefix-cache-entries", type=int, default=64, help="finished prompts kept for reuse"
    )
    serve.add_argument(
        "--shutdown-timeout", type=float, default=10.0, help="seconds for running requests"
    )
    serve.add_argument("--quiet", action="store_true", help="no startup lines")
    serve.add_argument(
        "--replicas", type=int, help="N engine replicas on Ray behind the one endpoint"
    )
    serve.add_argument(
        "--threads-per-replica",
        type=int,
        help="torch threads (and Ray CPUs) of each replica (default: a local Ray shares this "
        "machine's cores out; on a cluster, 1)",
    )
    serve.add_argument(
        "--ray-address", help="join this Ray cluster (default: start a local Ray instance)"
    )
    serve.set_defaults(func=_serve_command)

    export = commands.add_parser(
        "export", help="compile a model into a program file that `run --model` runs"
    )
    export.add_argument("--model", help="Hugging Face folder or GGUF file (default: SmolLM2-135M)")
    export.add_argument("-o", "--output", type=Path, required=True, help="the program (.pt2)")
    export.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    export.add_argument("--kv-dtype", help="KV cache dtype (default: the weight dtype)")
    export.add_argument(
        "--quantize",
        default="auto",
        choices=QUANTIZE_CHOICES,
        help="weights: auto (a GGUF file keeps its precision class, e.g. Q4_1 -> int4; "
        "other models stay float), none (float), int8 or int4",
    )
    export.add_argument(
        "--max-step-tokens", type=int, default=544, help="tokens per forward, at most"
    )
    export.add_argument(
        "--decode-widths",
        default="1",
        help="static widths of the decode methods, comma-separated (e.g. 1,8,32)",
    )
    export.add_argument(
        "--min-prefill-tokens",
        type=int,
        default=2,
        help="the prefill method's lower bound (>= 2); shorter slices run as decode rows",
    )
    export.add_argument("--threads", type=int, help="torch and compile threads")
    export.set_defaults(func=_export_command)

    # Listed for --help only: main() hands `bench` and its arguments to the benchmark.
    commands.add_parser(
        "bench", help="throughput against transformers (cellbatch bench --help for its options)"
    )
    return parser


# -- reading prompts ---------------------------------------------------------


def read_prompts(args: argparse.Namespace) -> list[PromptLine]:
    """Every prompt of the invocation; unreadable files raise UsageError."""
    if args.prompt_file is not None:
        text = _read(args.prompt_file)
        return [PromptLine(str(args.prompt_file), text, text, None, chat=False)]
    if args.prompts_file is not None:
        lines = _read(args.prompts_file).splitlines()
        return _text_lines(lines, str(args.prompts_file), chat=not args.raw)
    if args.prompt_tokens_file is not None:
        lines = _read(args.prompt_tokens_file).splitlines()
        return _token_lines(lines, str(args.prompt_tokens_file))
    if args.prompts:
        return _text_lines(args.prompts, "argument", chat=not args.raw)
    raise UsageError(
        "no prompts: give PROMPT arguments or one of --prompt-file, --prompts-file, "
        "--prompt-tokens-file"
    )


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise UsageError(f"prompt file {path} does not exist") from error
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read prompt file {path}: {error}") from error


def _text_lines(lines: Sequence[str], origin: str, chat: bool) -> list[PromptLine]:
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            _note(f"{origin}:{number}: empty line skipped")
            continue
        text = line.replace("\\n", "\n")
        prompts.append(PromptLine(f"{origin}:{number}", line, text, None, chat))
    return prompts


def _token_lines(lines: Sequence[str], origin: str) -> list[PromptLine]:
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            _note(f"{origin}:{number}: empty line skipped")
            continue
        prompt = PromptLine(f"{origin}:{number}", line, None, [], chat=False)
        try:
            prompt.tokens = [int(word) for word in line.split()]
        except ValueError:
            bad = next(word for word in line.split() if not _is_int(word))
            prompt.problem = f"{bad!r} is not a token id (ids are whitespace-separated integers)"
        prompts.append(prompt)
    return prompts


def _is_int(word: str) -> bool:
    try:
        int(word)
    except ValueError:
        return False
    return True


def _note(message: str) -> None:
    print(f"cellbatch: note: {message}", file=sys.stderr)


# -- memory ------------------------------------------------------------------


def rss_bytes() -> int:
    """The process's resident set size now (not its peak)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_snapshot() -> dict[str, int]:
    # torch first, so that "before load" holds the runtime however far the imports got.
    import torch

    snapshot = {"rss_bytes": rss_bytes()}
    if torch.cuda.is_available():
        snapshot["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
    return snapshot


# -- run ---------------------------------------------------------------------


def _check_options(args: argparse.Namespace) -> None:
    """Refuses what would only fail after the model has loaded."""
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if any(stop == "" for stop in args.stop):
        raise UsageError("--stop needs a non-empty string (an empty one matches at once)")
    if args.report_json is not None:
        folder = args.report_json.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise UsageError(
                f"cannot write the report to {args.report_json}: {folder} is not a writable folder"
            )


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
    from cellbatch.model.transformer import resolve_dtype
    from cellbatch.types import InvalidArgumentError

    for flag, value in (("--dtype", args.dtype), ("--kv-dtype", args.kv_dtype)):
        try:
            if value is not None:
                resolve_dtype(value)
        except InvalidArgumentError as error:
            raise UsageError(f"{flag}: {error}") from error


@contextmanager
def _exit_on_signal(doing: str) -> Iterator[None]:
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


def _say_loaded(what: str, seconds: float) -> None:
    """The load's progress line for one phase."""
    print(f"cellbatch: {what} in {seconds:.1f} s", file=sys.stderr, flush=True)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The model and engine-shape options `run` and `serve` share."""
    parser.add_argument("--model", help="Hugging Face folder or GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--max-sessions", type=int)
    parser.add_argument("--max-session-tokens", type=int)
    parser.add_argument("--max-batch-tokens", type=int, help="tokens per forward (W)")
    parser.add_argument("--max-decode-sequences", type=int)
    parser.add_argument("--max-prefill-chunk", type=int)
    parser.add_argument("--max-cells", type=int, help="KV cells at most (default: a 4 GiB pool)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--kv-dtype", help="KV cache dtype (default: the weight dtype)")
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "compiled", "torch"),
        help="attention and per-layer ops: compiled for this CPU (built when cellbatch was "
        "installed), pure torch, or auto (compiled where they were built)",
    )
    parser.add_argument("--threads", type=int, help="torch threads")
    parser.add_argument(
        "--quantize",
        default="auto",
        choices=QUANTIZE_CHOICES,
        help="weights: auto (a GGUF file keeps its precision class, e.g. Q4_1 -> int4; "
        "other models stay float), none (float), int8 or int4",
    )
    parser.add_argument(
        "--admission",
        default="optimistic",
        choices=("optimistic", "reserve"),
        help="optimistic: start what fits now, preempt under KV pressure; reserve: start "
        "only what fits at its worst case",
    )


def engine_shape(args: argparse.Namespace, max_sessions: int | None) -> dict[str, int]:
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


def load_engine(args: argparse.Namespace, shape: dict[str, int], **options: Any):  # -> Engine
    """The Engine the shared options ask for; a bad option is a UsageError, before anything
    loads. Unless --quiet, each phase of the load says what it did on stderr."""
    check_engine_options(args)
    try:
        with _exit_on_signal("loading the model"):
            if not args.quiet:
                print(f"cellbatch: loading {args.model or 'the default model'}", file=sys.stderr)
            from cellbatch.engine import Engine

            return Engine.from_pretrained(
                args.model,
                dtype=args.dtype,
                kv_dtype=args.kv_dtype,
                threads=args.threads,
                kernels=args.kernels,
                quantize=args.quantize,
                admission=args.admission,
                progress=None if args.quiet else _say_loaded,
                **options,
                **shape,
            )
    except (ValueError, FileNotFoundError) as error:  # InvalidArgumentError among them
        raise UsageError(str(error)) from error


def _export_command(args: argparse.Namespace) -> int:
    from cellbatch.export.exporter import ExportOptions, export_program
    from cellbatch.types import InvalidArgumentError

    try:
        widths = tuple(int(width) for width in args.decode_widths.split(","))
    except ValueError:
        raise UsageError(
            f"--decode-widths takes comma-separated integers, got {args.decode_widths!r}"
        ) from None
    if args.model is not None and not Path(args.model).exists():
        raise UsageError(f"model {args.model} does not exist (give a folder or a .gguf file)")
    options = ExportOptions(
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        quantize=args.quantize,
        max_step_tokens=args.max_step_tokens,
        decode_widths=widths,
        min_prefill_tokens=args.min_prefill_tokens,
        threads=args.threads,
    )
    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr, flush=True)

    try:
        export_program(args.model, args.output, options, progress)
    except (InvalidArgumentError, ValueError, FileNotFoundError) as error:
        raise UsageError(str(error)) from error
    return 0


def _serve_command(args: argparse.Namespace) -> int:
    from cellbatch.server.command import serve_command

    return serve_command(args)


def run_command(args: argparse.Namespace) -> int:
    _check_options(args)
    prompts = read_prompts(args)
    if not prompts:
        raise UsageError("every prompt line is empty: nothing to run")
    if args.model is not None and not Path(args.model).exists():
        raise UsageError(f"model {args.model} does not exist (give a folder or a .gguf file)")
    max_sessions = args.max_sessions
    if max_sessions is None:
        max_sessions = min(len(prompts), SESSION_CAP)
        if len(prompts) > SESSION_CAP:
            _note(
                f"{len(prompts)} prompts, {SESSION_CAP} sessions at once (--max-sessions to change)"
            )

    from cellbatch.types import GenConfig, InvalidArgumentError, SamplingParams

    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    except InvalidArgumentError as error:
        raise UsageError(str(error)) from error
    shape = engine_shape(args, max_sessions)

    with _exit_on_signal("loading the model"):
        # The libraries are the baseline, not part of the model's load.
        importlib.import_module("cellbatch.engine")
        memory = {"before_load": memory_snapshot()}
        load_started = time.perf_counter()
        engine = load_engine(args, shape)
        load_seconds = time.perf_counter() - load_started
        memory["after_load"] = memory_snapshot()

    with engine:
        inputs, failures = _encode(prompts, engine)
        config = GenConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed)
        if not args.quiet:
            _note(f"{len(inputs)} prompts started (Ctrl-C stops them and keeps what is done)")
        started = time.perf_counter()
        with _progress(args.quiet) as progress:
            batch = engine.generate_async(
                [tokens for _, tokens in inputs],
                config,
                stop=args.stop,
                on_tokens=progress,
            )
            interrupted = _wait_interruptibly(batch)
            results = batch.results()
        generate_seconds = time.perf_counter() - started
        memory["after_generate"] = memory_snapshot()
        metrics = engine.metrics()
        report = _report(
            prompts,
            inputs,
            failures,
            results,
            engine,
            metrics,
            args,
            config,
            memory,
            generate_seconds,
            load_seconds,
        )

    _print_report(report, metrics.report())
    if args.report_json is not None:
        args.report_json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        _note(f"report written to {args.report_json}")
    if interrupted:
        _note(
            f"interrupted by {signal.Signals(interrupted).name}: unfinished generations were "
            "cancelled; the report above holds everything generated until then"
        )
        return 128 + interrupted
    ok = all(entry["finish_reason"] in _GOOD_ENDINGS for entry in report["generations"])
    return 0 if ok else 1


def _wait_interruptibly(batch: GenerationBatch) -> int:
    """Wait for the batch; the first SIGINT or SIGTERM cancels what still runs (the
    results so far are kept and reported), a second SIGINT exits at once. Returns the
    signal number that interrupted the wait, or 0."""
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        if received and signum == signal.SIGINT:
            os._exit(128 + signal.SIGINT)  # the user insists: no report, no cleanup
        received.append(signum)
        batch.cancel()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # Short waits, so that the main thread runs the handler as soon as a signal comes.
        while not batch.wait(0.1):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return received[0] if received else 0


_GOOD_ENDINGS = ("stop_token", "stop_string", "token_limit")


def _encode(
    prompts: list[PromptLine], engine: Any
) -> tuple[list[tuple[int, list[Token]]], dict[int, str]]:
    """(index, tokens) for every prompt that could be encoded; the others' problems."""
    inputs: list[tuple[int, list[Token]]] = []
    failures: dict[int, str] = {}
    for index, prompt in enumerate(prompts):
        if prompt.problem:
            failures[index] = f"{prompt.source}: {prompt.problem}"
        elif prompt.tokens is not None:
            inputs.append((index, prompt.tokens))
        elif engine.tokenizer is None:
            failures[index] = f"{prompt.source}: this model has no tokenizer for text prompts"
        elif prompt.chat and not engine.tokenizer.has_chat_template:
            failures[index] = (
                f"{prompt.source}: this model has no chat template; pass --raw to send the "
                "line as it is"
            )
        elif prompt.chat:
            inputs.append((index, engine.chat_tokens(prompt.text)))
        else:
            inputs.append((index, engine.tokenizer.encode(prompt.text)))
    return inputs, failures


class _progress:
    """A tqdm bar of generated tokens on stderr, when stderr is a terminal."""

    def __init__(self, quiet: bool) -> None:
        self._bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(unit="tok", desc="generating", file=sys.stderr, smoothing=0.1)

    def __enter__(self) -> _progress | None:
        return self if self._bar is not None else None

    def __call__(self, tokens: int) -> None:
        self._bar.update(tokens)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()


def _report(
    prompts: list[PromptLine],
    inputs: list[tuple[int, list[Token]]],
    failures: dict[int, str],
    results: list[Any],
    engine: Any,
    metrics: Any,
    args: argparse.Namespace,
    config: Any,
    memory: dict[str, dict[str, int]],
    generate_seconds: float,
    load_seconds: float,
) -> dict[str, Any]:
    generations: list[dict[str, Any]] = [{} for _ in prompts]
    for index, problem in failures.items():
        generations[index] = _generation_entry(prompts[index], [], 0, [], "", "failed", problem)
    for (index, tokens), result in zip(inputs, results, strict=True):
        error = f"{prompts[index].source}: {result.error}" if result.error else ""
        generations[index] = _generation_entry(
            prompts[index],
            tokens,
            result.shared_prefix_tokens,
            result.tokens,
            result.text,
            str(result.finish_reason),
            error,
        )
    generated = sum(len(entry["tokens"]) for entry in generations)
    return {
        "generations": generations,
        "memory": memory,
        "kv": engine.kv_usage(),
        "weights_bytes": engine.weights_bytes,
        "config": {
            "model": str(engine.model_path),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_dtype": str(engine.kv_dtype).removeprefix("torch."),
            "kernels": engine.kernels,
            "executor": engine.executor_kind,
            "weight_format": engine.weights.format,
            "weight_formats": engine.weights.formats,
            "weight_kernel": engine.weights.kernel,
            "weights_bytes_by_format": engine.weights.bytes_by_format,
            "admission": engine.admission.value,
            "threads": _threads(),
            "max_new_tokens": config.max_new_tokens,
            "temperature": config.sampling.temperature,
            "top_p": config.sampling.top_p,
            "top_k": config.sampling.top_k,
            "seed": config.seed,
            "stop": list(args.stop),
            "stop_tokens": sorted(engine.stop_tokens),
            **asdict(engine.shape),
        },
        "timing": {
            "load_seconds": load_seconds,
            "generate_seconds": generate_seconds,
            "generated_tokens": generated,
            "tokens_per_second": generated / generate_seconds if generate_seconds > 0 else 0.0,
        },
        "engine": metrics.as_dict(),
    }


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _generation_entry(
    prompt: PromptLine,
    prompt_tokens: list[Token],
    shared_prefix_tokens: int,
    tokens: list[Token],
    text: str,
    finish_reason: str,
    error: str,
) -> dict[str, Any]:
    return {
        "source": prompt.source,
        "prompt": prompt.raw,
        "prompt_tokens": len(prompt_tokens),
        "shared_prefix_tokens": shared_prefix_tokens,
        "tokens": tokens,
        "text": text,
        "finish_reason": finish_reason,
        "error": error,
    }


def _print_report(report: dict[str, Any], engine_text: str) -> None:
    kv = report["kv"]
    for number, entry in enumerate(report["generations"], start=1):
        print(f"=== [{number}] {entry['source']} ===")
        print(f">>> {entry['prompt']}")
        if entry["error"]:
            print(f"!!! {entry['finish_reason']}: {entry['error']}")
        else:
            print(entry["text"])
        print(
            f"--- {entry['finish_reason']}, {entry['prompt_tokens']} prompt tokens "
            f"({entry['shared_prefix_tokens']} shared with the other prompts), "
            f"{len(entry['tokens'])} generated"
        )
        print()
    print("=== engine ===")
    print(engine_text)
    print("=== KV pool ===")
    print(
        f"cells in use {kv['cells_in_use']} of {kv['max_cells']}, pool rows {kv['pool_rows']}, "
        f"allocated {_mib(kv['allocated_bytes'])}, growths {kv['growth_count']}, "
        f"{kv['bytes_per_cell']} bytes per cell"
    )
    print("=== memory ===")
    for stage in ("before_load", "after_load", "after_generate"):
        snapshot = report["memory"][stage]
        extra = (
            f", CUDA {_mib(snapshot['cuda_allocated_bytes'])}"
            if "cuda_allocated_bytes" in snapshot
            else ""
        )
        print(f"{stage.replace('_', ' '):>15}: RSS {_mib(snapshot['rss_bytes'])}{extra}")
    by_format = report["config"]["weights_bytes_by_format"]
    parts = ", ".join(f"{name} {_mib(count)}" for name, count in by_format.items())
    print(
        f"{'weights':>15}: {_mib(report['weights_bytes'])} ({parts}; "
        f"{report['config']['weight_format']})"
    )
    timing = report["timing"]
    print("=== throughput ===")
    print(
        f"{timing['generated_tokens']} tokens in {timing['generate_seconds']:.2f} s: "
        f"{timing['tokens_per_second']:.1f} tokens/s (load {timing['load_seconds']:.2f} s)"
    )


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


if __name__ == "__main__":
    sys.exit(main())
