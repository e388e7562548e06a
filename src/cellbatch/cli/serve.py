"""`cellbatch serve`: options to a running server.

Owns: checking the serve options (the batch features' among them: `add_batch_options`),
loading the engine (or, with `--replicas N`, starting N engine replicas on Ray) and
running the app until a signal stops it.
Promises: option errors and a missing `serve` (or `ray`) extra are refused before the
model loads (exit 2, one line saying what to do), and so is a replica that cannot
start; the process exits 0 after SIGINT or SIGTERM once running requests finished or
were cancelled, with the replicas and a Ray instance it started stopped.
Never: serves requests itself (the app does).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from cellbatch.cli.options import (
    UsageError,
    check_engine_options,
    engine_shape,
    load_engine,
    model_options,
)
from cellbatch.generation_config import POOLING_CHOICES

if TYPE_CHECKING:
    from cellbatch.distributed.backend import ReplicaBackend
    from cellbatch.engine import Engine
    from cellbatch.server.batch_features import BatchSettings


def serve_command(args: argparse.Namespace) -> NoReturn:
    missing = [
        name for name in ("fastapi", "uvicorn", "prometheus_client")
        if importlib.util.find_spec(name) is None
    ]  # fmt: skip
    if missing:
        raise UsageError(
            f"cellbatch serve needs {', '.join(missing)}: pip install 'cellbatch[serve]'"
        )
    _check_options(args)
    api_key = args.api_key or os.environ.get("CELLBATCH_API_KEY") or None

    from cellbatch.server.app import ServerSettings, serve

    backend: Engine | ReplicaBackend
    model: Path | str | None
    if args.replicas is None:
        engine = load_engine(
            args,
            engine_shape(args, args.max_sessions),
            prefix_cache_entries=args.prefix_cache_entries,
        )
        backend = engine
        model, shape, where = engine.model_path, engine.shape, ""
    else:
        replicas = _start_replicas(args)
        backend = replicas
        info = replicas.replicas.info
        model, shape = info.model, info.shape
        where = f"{args.replicas} replicas × {info.threads} threads on Ray, "
    name, *aliases = args.served_model_name or [Path(str(model)).name, str(model)]
    settings = ServerSettings(
        served_model_name=name,
        model_aliases=tuple(alias for alias in dict.fromkeys(aliases) if alias != name),
        api_key=api_key,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        data_dir=args.data_dir,
        batches=_batch_settings(args),
    )
    if not args.quiet:
        print(
            f"cellbatch: serving {name} on http://{args.host}:{args.port}/v1 "
            f"({where}{shape.max_sessions} sessions, {shape.max_session_tokens}-token "
            f"context{', API key required' if api_key else ''}); Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
    try:
        serve(backend, settings, args.host, args.port)
    finally:
        backend.close()  # already closed unless the server could not start
    # Everything of ours is closed by now; the interpreter's own teardown of torch and
    # friends can take seconds on a busy machine, past the promised shutdown time.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _check_options(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    for flag, value in (
        ("--max-queued-requests", args.max_queued_requests),
        ("--max-request-bytes", args.max_request_bytes),
    ):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.prefix_cache_entries < 0:
        raise UsageError(f"--prefix-cache-entries must be >= 0, got {args.prefix_cache_entries}")
    if args.data_dir is not None:
        try:
            args.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"--data-dir {args.data_dir} cannot be a folder: {error}") from None
        if not os.access(args.data_dir, os.W_OK):
            raise UsageError(f"--data-dir {args.data_dir} is not writable")
    if args.shutdown_timeout < 0:
        raise UsageError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    for flag, value in (
        ("--max-file-bytes", args.max_file_bytes),
        ("--max-batch-lines", args.max_batch_lines),
        ("--batch-concurrency", args.batch_concurrency),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.model is not None and not Path(args.model).exists() and args.ray_address is None:
        raise UsageError(f"model {args.model} does not exist (give a folder or a .gguf file)")
    if args.replicas is None:
        for flag, value in (
            ("--threads-per-replica", args.threads_per_replica),
            ("--ray-address", args.ray_address),
        ):
            if value is not None:
                raise UsageError(f"{flag} needs --replicas N")
        return
    if args.replicas < 1:
        raise UsageError(f"--replicas must be >= 1, got {args.replicas}")
    if args.threads is not None:
        raise UsageError(
            "--threads sets one engine's threads; with --replicas use --threads-per-replica"
        )
    if args.numa != "auto":
        raise UsageError("--numa places one engine's threads; Ray places the replicas")
    if args.threads_per_replica is not None and args.threads_per_replica < 1:
        raise UsageError(f"--threads-per-replica must be >= 1, got {args.threads_per_replica}")
    if importlib.util.find_spec("ray") is None:
        raise UsageError("--replicas runs the engines on Ray: pip install 'cellbatch[ray]'")


def add_batch_options(parser: argparse.ArgumentParser) -> None:
    """The Files, Batch and Embeddings APIs' options of `serve`."""
    parser.add_argument(
        "--max-file-bytes",
        type=int,
        default=200 * 1024 * 1024,
        help="the largest file POST /v1/files takes (default 200 MiB)",
    )
    parser.add_argument(
        "--max-batch-lines",
        type=int,
        default=50_000,
        help="the most requests one batch's input file may hold (default 50000)",
    )
    parser.add_argument(
        "--batch-concurrency",
        type=int,
        help="sessions batch requests hold at once (default: half of --max-sessions, the "
        "rest kept for interactive requests)",
    )
    parser.add_argument(
        "--embedding-pooling",
        choices=POOLING_CHOICES,
        default="last",
        help="how /v1/embeddings pools the last hidden states: the last token's, or the "
        "mean over the input's tokens (a request's `pooling` may ask for the other)",
    )


def _batch_settings(args: argparse.Namespace) -> BatchSettings:
    from cellbatch.server.batch_features import BatchSettings

    return BatchSettings(
        max_file_bytes=args.max_file_bytes,
        max_batch_lines=args.max_batch_lines,
        concurrency=args.batch_concurrency,
        embedding_pooling=args.embedding_pooling,
    )


def _start_replicas(args: argparse.Namespace) -> ReplicaBackend:
    """The replicas the options ask for, behind the server's backend for them."""
    from cellbatch.distributed.backend import ReplicaBackend
    from cellbatch.distributed.cluster import RayUnavailable
    from cellbatch.distributed.replicas import ReplicaSet

    check_engine_options(args)  # before Ray and the replicas start
    threads = args.threads_per_replica
    if threads is None:
        # A local instance shares this machine's cores; on a cluster, say how many.
        threads = 1 if args.ray_address else max(1, (os.cpu_count() or 1) // args.replicas)
    where = args.ray_address or "a local Ray instance"
    if not args.quiet:
        print(
            f"cellbatch: starting {args.replicas} replicas × {threads} threads of "
            f"{args.model or 'the default model'} on {where}",
            file=sys.stderr,
            flush=True,
        )
    try:
        replicas = ReplicaSet.start(
            args.model,
            replicas=args.replicas,
            threads_per_replica=threads,
            ray_address=args.ray_address,
            **model_options(args),
            prefix_cache_entries=args.prefix_cache_entries,
            **engine_shape(args, args.max_sessions),
        )
    except (RayUnavailable, RuntimeError, ValueError) as error:
        raise UsageError(str(error)) from error
    return ReplicaBackend(replicas)
