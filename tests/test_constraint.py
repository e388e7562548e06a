"""Constrained generation through the Engine, on a tiny random Llama carrying the default
model's tokenizer: a random model cannot write JSON on its own, so every valid answer is
the constraint's doing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch

from cellbatch import Engine, FinishReason, GenConfig, SamplingParams
from cellbatch.generation_config import Constraint
from cellbatch.types import InvalidArgumentError
from tiny_models import make_tiny_chat_checkpoint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Describe Ann as JSON.", "Who is Bob?", "hi", "List three colours.", "Go."]
BUDGET = GenConfig(max_new_tokens=96)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_checkpoint(tmp_path_factory.mktemp("constrained") / "llama", 512)


@pytest.fixture(scope="module")
def engine(folder: Path) -> Iterator[Engine]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with Engine.from_pretrained(
        folder, dtype="float32", kernels="torch", max_sessions=40, max_batch_tokens=256
    ) as made:
        yield made
    torch.set_num_threads(threads)


def test_a_json_schema_holds_where_the_model_alone_writes_no_json(engine: Engine) -> None:
    constrained = engine.chat(PROMPTS, BUDGET, constraint=Constraint.json_schema(PERSON))
    for result in constrained:
        assert result.finish_reason == FinishReason.STOP_TOKEN, result.text
        jsonschema.validate(json.loads(result.text), PERSON)
    free = engine.chat(PROMPTS, BUDGET)
    assert not any(_is_json(result.text) for result in free)


def test_any_json_object_regex_and_choice(engine: Engine) -> None:
    # Any object may go on for ever: the ones that end are objects, the others begin one.
    for result in engine.chat(PROMPTS, BUDGET, constraint=Constraint.json_object()):
        assert result.text.startswith("{")
        if result.finish_reason == FinishReason.STOP_TOKEN:
            assert isinstance(json.loads(result.text), dict)
    pattern = r"[0-9]{3}-[0-9]{4}"
    for result in engine.chat(PROMPTS, BUDGET, constraint=Constraint.regex(pattern)):
        assert re.fullmatch(pattern, result.text), result.text
    choices = ["yes", "no", "maybe so"]
    for result in engine.chat(PROMPTS, BUDGET, constraint=Constraint.choice(choices)):
        assert result.text in choices


def test_a_lark_grammar_and_a_gbnf_grammar(engine: Engine) -> None:
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'
    for result in engine.chat(PROMPTS, BUDGET, constraint=Constraint.grammar(lark)):
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", result.text), result.text
    gbnf = 'root ::= "on" | "off"'
    for result in engine.chat(PROMPTS, BUDGET, constraint=Constraint.grammar(gbnf, gbnf=True)):
        assert result.text in ("on", "off")


def test_seeded_sampling_at_temperature_one_still_fits(engine: Engine) -> None:
    config = GenConfig(max_new_tokens=96, sampling=SamplingParams(temperature=1.0), seed=7)
    first = engine.chat(PROMPTS, config, constraint=Constraint.json_schema(PERSON))
    for result in first:
        jsonschema.validate(json.loads(result.text), PERSON)
    again = engine.chat(PROMPTS, config, constraint=Constraint.json_schema(PERSON))
    assert [r.tokens for r in again] == [r.tokens for r in first]


def test_a_constrained_prompt_gets_the_same_tokens_alone_and_among_31_others(
    engine: Engine,
) -> None:
    schema = Constraint.json_schema(PERSON)
    alone = engine.chat([PROMPTS[0]], BUDGET, constraint=schema, share_prefix=False)[0]
    session_tokens = [engine.chat_tokens(PROMPTS[0])]
    crowd_prompts = [engine.chat_tokens(f"prompt number {i}: {PROMPTS[i % 5]}") for i in range(31)]
    handles = []
    sessions = []
    for index, tokens in enumerate(session_tokens + crowd_prompts):
        session = engine.open_session()
        sessions.append(session)
        # Every other neighbour is constrained too, to another schema or to nothing.
        neighbour = None if index % 2 else Constraint.json_object()
        sampling = SamplingParams(constraint=schema if index == 0 else neighbour)
        handles.append(
            session.generate_async(tokens, GenConfig(max_new_tokens=96, sampling=sampling))
        )
    for handle in handles:
        assert handle.wait(120)
    assert list(handles[0].tokens()) == alone.tokens
    for session in sessions:
        session.close()


def test_preemption_under_a_small_pool_keeps_the_constrained_tokens(
    engine: Engine, folder: Path
) -> None:
    # 45 digits (about 92 tokens) each: five at once need more than the 150 cells.
    digits = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 45,
        "maxItems": 45,
    }
    schema, budget = Constraint.json_schema(digits), GenConfig(max_new_tokens=160)
    roomy = engine.chat(PROMPTS, budget, constraint=schema, share_prefix=False)
    with Engine.from_pretrained(
        folder, dtype="float32", kernels="torch", max_sessions=5, max_cells=150
    ) as small:
        squeezed = small.chat(PROMPTS, budget, constraint=schema, share_prefix=False)
        assert small.metrics().preemptions > 0
    assert [r.tokens for r in squeezed] == [r.tokens for r in roomy]
    for result in squeezed:
        jsonschema.validate(json.loads(result.text), digits)


def test_a_schema_the_library_rejects_fails_each_prompt_before_anything_runs(
    engine: Engine,
) -> None:
    started = engine.metrics().generations_started
    results = engine.chat(PROMPTS[:2], BUDGET, constraint=Constraint.json_schema({"type": "strin"}))
    for result in results:
        assert result.finish_reason == FinishReason.FAILED
        assert "does not compile" in result.error and "strin" in result.error
    assert engine.metrics().generations_started == started
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        engine.check_constraint(Constraint("json_schema", "{not json"))


def test_a_session_turn_with_a_bad_constraint_fails_alone(engine: Engine) -> None:
    session = engine.open_session()
    bad = SamplingParams(constraint=Constraint.regex("(unclosed"))
    handle = session.generate_async(engine.chat_tokens("hi"), GenConfig(sampling=bad))
    assert handle.wait(30)
    assert handle.finish_reason() == FinishReason.FAILED
    good = session.generate_async(
        [],
        GenConfig(max_new_tokens=8, sampling=SamplingParams(constraint=Constraint.choice(["ok"]))),
    )
    assert good.wait(30)
    assert good.result().text == "ok"
    session.close()


def test_constraints_refuse_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="one of"):
        Constraint("yaml", "x")
    with pytest.raises(InvalidArgumentError, match="at least one choice"):
        Constraint.choice([])
    with pytest.raises(InvalidArgumentError, match="needs its regex"):
        Constraint.regex("")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_a_tokenizer_the_library_cannot_read_refuses_constraints_and_nothing_else(
    tiny_bench_model: Path,
) -> None:
    # A word-level tokenizer without a decoder: llguidance cannot map its tokens to bytes.
    with Engine.from_pretrained(tiny_bench_model, dtype="float32", kernels="torch") as words:
        assert words.chat(["hi"], GenConfig(max_new_tokens=3))[0].ok
        refused = words.chat(["hi"], BUDGET, constraint=Constraint.choice(["yes"]))[0]
        assert refused.finish_reason == FinishReason.FAILED
        assert "cannot drive constraints" in refused.error


def test_token_rules_and_a_constraint_hold_together_and_the_constraint_wins_a_conflict(
    engine: Engine,
) -> None:
    """Rules ban with -inf, which the constraint's mask must not turn into NaN; where the
    rules leave nothing the constraint allows, the constraint wins."""
    choices = Constraint.choice(["yes", "no"])
    tokenizer = engine.tokenizer
    no = frozenset(tokenizer.encode("no")) | tokenizer.stop_tokens
    both = SamplingParams(constraint=choices, allowed_tokens=no)
    for result in engine.chat(PROMPTS, GenConfig(max_new_tokens=8, sampling=both)):
        assert (result.text, result.finish_reason) == ("no", FinishReason.STOP_TOKEN)
    # min_tokens holds the stop token back, but a complete choice allows only that.
    held = SamplingParams(constraint=choices, min_tokens=20)
    for result in engine.chat(PROMPTS, GenConfig(max_new_tokens=30, sampling=held)):
        assert result.text in ("yes", "no") and result.finish_reason == FinishReason.STOP_TOKEN
    # Allowed tokens outside the grammar: the grammar's tokens are drawn instead.
    letters = frozenset(tokenizer.encode("abc xyz"))
    pattern = r"[0-9]{3}"
    clash = SamplingParams(constraint=Constraint.regex(pattern), allowed_tokens=letters)
    for result in engine.chat(PROMPTS, GenConfig(max_new_tokens=8, sampling=clash)):
        assert re.fullmatch(pattern, result.text), result.text
    banned = SamplingParams(constraint=Constraint.json_schema(PERSON), banned_sequences=((0,),))
    for result in engine.chat(PROMPTS, GenConfig(max_new_tokens=96, sampling=banned)):
        jsonschema.validate(json.loads(result.text), PERSON)
