"""`cellbatch run` through its real entry point (issue 5): the end-to-end run and its JSON
report, every bad-input rule, the prompt sources agreeing on tokens, and (slow) the
default model's answer.

The model is a tiny random Llama (2 layers, hidden 32) carrying the default model's
tokenizer and chat template (vocab 49,152), built once per module. Most runs call
`cellbatch.cli.main` in-process; the memory figures come from runs of the installed
`cellbatch` command in a subprocess, so that the RSS measured is the CLI's own.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cellbatch.cli import main
from tiny_models import make_tiny_chat_checkpoint

NEW_TOKENS = 8
CONTEXT = 256  # the tiny model's max_position_embeddings
GOOD_ENDINGS = ("token_limit", "stop_token")
MIB = 2**20
PROMPTS = (
    "Hi",
    "Name three colours of the rainbow.",
    "Write a long story about a dragon who lives under a mountain and collects old maps "
    "of faraway kingdoms, then lends them to lost travellers.",
)


@dataclass(frozen=True)
class TinyModel:
    folder: Path
    tokenizer: Any  # the transformers tokenizer saved beside the weights

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def chat(self, text: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return [int(t) for t in ids]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)


@dataclass
class CliRun:
    code: int
    stdout: str
    stderr: str
    report: dict[str, Any] | None

    @property
    def generations(self) -> list[dict[str, Any]]:
        assert self.report is not None, f"no report written; stderr:\n{self.stderr}"
        return self.report["generations"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A tiny random Llama with the default model's tokenizer beside it (built once)."""
    import transformers

    folder = make_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", CONTEXT)
    return TinyModel(folder, transformers.AutoTokenizer.from_pretrained(str(folder)))


