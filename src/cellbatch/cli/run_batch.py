"""`cellbatch run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file through
one model, offline, as vLLM's `run-batch` takes and writes it.

Owns: the command's options and their checks, reading the input file, running its lines
through the server's own line runner (`cellbatch.server.batch_lines`) on one engine,
the progress bar, the output file, the report and the exit status.
Promises: the output file holds one line per request line of the input, in its order,
each what the server's batch writes for that line (the same parsing, planning,
generation and body: greedy lines give the server's tokens), successes and errors
alike; a malformed line gets its error line and the others run; an input file that
cannot be read, an output file that cannot be written, or an option that is wrong
whatever the model, is an error before the model loads (exit 2); the first SIGINT or
SIGTERM cancels what still runs, writes every line (the unfinished ones as `cancelled`
errors) and the report, then exits 128 + signal; the exit status is 0 only when every
line was answered 200.
Never: serves HTTP, or stores anything but the output file (and the report asked for).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellbatch.cli.options import UsageError, add_engine_options, engine_shape, load_engine, note
from cellbatch.cli.report import memory_snapshot
from cellbatch.cli.run import ProgressBar
from cellbatch.generation_config import POOLING_CHOICES
from cellbatch.tool_calls.formats import FORMATS
from cellbatch.types import DEFAULT_PRIORITY

if TYPE_CHECKING:
    from cellbatch.engine import Engine
    from cellbatch.server.batch_lines import LineOutcome, LineRunner


def add_run_batch_command(commands: Any) -> None:
    """`run-batch` and its options, on the `cellbatch` parser's subcommands."""
    parser = commands.add_parser(
        "run-batch",
        help="answer an OpenAI batch file (JSONL requests) offline, as vLLM's run-batch",
    )
    parser.add_argument(
        "-i", "--input-file", type=Path, required=True, help="the requests, one JSON per line"
    )
    parser.add_argument(
        "-o", "--output-file", type=Path, required=True, help="the answers, one JSON per line"
    )
    add_engine_options(parser)
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the model names the lines' `model` may give (default: the model file's name, "
        "and its path as given)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=list(FORMATS),
        help="the format tool calls are offered and read in (default: from the chat template)",
    )
    parser.add_argument(
        "--embedding-pooling",
        choices=POOLING_CHOICES,
        default="last",
        help="how /v1/embeddings lines pool the last hidden states (default: last token)",
    )
    parser.add_argument(
        "--prefix-cache-entries",
        type=int,
        default=64,
        help="finished prompts kept for reuse, as serve's: lines sharing a prefix (a chat "
        "template's system prompt) start from a finished line's cells",
    )
    parser.add_argument("--report-json", type=Path, help="write the whole report here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_batch_command)


def run_batch_command(args: argparse.Namespace) -> int:
    from cellbatch.engine.limits import DEFAULT_MAX_SESSIONS  # the engine (torch) loads here

    text = _check(args)
    lines = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:
        raise UsageError(f"{args.input_file} holds no requests")
    # The engine's default sessions, as serve's: with fewer sessions than lines, a line
    # starts from a finished one's prefix (the prefix cache), where every line at once
    # would feed every prompt whole.
    max_sessions = args.max_sessions or min(len(lines), DEFAULT_MAX_SESSIONS)
    memory = {"before_load": memory_snapshot()}
    started = time.perf_counter()
    engine = load_engine(
        args, engine_shape(args, max_sessions), prefix_cache_entries=args.prefix_cache_entries
    )
    load_seconds = time.perf_counter() - started
    memory["after_load"] = memory_snapshot()
    with engine:
        runner = _line_runner(engine, args)
        if not args.quiet:
            note(f"{len(lines)} requests started (Ctrl-C stops them and keeps what is done)")
        started = time.perf_counter()
        with ProgressBar(args.quiet, len(lines)) as progress:
            outcomes, interrupted = asyncio.run(_answer_all(runner, lines, progress))
        seconds = time.perf_counter() - started
        memory["after_run"] = memory_snapshot()
        args.output_file.write_text("".join(outcome.line() + "\n" for outcome in outcomes))
        report = _report(args, engine, outcomes, memory, load_seconds, seconds)
        _print_report(report, engine.metrics().report())
    if args.report_json is not None:
        args.report_json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        note(f"report written to {args.report_json}")
    note(f"answers written to {args.output_file}")
    if interrupted:
        note(f"interrupted by {signal.Signals(interrupted).name}: unfinished lines were cancelled")
        return 128 + interrupted
    return 0 if all(outcome.ok for outcome in outcomes) else 1


def _check(args: argparse.Namespace) -> str:
    """The input file's text; every problem that does not need the model, refused."""
    try:
        text: str = args.input_file.read_bytes().decode("utf-8")
    except OSError as error:
        raise UsageError(f"cannot read {args.input_file}: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise UsageError(f"{args.input_file} is not UTF-8 text (JSONL): {error}") from error
    for path in (args.output_file, args.report_json):
        if path is None:
            continue
        folder = path.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise UsageError(f"cannot write {path}: {folder} is not a writable folder")
    if args.model is not None and not Path(args.model).exists():
        raise UsageError(f"model {args.model} does not exist (give a folder or a .gguf file)")
    if args.prefix_cache_entries < 0:
        raise UsageError(f"--prefix-cache-entries must be >= 0, got {args.prefix_cache_entries}")
    return text


def _line_runner(engine: Engine, args: argparse.Namespace) -> LineRunner:
    """The server's line runner over this engine."""
    from cellbatch.server.backend import LocalBackend
    from cellbatch.server.batch_lines import LineRunner
    from cellbatch.server.embeddings_api import Embedder
    from cellbatch.server.planner import RequestPlanner
    from cellbatch.server.responses import Responses

    model = engine.model_path or args.model or "model"
    name, *aliases = args.served_model_name or [Path(str(model)).name, str(model)]
    names = (name, *dict.fromkeys(alias for alias in aliases if alias != name))
    backend = LocalBackend(engine)
    planner = RequestPlanner(backend, args.tool_call_parser)
    embedder = Embedder(backend, planner, name, names, args.embedding_pooling)
    return LineRunner(backend, planner, Responses(backend, name), embedder, names)


async def _answer_all(
    runner: LineRunner, lines: list[tuple[int, str]], progress: ProgressBar | None
) -> tuple[list[LineOutcome], int]:
    """Every line's outcome, in input order, and the signal that interrupted the run
    (0: none)."""
    from cellbatch.server.batch_lines import LineOutcome, failed_line

    seen: set[str] = set()
    read = [runner.read(number, text, seen) for number, text in lines]
    outcomes: list[LineOutcome | None] = [r if isinstance(r, LineOutcome) else None for r in read]

    async def answer(index: int) -> None:
        request = read[index]
        assert not isinstance(request, LineOutcome)
        outcome = await runner.run(request, DEFAULT_PRIORITY)
        outcomes[index] = outcome
        if progress is not None:
            progress(outcome.usage.output_tokens)
            progress.item_done()

    tasks = [
        asyncio.create_task(answer(index)) for index, outcome in enumerate(outcomes) if not outcome
    ]
    received: list[int] = []
    loop = asyncio.get_running_loop()

    def stop(signum: int) -> None:
        if received and signum == signal.SIGINT:
            os._exit(128 + signal.SIGINT)  # the user insists: no output, no cleanup
        received.append(signum)
        for task in tasks:
            task.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop, signum)
    try:
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    finished = []
    for (number, _), outcome, request in zip(lines, outcomes, read, strict=True):
        if outcome is None:
            custom_id = None if isinstance(request, LineOutcome) else request.custom_id
            outcome = failed_line(custom_id, "cancelled", f"line {number} was cancelled")
        finished.append(outcome)
    return finished, received[0] if received else 0


def _report(
    args: argparse.Namespace,
    engine: Engine,
    outcomes: list[LineOutcome],
    memory: dict[str, dict[str, int]],
    load_seconds: float,
    seconds: float,
) -> dict[str, Any]:
    prompt = sum(outcome.usage.input_tokens for outcome in outcomes)
    generated = sum(outcome.usage.output_tokens for outcome in outcomes)
    failures = [
        (outcome.custom_id, outcome.status, outcome.error.message if outcome.error
         else outcome.body)
        for outcome in outcomes
        if not outcome.ok
    ]  # fmt: skip
    return {
        "input_file": str(args.input_file),
        "output_file": str(args.output_file),
        "lines": len(outcomes),
        "completed": len(outcomes) - len(failures),
        "failed": len(failures),
        "failures": [
            {"custom_id": custom_id, "status": status, "error": error}
            for custom_id, status, error in failures
        ],
        "memory": memory,
        "kv": asdict(engine.kv_usage()),
        "config": {
            "model": str(engine.model_path),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "weight_format": engine.weights.format,
            "kernels": engine.kernels,
            **asdict(engine.shape),
        },
        "timing": {
            "load_seconds": load_seconds,
            "run_seconds": seconds,
            "prompt_tokens": prompt,
            "generated_tokens": generated,
            "tokens_per_second": generated / seconds if seconds > 0 else 0.0,
        },
        "engine": engine.metrics().as_dict(),
    }


def _print_report(report: dict[str, Any], engine_text: str) -> None:
    print(
        f"=== {report['lines']} requests: {report['completed']} answered, "
        f"{report['failed']} failed ==="
    )
    for failure in report["failures"][:10]:
        print(f"!!! {failure['custom_id']}: {failure['status'] or 'no answer'} {failure['error']}")
    if report["failed"] > 10:
        print(f"... and {report['failed'] - 10} more (the output file has them all)")
    print("=== engine ===")
    print(engine_text)
    kv = report["kv"]
    print("=== KV pool ===")
    print(f"cells in use {kv['cells_in_use']} of {kv['max_cells']}, pool rows {kv['pool_rows']}")
    print("=== memory ===")
    for stage, snapshot in report["memory"].items():
        print(f"{stage.replace('_', ' '):>15}: RSS {snapshot['rss_bytes'] / 2**20:.1f} MiB")
    timing = report["timing"]
    print("=== throughput ===")
    print(
        f"{timing['generated_tokens']} tokens in {timing['run_seconds']:.2f} s: "
        f"{timing['tokens_per_second']:.1f} tokens/s (load {timing['load_seconds']:.2f} s)",
        file=sys.stdout,
    )
