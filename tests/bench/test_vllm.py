"""vLLM as a throughput peer: the answer its driver writes among vLLM's own log lines
is read, its own time is the run's, and a missing environment is a failing run that
says how to build it. A stand-in script plays the driver's Python here, and stand-in
vLLM modules the driver's `lora` imports."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, Literal

import pytest

from cellbatch.bench import vllm_driver
from cellbatch.bench.peers import time_peer
from cellbatch.bench.vllm_peer import ANSWER_MARK, vllm_peer

STAND_IN = f"""#!{sys.executable}
import json, sys
request = json.load(sys.stdin)
assert sys.argv[2] == "generate" and request["dtype"] == "float32"
print("INFO vLLM is starting")
outputs = [prompt[:1] * request["max_new_tokens"] for prompt in request["prompts"]]
print({ANSWER_MARK!r} + json.dumps({{"outputs": outputs, "seconds": 1.5, "version": "x"}}))
print("INFO shutting down")
"""


def test_the_driver_and_its_reader_agree_on_the_mark() -> None:
    assert vllm_driver.ANSWER_MARK == ANSWER_MARK


def test_the_peer_reads_the_answer_and_its_own_time(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    peer = vllm_peer(python, tmp_path, 2, "float32", 2, frozenset({2}))
    run = time_peer(peer, [[5, 6], [7]], 3)
    assert run.ok, run.error
    assert run.outputs == [[5, 5, 5], [7, 7, 7]] and run.seconds == 1.5


def test_a_missing_environment_says_how_to_build_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make peers"):
        vllm_peer(tmp_path / "nope", tmp_path, 2, "float32", 2, frozenset({2}))


class FakeLLM:
    """vLLM's `LLM` as the driver's `lora` uses it: each answer's tokens are its adapter's
    id (0 for the base), cut to 2 tokens where stop tokens are asked for."""

    made: ClassVar[list[FakeLLM]] = []

    def __init__(self, **options: Any) -> None:
        if options["model"] == "refuses":
            raise NotImplementedError("LoRA is not supported on this platform")
        self.options = options
        self.calls: list[tuple[list[list[int]], list[Any]]] = []
        FakeLLM.made.append(self)

    def generate(
        self, prompts: list[dict[str, Any]], params: Any, *, lora_request: Any, use_tqdm: bool
    ) -> list[Any]:
        self.calls.append(([p["prompt_token_ids"] for p in prompts], list(lora_request)))
        new = 2 if params.stop_token_ids else params.max_tokens
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=[r.lora_int_id if r else 0] * new)])
            for r in lora_request
        ]


@dataclass(frozen=True)
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_TARGET_DEVICE"):
        monkeypatch.setenv(name, "set by the test")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    FakeLLM.made.clear()
    parts: dict[str, dict[str, Any]] = {
        "vllm": {"__version__": "fake", "LLM": FakeLLM, "SamplingParams": SimpleNamespace},
        "vllm.inputs": {"TokensPrompt": dict},
        "vllm.config": {},
        "vllm.config.lora": {"MaxLoRARanks": Literal[1, 8, 16, 32, 64]},
        "vllm.lora": {},
        "vllm.lora.request": {"LoRARequest": FakeLoRARequest},
    }
    for name, attributes in parts.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)


def lora_request(model: str) -> dict[str, Any]:
    prompts = [[5, 6], [7], [8, 9, 10]]
    return {
        "model": model,
        "dtype": "bfloat16",
        "threads": 2,
        "adapters": {"a": "/adapters/a", "b": "/adapters/b"},
        "max_lora_rank": 12,
        "runs": [
            {"name": "spread", "prompts": prompts, "adapters": [None, "a", "b"],
             "max_new_tokens": 5, "stop": [2], "one_at_a_time": False},
            {"name": "lone", "prompts": prompts[:2], "adapters": ["b", "a"],
             "max_new_tokens": 4, "stop": [], "one_at_a_time": True},
        ],
    }  # fmt: skip


def test_the_lora_driver_loads_every_adapter_once_and_times_each_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_vllm(monkeypatch)
    answer = vllm_driver.lora(lora_request("folder"))
    (llm,) = FakeLLM.made
    assert llm.options["enable_lora"] and llm.options["max_loras"] == 2
    assert llm.options["max_lora_rank"] == 16  # 12 rounded up to a rank vLLM accepts
    assert llm.options["max_num_seqs"] == 3 and llm.options["dtype"] == "bfloat16"
    warm_up, spread, *lone = llm.calls
    assert [r.lora_name if r else None for r in warm_up[1]] == [None, "a", "b"]
    assert spread[0] == [[5, 6], [7], [8, 9, 10]]  # one call, an adapter per prompt
    assert [(r.lora_name, r.lora_int_id, r.lora_path) if r else None for r in spread[1]] == [
        None, ("a", 1, "/adapters/a"), ("b", 2, "/adapters/b"),
    ]  # fmt: skip
    assert [(call[0], [r.lora_name for r in call[1]]) for call in lone] == [
        ([[5, 6]], ["b"]), ([[7]], ["a"]),
    ]  # fmt: skip
    assert answer["version"] == "fake" and set(answer["runs"]) == {"spread", "lone"}
    assert answer["runs"]["spread"]["tokens"] == 6 and answer["runs"]["lone"]["tokens"] == 8
    assert all(run["seconds"] >= 0 for run in answer["runs"].values())


def test_vllm_refusing_lora_is_an_answer_that_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm(monkeypatch)
    answer = vllm_driver.lora(lora_request("refuses"))
    assert answer == {
        "does_not_run": "NotImplementedError: LoRA is not supported on this platform",
        "version": "fake",
    }
