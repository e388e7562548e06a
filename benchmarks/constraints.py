"""Structured generation: what a constraint costs, with the libraries and in the engine.

1. The grammar libraries on their own, on the same schemas (nested objects, arrays with
   bounds, enums, anyOf, string patterns; strict, as OpenAI's structured outputs are):
   compile time per schema, and the time of one token mask (p50, p99) along a walk that
   takes a seeded random allowed token each step.
   llguidance always; xgrammar when `--xgrammar DIR` names a folder it was installed to
   (`pip install --target DIR --no-deps xgrammar apache-tvm-ffi`: its own dependencies,
   triton among them, are not needed for this).
2. The engine on the default model: the throughput benchmark's 32 chat prompts, each
   asked for JSON, at once, with a schema each (cycling through the schemas) and without
   one; generated tokens/s of each, the time to first token of one prompt alone with and
   without its schema (median of `--ttft-runs`), and the share of constrained answers
   that parse and fit their schema.

Usage: .venv/bin/python benchmarks/constraints.py [--xgrammar DIR] [--threads 2]
       [--max-new-tokens 256] [--output-json benchmarks/results/constraints.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cellbatch.bench.workload import CHAT_PROMPTS

STRING = {"type": "string", "maxLength": 24}


def strict(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object, as OpenAI's strict
    structured outputs require (and its client's `parse()` writes): without it a schema
    allows any further keys, and a model may add them until its token budget runs out."""
    if isinstance(schema, dict):
        out = {key: strict(value) for key, value in schema.items()}
        if out.get("type") == "object":
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


_SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"answer": STRING}, "required": ["answer"]},
    {
        "type": "object",
        "properties": {"name": STRING, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["sentiment"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": STRING, "minItems": 1, "maxItems": 4}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "title": STRING,
            "author": {
                "type": "object",
                "properties": {"first": STRING, "last": STRING},
                "required": ["first", "last"],
            },
            "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
        },
        "required": ["title", "author", "year"],
    },
    {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 12}]}
        },
        "required": ["value"],
    },
    {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"],
    },
    {
        "type": "object",
        "properties": {
            "steps": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"n": {"type": "integer"}, "text": STRING},
                    "required": ["n", "text"],
                },
                "maxItems": 3,
            }
        },
        "required": ["steps"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "reason": STRING},
        "required": ["ok"],
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {
            "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["email", "role"],
    },
    {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
    },
]
SCHEMAS = [strict(schema) for schema in _SCHEMAS]


def library_figures(xgrammar_dir: Path | None, steps: int) -> dict[str, Any]:
    from cellbatch.model.default import default_model_path
    from cellbatch.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    vocab = 49152
    figures = {"llguidance": _llguidance(tokenizer, vocab, steps)}
    if xgrammar_dir is not None:
        sys.path.insert(0, str(xgrammar_dir))
        figures["xgrammar"] = _xgrammar(tokenizer, vocab, steps)
    return figures


def _walk(
    fill: Callable[[], torch.Tensor], consume: Callable[[int], None], done: Callable[[], bool],
    steps: int, seed: int, vocab: int,
) -> list[float]:  # fmt: skip
    """Mask times (s) along a walk taking a seeded random allowed token each step (`fill`
    returns the bitmask; unpacking it to choose is not timed)."""
    rng = random.Random(seed)
    times = []
    for _ in range(steps):
        if done():
            break
        start = time.perf_counter()
        bitmask = fill()
        times.append(time.perf_counter() - start)
        choices = _bits(bitmask, vocab).nonzero().flatten().tolist()
        if not choices:
            break
        consume(rng.choice(choices))
    return times


def _bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    words = bitmask[0].to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(32, dtype=torch.int64)
    return ((words[:, None] >> shifts) & 1).flatten()[:vocab]


def _llguidance(tokenizer: Any, vocab: int, steps: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer.backend, n_vocab=vocab, eos_token=2)
    compile_times, mask_times = [], []
    for index, schema in enumerate(SCHEMAS):
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            {**schema, "x-guidance": {"whitespace_flexible": False}}
        )
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_times.append(time.perf_counter() - start)
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

        def fill(m: Any = matcher, b: torch.Tensor = bitmask) -> torch.Tensor:
            llguidance.torch.fill_next_token_bitmask(m, b, 0)
            return b

        mask_times += _walk(fill, matcher.consume_token, matcher.is_stopped, steps, index, vocab)
    return _summary(compile_times, mask_times)


def _xgrammar(tokenizer: Any, vocab: int, steps: int) -> dict[str, Any]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer.backend, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    compile_times, mask_times = [], []
    for index, schema in enumerate(SCHEMAS):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        matcher = xgrammar.GrammarMatcher(compiled)
        compile_times.append(time.perf_counter() - start)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)

        def fill(m: Any = matcher, b: torch.Tensor = bitmask) -> torch.Tensor:
            m.fill_next_token_bitmask(b, 0)
            return b

        mask_times += _walk(fill, matcher.accept_token, matcher.is_terminated, steps, index, vocab)
    return _summary(compile_times, mask_times)


