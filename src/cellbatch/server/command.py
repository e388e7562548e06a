"""`cellbatch serve`: options to a running server.

Owns: checking the serve options, loading the engine and running the app until a
signal stops it.
Promises: option errors and a missing `serve` extra are refused before the model
loads (exit 2, one line saying what to do); the process exits 0 after SIGINT or
SIGTERM once running requests finished or were cancelled.
Never: serves requests itself (the app does).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import NoReturn

from cellbatch.cli import UsageError, engine_shape, load_engine


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

    engine = load_engine(
        args,
        engine_shape(args, args.max_sessions),
        prefix_cache_entries=args.prefix_cache_entries,
    )
    name = args.served_model_name or Path(str(engine.model_path)).name
    settings = ServerSettings(
        served_model_name=name,
        api_key=api_key,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
    )
    if not args.quiet:
        print(
            f"cellbatch: serving {name} on http://{args.host}:{args.port}/v1 "
            f"({engine.shape.max_sessions} sessions, {engine.shape.max_session_tokens}-token "
            f"context{', API key required' if api_key else ''}); Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
    serve(engine, settings, args.host, args.port)
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
    if args.shutdown_timeout < 0:
        raise UsageError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.model is not None and not Path(args.model).exists():
        raise UsageError(f"model {args.model} does not exist (give a folder or a .gguf file)")
