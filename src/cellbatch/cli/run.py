"""`cellbatch run`: a list of prompts through one model, then the report.

Owns: the run's own option checks, encoding the prompt lines, the progress bar, the wait
that a signal interrupts, and the exit status.
Promises: a missing or unreadable prompt file, and an option that is wrong whatever the
model, are errors before the model loads (exit status 2); a bad prompt line fails alone
with its line number and the others still run; the first SIGINT or SIGTERM during
generation cancels what still runs and reports what was done (exit 128 + signal); the
exit status is 0 only when every generation ended by a stop token, a stop string or the
token limit.
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
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from cellbatch.cli.options import (
    UsageError,
    engine_shape,
    exit_on_signal,
    load_engine,
    lora_adapters,
    note,
    usage_error,
)
from cellbatch.cli.prompts import PromptLine, read_prompts
from cellbatch.cli.report import RunRecord, build_report, memory_snapshot, print_report
from cellbatch.generation_config import Constraint, GenConfig, SamplingParams
from cellbatch.types import Token

if TYPE_CHECKING:
    from cellbatch.engine import Engine, GenerationBatch, GenerationResult

# More sessions than this are rarely faster on a CPU and cost KV memory up front.
SESSION_CAP = 256


def _check_run_options(args: argparse.Namespace) -> None:
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


def _constraint(args: argparse.Namespace) -> Constraint | None:
    """The constraint the options ask for; an unreadable file is a UsageError."""
    try:
        if args.json_schema is not None:
            return Constraint.json_schema(args.json_schema.read_text())
        if args.grammar is not None:
            return Constraint.grammar(args.grammar.read_text())
        if args.json_object:
            return Constraint.json_object()
        if args.regex is not None:
            return Constraint.regex(args.regex)
        if args.choice:
            return Constraint.choice(args.choice)
    except OSError as error:
        raise UsageError(f"cannot read {error.filename}: {error.strerror}") from error
    except ValueError as error:  # InvalidArgumentError: an empty regex, say
        raise UsageError(str(error)) from error
    return None


def run_command(args: argparse.Namespace) -> int:
    _check_run_options(args)
    constraint = _constraint(args)
    adapters = lora_adapters(args)
    if args.adapter is not None and args.adapter not in adapters:
        raise UsageError(
            f"--adapter {args.adapter}: no such adapter; name one of --lora-modules "
            f"({', '.join(adapters) or 'none given'})"
        )
    prompts = read_prompts(args, adapters)
    if not prompts:
        raise UsageError("every prompt line is empty: nothing to run")
    if args.model is not None and not Path(args.model).exists():
        raise UsageError(f"model {args.model} does not exist (give a folder or a .gguf file)")
    max_sessions = args.max_sessions
    if max_sessions is None:
        max_sessions = min(len(prompts), SESSION_CAP)
        if len(prompts) > SESSION_CAP:
            note(
                f"{len(prompts)} prompts, {SESSION_CAP} sessions at once (--max-sessions to change)"
            )

    with usage_error():
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    shape = engine_shape(args, max_sessions)

    with exit_on_signal("loading the model"):
        # The libraries are the baseline, not part of the model's load.
        importlib.import_module("cellbatch.engine")
        memory = {"before_load": memory_snapshot()}
        load_started = time.perf_counter()
        engine = load_engine(args, shape)
        load_seconds = time.perf_counter() - load_started
        memory["after_load"] = memory_snapshot()

    with engine:
        if constraint is not None:
            with usage_error():
                engine.check_constraint(constraint)  # one message, not one per prompt
        inputs, failures = _encode(prompts, engine)
        config = GenConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed)
        if not args.quiet:
            note(f"{len(inputs)} prompts started (Ctrl-C stops them and keeps what is done)")
        started = time.perf_counter()
        with ProgressBar(args.quiet) as progress:
            # One call per adapter, so that each call's shared prefix runs under its own.
            groups: dict[str | None, list[int]] = {}
            for position, (index, _) in enumerate(inputs):
                groups.setdefault(prompts[index].adapter, []).append(position)
            batches = [
                (
                    positions,
                    engine.generate_async(
                        [inputs[position][1] for position in positions],
                        replace(config, adapter=adapter),
                        stop=args.stop,
                        constraint=constraint,
                        on_tokens=progress,
                    ),
                )
                for adapter, positions in groups.items()
            ]
            interrupted = _wait_interruptibly([batch for _, batch in batches])
            by_position: dict[int, GenerationResult] = {}
            for positions, batch in batches:
                by_position.update(zip(positions, batch.results(), strict=True))
            results = [by_position[position] for position in range(len(inputs))]
        generate_seconds = time.perf_counter() - started
        memory["after_generate"] = memory_snapshot()
        metrics = engine.metrics()
        record = RunRecord(
            prompts,
            inputs,
            failures,
            results,
            config,
            list(args.stop),
            memory,
            generate_seconds,
            load_seconds,
        )
        report = build_report(record, engine, metrics)

    print_report(report, metrics.report())
    if args.report_json is not None:
        args.report_json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        note(f"report written to {args.report_json}")
    if interrupted:
        note(
            f"interrupted by {signal.Signals(interrupted).name}: unfinished generations were "
            "cancelled; the report above holds everything generated until then"
        )
        return 128 + interrupted
    ok = all(entry["finish_reason"] in _GOOD_ENDINGS for entry in report["generations"])
    return 0 if ok else 1


def _wait_interruptibly(batches: list[GenerationBatch]) -> int:
    """Wait for the batches; the first SIGINT or SIGTERM cancels what still runs (the
    results so far are kept and reported), a second SIGINT exits at once. Returns the
    signal number that interrupted the wait, or 0."""
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        if received and signum == signal.SIGINT:
            os._exit(128 + signal.SIGINT)  # the user insists: no report, no cleanup
        received.append(signum)
        for batch in batches:
            batch.cancel()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # Short waits, so that the main thread runs the handler as soon as a signal comes.
        for batch in batches:
            while not batch.wait(0.1):
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return received[0] if received else 0


_GOOD_ENDINGS = ("stop_token", "stop_string", "token_limit")


def _encode(
    prompts: list[PromptLine], engine: Engine
) -> tuple[list[tuple[int, list[Token]]], dict[int, str]]:
    """(index, tokens) for every prompt that could be encoded; the others' problems."""
    inputs: list[tuple[int, list[Token]]] = []
    failures: dict[int, str] = {}
    for index, prompt in enumerate(prompts):
        if prompt.problem:
            failures[index] = f"{prompt.source}: {prompt.problem}"
        elif prompt.tokens is not None:
            inputs.append((index, prompt.tokens))
        elif prompt.text is None:
            raise AssertionError(f"{prompt.source}: a prompt line holds text or tokens")
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


class ProgressBar:
    """A tqdm bar of generated tokens on stderr, when stderr is a terminal."""

    def __init__(self, quiet: bool, total_items: int | None = None) -> None:
        self._bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(unit="tok", desc="generating", file=sys.stderr, smoothing=0.1)
        self._total_items = total_items
        self._items = 0

    def item_done(self) -> None:
        """One of `total_items` (a batch's lines, say) finished: shown beside the tokens."""
        self._items += 1
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self._items}/{self._total_items} done", refresh=False)

    def __enter__(self) -> ProgressBar | None:
        return self if self._bar is not None else None

    def __call__(self, tokens: int) -> None:
        if self._bar is not None:
            self._bar.update(tokens)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