def _summary(compile_times: list[float], mask_times: list[float]) -> dict[str, Any]:
    ordered = sorted(mask_times)
    return {
        "schemas": len(compile_times),
        "compile_ms_median": 1e3 * statistics.median(compile_times),
        "compile_ms_max": 1e3 * max(compile_times),
        "masks": len(ordered),
        "mask_us_p50": 1e6 * ordered[len(ordered) // 2],
        "mask_us_p99": 1e6 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def engine_figures(threads: int, max_new_tokens: int, ttft_runs: int) -> dict[str, Any]:
    import jsonschema

    from cellbatch import Engine, GenConfig
    from cellbatch.generation_config import Constraint, SamplingParams

    with Engine.from_pretrained(threads=threads, max_sessions=32) as engine:
        prompts = [
            engine.chat_tokens(f"{text} Answer in JSON.") for text in CHAT_PROMPTS
        ]  # fmt: skip
        schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(len(prompts))]
        engine.generate(prompts[:4], GenConfig(max_new_tokens=8))  # warm-up

        def run(budgets: list[int] | None) -> tuple[float, list[Any]]:
            """All prompts at once: with a schema each (budgets None), or free, each held
            to its constrained twin's token count (no stop token), so both runs decode
            the same tokens at the same batch sizes and differ only by the masks."""
            handles, sessions = [], []
            start = time.perf_counter()
            for index, (tokens, schema) in enumerate(zip(prompts, schemas, strict=True)):
                if budgets is None:
                    config = GenConfig(
                        max_new_tokens=max_new_tokens,
                        sampling=SamplingParams(constraint=Constraint.json_schema(schema)),
                    )
                else:
                    config = GenConfig(max_new_tokens=budgets[index], stop_tokens=frozenset())
                session = engine.open_session()
                sessions.append(session)
                handles.append(session.generate_async(tokens, config))
            for handle in handles:
                handle.wait()
            elapsed = time.perf_counter() - start
            for session in sessions:
                session.close()
            results = [handle.result() for handle in handles]
            return sum(len(r.tokens) for r in results) / elapsed, results

        fitted_rate, fitted = run(None)
        budgets = [max(1, len(result.tokens)) for result in fitted]
        free_rate, _ = run(budgets)
        fitted_rate_again, _ = run(None)
        free_rate_again, _ = run(budgets)
        valid = 0
        for result, schema in zip(fitted, schemas, strict=True):
            try:
                jsonschema.validate(json.loads(result.text), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass

        def one_token(run_index: int, constrained: bool) -> float:
            """Wall time of a one-token answer; its schema is new each run, so compiling
            it counts, as it does for a server's first request with that schema."""
            schema = {**SCHEMAS[4], "description": f"run {run_index}"}
            sampling = SamplingParams(
                constraint=Constraint.json_schema(schema) if constrained else None
            )
            start = time.perf_counter()
            engine.generate([prompts[1]], GenConfig(max_new_tokens=1, sampling=sampling))
            return time.perf_counter() - start

        # Interleaved, so that a slower moment of the machine hits both alike.
        pairs = [(one_token(i, False), one_token(i, True)) for i in range(ttft_runs)]
        ttft_free = statistics.median(free for free, _ in pairs)
        ttft_fitted = statistics.median(fitted for _, fitted in pairs)

    free = (free_rate + free_rate_again) / 2
    return {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "free_tokens_per_s": [free_rate, free_rate_again],
        "constrained_tokens_per_s": [fitted_rate, fitted_rate_again],
        "throughput_ratio": (fitted_rate + fitted_rate_again) / 2 / free,
        "ttft_free_ms": 1e3 * ttft_free,
        "ttft_constrained_ms": 1e3 * ttft_fitted,
        "ttft_ratio": ttft_fitted / ttft_free,
        "schema_valid": f"{valid}/{len(fitted)}",
        "finish_reasons": sorted({r.finish_reason.value for r in fitted if r.finish_reason}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--xgrammar", type=Path, help="a pip --target folder holding xgrammar")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mask-steps", type=int, default=64, help="masks per schema walk")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--ttft-runs", type=int, default=9)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument(
        "--output-json", type=Path, default=Path("benchmarks/results/constraints.json")
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"libraries": library_figures(args.xgrammar, args.mask_steps)}
    for name, figures in report["libraries"].items():
        print(
            f"{name:11} compile median {figures['compile_ms_median']:.2f} ms "
            f"(max {figures['compile_ms_max']:.2f}) over {figures['schemas']} schemas; "
            f"mask p50 {figures['mask_us_p50']:.0f} us, p99 {figures['mask_us_p99']:.0f} us "
            f"over {figures['masks']} masks"
        )
    if not args.skip_engine:
        report["engine"] = figures = engine_figures(
            args.threads, args.max_new_tokens, args.ttft_runs
        )
        print(
            f"engine: {figures['prompts']} prompts at once, <= {figures['max_new_tokens']} "
            f"tokens, the same counts both ways: free {figures['free_tokens_per_s'][0]:.1f} / "
            f"{figures['free_tokens_per_s'][1]:.1f} tok/s, with a schema each "
            f"{figures['constrained_tokens_per_s'][0]:.1f} / "
            f"{figures['constrained_tokens_per_s'][1]:.1f} tok/s "
            f"({figures['throughput_ratio']:.2f}x); TTFT {figures['ttft_free_ms']:.1f} ms free, "
            f"{figures['ttft_constrained_ms']:.1f} ms with a schema "
            f"({figures['ttft_ratio']:.2f}x); schema-valid {figures['schema_valid']} "
            f"(finish: {', '.join(figures['finish_reasons'])})"
        )
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
