"""Tool calls on the default model: what holding calls to a grammar costs, and whether
the calls fit.

The throughput benchmark's 32 chat prompts, each offered the same two tools the way
`cellbatch serve` offers them to a template with no place for tools (a system message
in the Hermes format), all at once, three ways:
- free: the tools offered, nothing held (each held to the token count of its `auto`
  twin, no stop token, so both decode the same tokens at the same batch sizes);
- auto: `tool_choice: "auto"`'s grammar (text, or calls that fit their tools);
- required: `tool_choice: "required"`'s grammar, with the share of answers whose whole
  calls all fit their tool's schema (at least one; a call cut short by the limit is not
  whole).
Generated tokens/s of each (two runs each, interleaved), the ratios, and the time to
first token of one prompt alone with and without the auto grammar (median of
`--ttft-runs`, the grammar new each run so compiling it counts).

Usage: .venv/bin/python benchmarks/tool_calls.py [--threads 2] [--max-new-tokens 64]
       [--output-json benchmarks/results/tool_calls.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cellbatch.bench.workload import CHAT_PROMPTS
from cellbatch.tool_calls.calls import Tool
from cellbatch.tool_calls.formats import HermesFormat
from cellbatch.tool_calls.prompt import conversation
from cellbatch.tool_calls.stream import split_answer

TOOLS = [
    Tool(
        "get_weather",
        "The current weather in a city",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    ),
    Tool(
        "search",
        "Search the web",
        {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 48}},
            "required": ["query"],
            "additionalProperties": False,
        },
    ),
]
SCHEMAS = {tool.name: dict(tool.parameters) for tool in TOOLS}


def figures(threads: int, max_new_tokens: int, ttft_runs: int) -> dict[str, Any]:
    import jsonschema

    from cellbatch import Engine, GenConfig
    from cellbatch.generation_config import Constraint, SamplingParams

    form = HermesFormat()
    with Engine.from_pretrained(threads=threads, max_sessions=32) as engine:
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        prompts = []
        for text in CHAT_PROMPTS:
            turns, template_tools = conversation(
                [{"role": "user", "content": text}], TOOLS, form, tokenizer.takes_tools
            )
            prompts.append(tokenizer.apply_chat_template(turns, tools=template_tools))
        auto = Constraint.grammar(form.grammar(TOOLS, True, {}, free_text=True))
        required = Constraint.grammar(form.grammar(TOOLS, True, {}))
        engine.generate(prompts[:4], GenConfig(max_new_tokens=8))  # warm-up

        def run(
            constraint: Constraint | None, budgets: list[int] | None
        ) -> tuple[float, list[Any]]:
            configs = [
                GenConfig(
                    max_new_tokens=max_new_tokens if budgets is None else budgets[index],
                    sampling=SamplingParams(constraint=constraint),
                    stop_tokens=None if budgets is None else frozenset(),
                )
                for index in range(len(prompts))
            ]
            handles = []
            start = time.perf_counter()
            for tokens, config in zip(prompts, configs, strict=True):
                handles.extend(engine.generate_async([tokens], config).handles())
            for handle in handles:
                handle.wait()
            elapsed = time.perf_counter() - start
            results = [handle.result() for handle in handles]
            return sum(len(r.tokens) for r in results) / elapsed, results

        auto_rate, auto_results = run(auto, None)
        budgets = [max(1, len(result.tokens)) for result in auto_results]
        free_rate, _ = run(None, budgets)
        required_rate, required_results = run(required, None)
        auto_again, _ = run(auto, None)
        free_again, _ = run(None, budgets)
        required_again, _ = run(required, None)

        def fits(text: str) -> bool:
            """Whether the answer holds calls and each whole one fits its tool (a call
            cut short by the token limit is not whole)."""
            _, calls = split_answer(form, text, parallel=True)
            whole = 0
            for call in calls:
                try:
                    arguments = json.loads(call.arguments)
                except ValueError:
                    continue
                try:
                    jsonschema.validate(arguments, SCHEMAS[call.name])
                except jsonschema.ValidationError:
                    return False
                whole += 1
            return whole > 0

        valid = sum(fits(result.text) for result in required_results)
        auto_calls = sum(bool(split_answer(form, r.text, True)[1]) for r in auto_results)

        def one_token(run_index: int, constrained: bool) -> float:
            tools = [
                Tool(f"{tool.name}_{run_index}", tool.description, tool.parameters)
                for tool in TOOLS
            ]
            constraint = (
                Constraint.grammar(form.grammar(tools, True, {}, free_text=True))
                if constrained
                else None
            )
            config = GenConfig(max_new_tokens=1, sampling=SamplingParams(constraint=constraint))
            start = time.perf_counter()
            engine.generate([prompts[1]], config)
            return time.perf_counter() - start

        pairs = [(one_token(i, False), one_token(i, True)) for i in range(ttft_runs)]

    free = (free_rate + free_again) / 2
    ttft_free = statistics.median(free_time for free_time, _ in pairs)
    ttft_auto = statistics.median(auto_time for _, auto_time in pairs)
    return {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "free_tokens_per_s": [free_rate, free_again],
        "auto_tokens_per_s": [auto_rate, auto_again],
        "required_tokens_per_s": [required_rate, required_again],
        "auto_ratio": (auto_rate + auto_again) / 2 / free,
        "required_ratio": (required_rate + required_again) / 2 / free,
        "auto_answers_with_calls": f"{auto_calls}/{len(auto_results)}",
        "required_calls_valid": f"{valid}/{len(required_results)}",
        "required_finish": {
            reason: sum(1 for r in required_results if r.finish_reason.value == reason)
            for reason in sorted({r.finish_reason.value for r in required_results})
        },
        "ttft_free_ms": 1e3 * ttft_free,
        "ttft_auto_ms": 1e3 * ttft_auto,
        "ttft_ratio": ttft_auto / ttft_free,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ttft-runs", type=int, default=9)
    parser.add_argument(
        "--output-json", type=Path, default=Path("benchmarks/results/tool_calls.json")
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = figures(args.threads, args.max_new_tokens, args.ttft_runs)
    print(
        f"{report['prompts']} prompts with 2 tools at once, <= {report['max_new_tokens']} "
        f"tokens: free {report['free_tokens_per_s'][0]:.1f} / "
        f"{report['free_tokens_per_s'][1]:.1f} tok/s; auto {report['auto_tokens_per_s'][0]:.1f}"
        f" / {report['auto_tokens_per_s'][1]:.1f} ({report['auto_ratio']:.2f}x); required "
        f"{report['required_tokens_per_s'][0]:.1f} / {report['required_tokens_per_s'][1]:.1f} "
        f"({report['required_ratio']:.2f}x); required calls valid "
        f"{report['required_calls_valid']} (finish {report['required_finish']}); auto "
        f"answers with calls {report['auto_answers_with_calls']}; "
        f"TTFT {report['ttft_free_ms']:.1f} ms free, "
        f"{report['ttft_auto_ms']:.1f} ms auto ({report['ttft_ratio']:.2f}x)"
    )
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
