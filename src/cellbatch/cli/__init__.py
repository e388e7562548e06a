"""The `cellbatch` command line: `run` (a list of prompts through one model), `run-batch`
(an OpenAI batch file through one model, offline), `serve`, `export` (a model compiled
into a program file that `run --model` runs) and `bench` (throughput against
transformers: `cellbatch.bench`).

Modules, each with one job (imports only go down this list):
- `options`: the engine options every command shares, their checks, loading the engine;
- `prompts`: reading `run`'s prompt lines;
- `report`: memory probes, `run`'s JSON report and its printout;
- `run`, `run_batch`, `export`, `serve`: one command each;
- this module: the parser and `main`.

Promises: a bad option is an error before any work (exit status 2, one line).
Never: generates anything itself; the Engine does.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cellbatch.cli.export import export_command
from cellbatch.cli.options import UsageError, add_engine_options, add_weight_options
from cellbatch.cli.run import run_command
from cellbatch.cli.run_batch import add_run_batch_command
from cellbatch.cli.serve import add_batch_options, serve_command
from cellbatch.reasoning import REASONING_PARSERS
from cellbatch.tool_calls.formats import FORMATS

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from cellbatch.bench.throughput import main as bench

        return bench(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.func(args)
        return status
    except UsageError as error:
        print(f"cellbatch: error: {error}", file=sys.stderr)
        return 2


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
    shape = run.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", type=Path, help="every answer fits this JSON schema file")
    shape.add_argument("--json-object", action="store_true", help="every answer is a JSON object")
    shape.add_argument("--regex", help="every answer matches this regular expression")
    shape.add_argument(
        "--choice", action="append", help="every answer is one of these (repeat the option)"
    )
    shape.add_argument("--grammar", type=Path, help="every answer fits this Lark grammar file")
    add_engine_options(run)
    run.add_argument(
        "--adapter",
        metavar="NAME",
        help="run every prompt with this LoRA adapter (one of --lora-modules); a line "
        "starting with @NAME and a space runs with adapter NAME instead",
    )
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
    serve.add_argument(
        "--tool-call-parser",
        choices=list(FORMATS),
        help="the format tool calls are offered and read in (default: from the chat "
        "template; hermes for templates with no place for tools)",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=["auto", "none", *REASONING_PARSERS],
        default="auto",
        help="how an answer's <think> reasoning is told apart (reasoning_content in chat, "
        "reasoning items in Responses, thinking blocks in Messages); auto: on for chat "
        "templates that write </think>, off for the others",
    )
    serve.add_argument(
        "--data-dir",
        type=Path,
        help="folder of the server's SQLite database (kept Responses API responses, files "
        "and batches with their progress) and the uploaded files' bytes, made if missing; "
        "without it they are kept in memory until the server stops",
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
    add_batch_options(serve)
    serve.set_defaults(func=serve_command)

    add_run_batch_command(commands)

    export = commands.add_parser(
        "export", help="compile a model into a program file that `run --model` runs"
    )
    export.add_argument("--model", help="Hugging Face folder or GGUF file (default: SmolLM2-135M)")
    export.add_argument("-o", "--output", type=Path, required=True, help="the program (.pt2)")
    export.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    export.add_argument(
        "--kv-dtype", help="KV cache dtype, fixed in the program (as `run` takes it)"
    )
    add_weight_options(export)
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
    export.set_defaults(func=export_command)

    # Listed for --help only: main() hands `bench` and its arguments to the benchmark.
    commands.add_parser(
        "bench", help="throughput against transformers (cellbatch bench --help for its options)"
    )
    return parser