@pytest.fixture
def cli(
    tiny: TinyModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> Callable[..., CliRun]:
    """cli(*args, model=tiny folder) -> `cellbatch run --model M ARGS --report-json R`
    run in-process, with its exit code, output and parsed report (None if not written)."""
    counter = itertools.count()

    def run(*args: str, model: Path | None = None) -> CliRun:
        report_path = tmp_path / f"report-{next(counter)}.json"
        code = main(
            [
                "run",
                "--model",
                str(model or tiny.folder),
                "--max-new-tokens",
                str(NEW_TOKENS),
                *args,
                "--report-json",
                str(report_path),
            ]
        )
        out = capsys.readouterr()
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        return CliRun(code, out.out, out.err, report)

    return run


@pytest.fixture
def model_loads(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Replaces Engine.from_pretrained with a recorder: the list of loads it was asked for."""
    from cellbatch.engine import Engine

    loads: list[object] = []
    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: loads.append(a))
    return loads


def write_lines(path: Path, lines: Sequence[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def write_token_lines(path: Path, prompts: Sequence[Sequence[int]]) -> Path:
    return write_lines(path, [" ".join(str(t) for t in prompt) for prompt in prompts])


def cellbatch_command() -> list[str]:
    """The installed `cellbatch` entry point beside this Python, else `python -m`."""
    script = Path(sys.executable).with_name("cellbatch")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "cellbatch.cli"]


def run_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cellbatch_command(), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def assert_completed(entry: dict[str, Any], new_tokens: int = NEW_TOKENS) -> None:
    assert entry["error"] == "", entry
    assert entry["finish_reason"] in GOOD_ENDINGS, entry
    if entry["finish_reason"] == "token_limit":
        assert len(entry["tokens"]) == new_tokens, entry
    assert entry["text"] or entry["finish_reason"] == "stop_token", entry


# -- end to end, in a subprocess ---------------------------------------------------


@pytest.fixture(scope="module")
def subprocess_runs(
    tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, tuple[subprocess.CompletedProcess[str], dict[str, Any]]]:
    """{prompt count: (process, report)} for 3 and 12 chat prompts of different lengths."""
    root = tmp_path_factory.mktemp("e2e")
    runs = {}
    for count in (3, 12):
        prompts = [f"{PROMPTS[i % 3]}{' Again.' * (i // 3)}" for i in range(count)]
        prompts_file = write_lines(root / f"prompts-{count}.txt", prompts)
        report_path = root / f"report-{count}.json"
        process = run_subprocess(
            "run",
            "--model",
            str(tiny.folder),
            "--prompts-file",
            str(prompts_file),
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--max-session-tokens",
            "128",
            "--report-json",
            str(report_path),
        )
        assert process.returncode == 0, process.stderr
        runs[count] = (process, json.loads(report_path.read_text()))
    return runs


def test_three_prompts_finish_sharing_forwards_in_a_bounded_pool(subprocess_runs) -> None:
    process, report = subprocess_runs[3]
    generations = report["generations"]
    assert [g["prompt"] for g in generations] == list(PROMPTS)
    assert len({g["prompt_tokens"] for g in generations}) == 3  # different lengths
    for entry in generations:
        assert_completed(entry)
        assert entry["text"] in process.stdout
    engine = report["engine"]
    # Forwards were shared: one step carries several sessions' decode tokens.
    assert engine["steps"] < engine["decode_tokens"], engine
    assert engine["peak_concurrent_generations"] == 3
    config = report["config"]
    assert config["max_sessions"] == 3 and config["max_session_tokens"] == 128
    assert 0 < report["kv"]["pool_rows"] < config["max_sessions"] * config["max_session_tokens"]
    for section in ("=== engine ===", "=== KV pool ===", "=== memory ==="):
        assert section in process.stdout


def test_weights_are_loaded_once_whatever_the_session_count(subprocess_runs) -> None:
    weights = subprocess_runs[3][1]["weights_bytes"]
    loaded = {}
    for count, (_, report) in subprocess_runs.items():
        assert report["config"]["max_sessions"] == count
        assert report["weights_bytes"] == weights
        memory = report["memory"]
        loaded[count] = memory["after_load"]["rss_bytes"] - memory["before_load"]["rss_bytes"]
        assert loaded[count] <= 1.5 * weights + 256 * MIB, (count, loaded[count], weights)
    # The bound above is loose for a tiny model; a copy of the weights per session would
    # add 9 copies between 3 and 12 sessions, so allow well under half of that.
    assert loaded[12] - loaded[3] < 4 * weights, (loaded, weights)


def test_report_json_schema(subprocess_runs) -> None:
    _, report = subprocess_runs[3]
    assert {
        "generations",
        "memory",
        "kv",
        "weights_bytes",
        "config",
        "timing",
        "engine",
    } <= report.keys()
    for entry in report["generations"]:
        assert {"prompt", "prompt_tokens", "tokens", "text", "finish_reason", "error"} <= set(entry)
        assert isinstance(entry["prompt"], str) and isinstance(entry["text"], str)
        assert isinstance(entry["prompt_tokens"], int) and entry["prompt_tokens"] > 0
        assert 0 <= entry["shared_prefix_tokens"] < entry["prompt_tokens"]
        assert all(isinstance(t, int) for t in entry["tokens"])
    shared = {entry["shared_prefix_tokens"] for entry in report["generations"]}
    assert report["engine"]["prefill_turns"] == (0 if shared == {0} else 1)
    for stage in ("before_load", "after_load", "after_generate"):
        assert report["memory"][stage]["rss_bytes"] > 0
    assert {"cells_in_use", "pool_rows", "allocated_bytes", "growth_count", "bytes_per_cell"} <= (
        report["kv"].keys()
    )
    assert report["weights_bytes"] > 0
    timing = report["timing"]
    assert timing["generated_tokens"] == sum(len(g["tokens"]) for g in report["generations"])
    assert timing["generate_seconds"] > 0
    assert timing["tokens_per_second"] == pytest.approx(
        timing["generated_tokens"] / timing["generate_seconds"]
    )
    config = report["config"]
    assert config["max_new_tokens"] == NEW_TOKENS and config["temperature"] == 0.0
    engine = report["engine"]
    # every engine counter (metrics.EngineMetrics.as_dict) is there
    for name in ("steps", "decode_tokens", "prefill_tokens", "generations_completed", "finished"):
        assert name in engine
    assert engine["generations_completed"] == 3
    assert engine["generated_tokens"] == timing["generated_tokens"]


# -- bad input: the other prompts still run ----------------------------------------


def test_empty_lines_are_skipped_with_a_note(cli, tmp_path: Path) -> None:
    prompts = write_lines(tmp_path / "p.txt", ["Hi", "", "   ", "Bye"])
    run = cli("--prompts-file", str(prompts))
    assert run.code == 0
    assert [g["source"] for g in run.generations] == [f"{prompts}:1", f"{prompts}:4"]
    for entry in run.generations:
        assert_completed(entry)
    assert f"{prompts}:2: empty line skipped" in run.stderr
    assert f"{prompts}:3: empty line skipped" in run.stderr
    assert "generating" not in run.stderr  # no progress bar when stderr is not a terminal


@pytest.mark.parametrize("bad_id", [49152, 10**6, -1])
def test_token_outside_the_vocabulary_fails_only_its_prompt(
    cli, tiny: TinyModel, tmp_path: Path, bad_id: int
) -> None:
    assert bad_id >= tiny.vocab_size or bad_id < 0
    tokens = write_lines(tmp_path / "t.txt", ["1 2 3", f"5 {bad_id} 7", "", "9 10 11 12"])
    run = cli("--prompt-tokens-file", str(tokens))
    assert run.code == 1
    first, bad, last = run.generations
    assert bad["finish_reason"] == "failed" and bad["tokens"] == []
    assert f"{tokens}:2" in bad["error"] and str(bad_id) in bad["error"]
    assert f"{tokens}:2" in run.stdout and str(bad_id) in run.stdout
    assert_completed(first)
    assert_completed(last)
    assert last["source"] == f"{tokens}:4"


def test_non_integer_token_fails_only_its_prompt(cli, tmp_path: Path) -> None:
    tokens = write_lines(tmp_path / "t.txt", ["1 2 3", "12 abc 7", "4 5"])
    run = cli("--prompt-tokens-file", str(tokens))
    assert run.code == 1
    first, bad, last = run.generations
    assert bad["finish_reason"] == "failed"
    assert f"{tokens}:2" in bad["error"] and "'abc'" in bad["error"]
    assert_completed(first)
    assert_completed(last)


def test_prompt_too_long_for_the_session_fails_with_the_numbers(cli, tmp_path: Path) -> None:
    tokens = write_token_lines(tmp_path / "t.txt", [[1, 2, 3], list(range(100, 135))])
    run = cli("--prompt-tokens-file", str(tokens), "--max-session-tokens", "40")
    assert run.code == 1
    good, bad = run.generations
    assert_completed(good)
    assert bad["finish_reason"] == "failed" and f"{tokens}:2" in bad["error"]
    # 35 prompt tokens + 8 new = 43 > 40
    for number in ("35", str(NEW_TOKENS), "43", "40"):
        assert number in bad["error"], bad["error"]


def test_prompt_too_long_for_the_model_context_fails_with_the_numbers(cli, tmp_path: Path) -> None:
    long_prompt = list(range(1000, 1000 + CONTEXT - 6))
    tokens = write_token_lines(tmp_path / "t.txt", [long_prompt, [1, 2, 3]])
    run = cli("--prompt-tokens-file", str(tokens))
    assert run.code == 1
    bad, good = run.generations
    assert_completed(good)
    assert bad["finish_reason"] == "failed" and f"{tokens}:1" in bad["error"]
    for number in (str(CONTEXT - 6), str(CONTEXT - 6 + NEW_TOKENS), str(CONTEXT)):
        assert number in bad["error"], bad["error"]


@pytest.mark.parametrize("option", ["--prompt-file", "--prompts-file", "--prompt-tokens-file"])
def test_missing_prompt_file_is_an_error_before_the_model_loads(
    cli, tmp_path: Path, model_loads: list[object], option: str
) -> None:
    missing = tmp_path / "nowhere.txt"
    run = cli(option, str(missing))
    assert run.code == 2 and run.report is None
    assert f"prompt file {missing} does not exist" in run.stderr
    assert model_loads == []


@pytest.mark.parametrize("kind", ["directory", "not utf-8"])
def test_unreadable_prompt_file_is_an_error_before_the_model_loads(
    cli, tmp_path: Path, model_loads: list[object], kind: str
) -> None:
    path = tmp_path / "prompts"
    if kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"caf\xe9\n")
    run = cli("--prompts-file", str(path))
    assert run.code == 2 and run.report is None
    assert f"cannot read prompt file {path}" in run.stderr
    assert model_loads == []


def test_missing_prompt_file_in_a_subprocess(tiny: TinyModel, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.txt"
    process = run_subprocess("run", "--model", str(tiny.folder), "--prompts-file", str(missing))
    assert process.returncode == 2
    assert process.stderr.strip() == f"cellbatch: error: prompt file {missing} does not exist"
    assert process.stdout == ""


def test_missing_model_is_an_error_before_loading(cli, tmp_path: Path) -> None:
    prompts = write_lines(tmp_path / "p.txt", ["Hi"])
    run = cli("--prompts-file", str(prompts), model=tmp_path / "no-model")
    assert run.code == 2
    assert f"model {tmp_path / 'no-model'} does not exist" in run.stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--max-new-tokens", "0"), "--max-new-tokens must be >= 1, got 0"),
        (("--stop", ""), "--stop needs a non-empty string"),
        (("--report-json", "/nonexistent-folder/r.json"), "is not a writable folder"),
        (("--speculative-config", '{"method": "eagle"}'), "method must be one of ngram"),
        (("--speculative-config", "ngram"), "--speculative-config: the speculative config is"),
    ],
    ids=["no-new-tokens", "empty-stop", "unwritable-report", "bad-method", "not-json"],
)
def test_options_that_could_only_fail_later_are_refused_before_loading(
    tmp_path: Path,
    model_loads: list[object],
    capsys: pytest.CaptureFixture[str],
    options: tuple[str, ...],
    message: str,
) -> None:
    prompts = write_lines(tmp_path / "p.txt", ["Hi"])
    code = main(["run", "--prompts-file", str(prompts), *options])
    assert code == 2
    assert message in capsys.readouterr().err
    assert model_loads == []


# -- prompt sources ----------------------------------------------------------------


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "chat"])
def test_tokens_file_and_prompts_file_give_the_same_tokens(
    cli, tiny: TinyModel, tmp_path: Path, raw: bool
) -> None:
    encode = tiny.encode if raw else tiny.chat
    prompts = write_lines(tmp_path / "p.txt", PROMPTS)
    tokens = write_token_lines(tmp_path / "t.txt", [encode(text) for text in PROMPTS])
    by_text = cli("--prompts-file", str(prompts), *(["--raw"] if raw else []))
    by_ids = cli("--prompt-tokens-file", str(tokens))
    assert by_text.code == by_ids.code == 0
    for text_entry, ids_entry, prompt in zip(
        by_text.generations, by_ids.generations, PROMPTS, strict=True
    ):
        assert text_entry["prompt_tokens"] == ids_entry["prompt_tokens"] == len(encode(prompt))
        assert text_entry["tokens"] == ids_entry["tokens"]
        assert text_entry["text"] == ids_entry["text"] == tiny.decode(ids_entry["tokens"])
        assert_completed(text_entry)
    # Different prompts gave different answers, so equal tokens above mean equal prompts.
    assert len({tuple(g["tokens"]) for g in by_ids.generations}) == len(PROMPTS)


def test_literal_backslash_n_in_a_prompts_file_line_is_a_newline(
    cli, tiny: TinyModel, tmp_path: Path
) -> None:
    line = r"First line\nsecond line"
    text = "First line\nsecond line"
    assert len(tiny.encode(text)) != len(tiny.encode(line))
    assert len(tiny.chat(text)) != len(tiny.chat(line))
    prompts = write_lines(tmp_path / "p.txt", [line])
    raw = cli("--prompts-file", str(prompts), "--raw")
    chat = cli("--prompts-file", str(prompts))
    assert raw.code == chat.code == 0
    assert raw.generations[0]["prompt"] == chat.generations[0]["prompt"] == line
    assert raw.generations[0]["prompt_tokens"] == len(tiny.encode(text))
    assert chat.generations[0]["prompt_tokens"] == len(tiny.chat(text))
    by_ids = cli("--prompt-tokens-file", str(write_token_lines(tmp_path / "t", [tiny.chat(text)])))
    assert chat.generations[0]["tokens"] == by_ids.generations[0]["tokens"]


def test_prompt_arguments_work_like_prompts_file_lines(cli, tmp_path: Path) -> None:
    lines = [r"Hi\nthere", "Name a colour."]
    by_file = cli("--prompts-file", str(write_lines(tmp_path / "p.txt", lines)))
    by_args = cli(*lines)
    assert by_file.code == by_args.code == 0
    for from_file, from_args in zip(by_file.generations, by_args.generations, strict=True):
        assert from_args["prompt"] == from_file["prompt"]
        assert from_args["prompt_tokens"] == from_file["prompt_tokens"]
        assert from_args["tokens"] == from_file["tokens"]
    assert [g["source"] for g in by_args.generations] == ["argument:1", "argument:2"]


def test_prompt_file_is_used_verbatim(cli, tiny: TinyModel, tmp_path: Path) -> None:
    # several lines, a literal backslash-n and a trailing newline: all kept as written
    content = "<|im_start|>user\nSay hi\\n twice<|im_end|>\n<|im_start|>assistant\n"
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(content, encoding="utf-8")
    run = cli("--prompt-file", str(prompt_file))
    by_ids = cli(
        "--prompt-tokens-file", str(write_token_lines(tmp_path / "t", [tiny.encode(content)]))
    )
    assert run.code == by_ids.code == 0
    (entry,) = run.generations
    assert entry["prompt"] == content
    assert entry["prompt_tokens"] == len(tiny.encode(content))
    assert entry["prompt_tokens"] != len(tiny.chat(content))
    assert entry["tokens"] == by_ids.generations[0]["tokens"]
    assert_completed(entry)


def test_stop_string_cuts_the_text_before_it(cli, tiny: TinyModel, tmp_path: Path) -> None:
    new_tokens = 16
    prompts = write_lines(tmp_path / "p.txt", ["Once upon a time"])
    free = cli("--prompts-file", str(prompts), "--raw", "--max-new-tokens", str(new_tokens))
    (entry,) = free.generations
    assert entry["finish_reason"] == "token_limit"
    tokens, text = entry["tokens"], entry["text"]
    # A word of the answer, first seen after its start and well before its end.
    stop = next(
        (
            word
            for k in range(2, new_tokens - 4)
            if len(word := tiny.decode(tokens[k : k + 1]).strip()) >= 3
            and word.isalpha()
            and 0 < text.find(word) < len(tiny.decode(tokens[: k + 1]))
        ),
        "",
    )
    assert stop, f"no usable stop word in {text!r}"
    stopped = cli(
        "--prompts-file",
        str(prompts),
        "--raw",
        "--max-new-tokens",
        str(new_tokens),
        "--stop",
        stop,
    )
    assert stopped.code == 0
    (cut,) = stopped.generations
    assert cut["finish_reason"] == "stop_string" and cut["error"] == ""
    assert cut["text"] == text[: text.find(stop)]
    assert stop not in cut["text"]
    assert len(cut["tokens"]) < new_tokens  # generation ended early, not at the limit
    assert cut["tokens"] == tokens[: len(cut["tokens"])]
    assert stopped.report["config"]["stop"] == [stop]


def test_model_without_a_tokenizer_runs_token_prompts_and_fails_text_ones(
    cli, tiny: TinyModel, tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((tiny.folder / name).read_bytes())
    tokens = write_token_lines(tmp_path / "t.txt", [[1, 2, 3]])
    by_ids = cli("--prompt-tokens-file", str(tokens), model=bare)
    assert by_ids.code == 0
    (entry,) = by_ids.generations
    assert_completed(entry)
    assert entry["text"] == " ".join(str(t) for t in entry["tokens"])  # ids, no tokenizer
    by_text = cli("Hello", model=bare)
    assert by_text.code == 1
    assert by_text.generations[0]["finish_reason"] == "failed"
    assert "argument:1" in by_text.generations[0]["error"]
    assert "no tokenizer" in by_text.generations[0]["error"]


def test_model_without_a_chat_template_says_to_use_raw(cli, tiny: TinyModel, tmp_path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    for source in tiny.folder.iterdir():
        if source.name != "chat_template.jinja":
            (plain / source.name).write_bytes(source.read_bytes())
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    run = cli("Hello", model=plain)
    assert run.code != 0
    assert "chat template" in run.stdout + run.stderr and "--raw" in run.stdout + run.stderr


# -- batching does not change results ------------------------------------------------


@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_results_do_not_depend_on_how_many_sessions_run_at_once(
    cli, tmp_path: Path, temperature: str
) -> None:
    prompts = write_lines(tmp_path / "p.txt", PROMPTS)
    options = ("--prompts-file", str(prompts), "--temperature", temperature, "--seed", "7")
    together = cli(*options)
    one_at_a_time = cli(*options, "--max-sessions", "1")
    assert together.code == one_at_a_time.code == 0
    assert one_at_a_time.report["engine"]["peak_concurrent_generations"] == 1
    assert together.report["engine"]["peak_concurrent_generations"] == len(PROMPTS)
    assert [g["tokens"] for g in together.generations] == [
        g["tokens"] for g in one_at_a_time.generations
    ]
    if temperature != "0":
        other_seed = cli(*options[:-1], "8")
        assert [g["tokens"] for g in other_seed.generations] != [
            g["tokens"] for g in together.generations
        ]


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_speculative_decoding_gives_the_same_tokens_and_reports_its_drafts(
    cli, tmp_path: Path, temperature: str
) -> None:
    prompts = write_lines(tmp_path / "p.txt", PROMPTS)
    options = ("--prompts-file", str(prompts), "--temperature", temperature, "--seed", "3")
    plain = cli(*options)
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    speculating = cli(*options, "--speculative-config", config)
    assert plain.code == speculating.code == 0
    assert [g["tokens"] for g in speculating.generations] == [
        g["tokens"] for g in plain.generations
    ]
    assert speculating.report["config"]["speculative"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
        "model": None,
        "disable_by_batch_size": None,
    }
    engine = speculating.report["engine"]
    for key in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"):
        assert key in engine
    assert plain.report["config"]["speculative"] is None


# -- the default model ----------------------------------------------------------------


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(tmp_path: Path) -> None:
    """In the parity mode (fp32), the same on every CPU kind: in bf16 the first token's
    top two logits ("The" and "L", 0.08 apart in fp32) round to one bf16 value, so the
    answer there depends on rounding."""
    report_path = tmp_path / "report.json"
    code = main(
        [
            "run",
            "What is the capital of France?",
            "--max-new-tokens",
            "16",
            "--dtype",
            "float32",
            "--report-json",
            str(report_path),
        ]
    )
    assert code == 0
    (entry,) = json.loads(report_path.read_text())["generations"]
    assert "Paris" in entry["text"], entry


def test_answers_fit_the_constraint_options(cli, tmp_path: Path) -> None:
    import jsonschema

    prompts = write_lines(tmp_path / "p.txt", ["Describe a cat.", "Describe a dog."])
    schema = {
        "type": "object",
        "properties": {"legs": {"type": "integer", "minimum": 0, "maximum": 8}},
        "required": ["legs"],
        "additionalProperties": False,
    }
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    fitted = cli(
        "--prompts-file", str(prompts), "--max-new-tokens", "24", "--json-schema", str(schema_file)
    )
    assert fitted.code == 0, fitted.stderr
    for entry in fitted.generations:
        jsonschema.validate(json.loads(entry["text"]), schema)
    chosen = cli("--prompts-file", str(prompts), "--choice", "meow", "--choice", "woof")
    assert chosen.code == 0 and {e["text"] for e in chosen.generations} <= {"meow", "woof"}
    bad = cli("--prompts-file", str(prompts), "--regex", "(unclosed")
    assert bad.code == 2 and "does not compile" in bad.stderr and bad.report is None
