"""Structured outputs through the official `openai` client: OpenAI's `response_format`,
vLLM's `structured_outputs` and `guided_*`, llama.cpp's `grammar` and `json_schema`. The
served model is tiny and random: every valid answer is the constraint's doing."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from served import MODEL_NAME

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)


def test_a_json_schema_response_format_fits_the_schema(live) -> None:
    answer = live.client().chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=80, response_format=SCHEMA_FORMAT
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    free = live.client().chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_parse_with_a_pydantic_model_works_unchanged(live) -> None:
    parsed = live.client().chat.completions.parse(
        model=MODEL_NAME, messages=ASK, max_tokens=80, response_format=Person
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 150


def test_streamed_and_sampled_answers_fit_too(live) -> None:
    stream = live.client().chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=80,
        response_format=SCHEMA_FORMAT,
        stream=True,
        n=2,
        temperature=1.0,
        seed=11,
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_regex_choice_and_grammars_on_completions(live) -> None:
    client = live.client()

    def complete(**extra: object) -> str:
        answer = client.completions.create(
            model=MODEL_NAME, prompt="Answer:", max_tokens=48, extra_body=extra
        )
        return answer.choices[0].text

    assert complete(structured_outputs={"choice": ["red", "green"]}) in ("red", "green")
    assert re.fullmatch(
        r"[0-9]{2}:[0-9]{2}", complete(structured_outputs={"regex": "[0-9]{2}:[0-9]{2}"})
    )
    assert complete(guided_choice=["up", "down"]) in ("up", "down")
    assert complete(grammar='root ::= "alpha" | "beta"') in ("alpha", "beta")  # llama.cpp: GBNF
    jsonschema.validate(json.loads(complete(json_schema=PERSON)), PERSON)  # llama.cpp's
    jsonschema.validate(json.loads(complete(guided_json=PERSON)), PERSON)
    lark = 'start: "x" DIGIT DIGIT\nDIGIT: /[0-9]/'
    assert re.fullmatch(r"x[0-9]{2}", complete(structured_outputs={"grammar": lark}))
    text = complete(response_format={"type": "json_object"})
    assert text.startswith("{")


def test_regex_choice_and_grammar_streamed_on_chat(live) -> None:
    def streamed(**extra: object) -> tuple[str, str | None]:
        stream = live.client().chat.completions.create(
            model=MODEL_NAME, messages=ASK, max_tokens=48, stream=True, extra_body=extra
        )
        text, reason = "", None
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                reason = choice.finish_reason or reason
        return text, reason

    assert streamed(structured_outputs={"choice": ["red", "green"]})[0] in ("red", "green")
    assert re.fullmatch(r"[0-9]{3}", streamed(structured_outputs={"regex": "[0-9]{3}"})[0])
    assert streamed(grammar='root ::= "alpha" | "beta"')[0] in ("alpha", "beta")
    # Any object may go on for ever: one that ends is an object, one cut short begins one.
    answer, reason = streamed(response_format={"type": "json_object"})
    assert answer.startswith("{"), answer
    if reason == "stop":
        assert isinstance(json.loads(answer), dict), answer


def test_a_schema_the_library_rejects_is_a_400_and_nothing_runs(live) -> None:
    started = live.engine.metrics().generations_started
    with pytest.raises(openai.BadRequestError) as refused:
        live.client().chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "strin"}},
            },
        )
    error = refused.value.body
    assert isinstance(error, dict) and "strin" in error["message"]
    assert error["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="regex"):
        live.client().completions.create(
            model=MODEL_NAME, prompt="x", extra_body={"structured_outputs": {"regex": "(open"}}
        )
    assert live.engine.metrics().generations_started == started
