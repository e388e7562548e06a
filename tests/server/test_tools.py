"""Tool calls through the official `openai` client: each tool_choice, streamed and not,
the calls' history going back to the model, and the requests that are refused. The
served model is tiny and random: a call that parses and fits its schema is the
grammar's doing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from cellbatch.tool_calls.formats import format_named
from served import API_KEY, MODEL_NAME, LiveServer, start_live_server
from tiny_models import make_tiny_chat_checkpoint

# The tools' description takes about 200 tokens of the prompt: more room than the
# shared server's 256-token context.
CONTEXT = 1024


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_checkpoint(tmp_path_factory.mktemp("tools") / "llama", CONTEXT)


@pytest.fixture(scope="module")
def live(model: Path) -> Iterator[LiveServer]:
    server = start_live_server(model, max_sessions=4)
    yield server
    server.stop()


WEATHER_ARGUMENTS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_ARGUMENTS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Forecast",
            "parameters": WEATHER_ARGUMENTS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_ARGUMENTS}},
]
SCHEMAS = {"get_weather": WEATHER_ARGUMENTS, "get_time": TIME_ARGUMENTS}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def chat(live, **options: object):
    """A chat completion, greedy unless the options say otherwise."""
    return live.client().chat.completions.create(
        model=MODEL_NAME,
        messages=options.pop("messages", ASK),
        max_tokens=options.pop("max_tokens", 80),
        temperature=options.pop("temperature", 0.0),
        **options,
    )


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def collect(stream) -> tuple[dict[int, str], dict[int, list[dict[str, str]]], dict[int, str]]:
    """Each choice's content, calls (from their deltas) and finish reason."""
    content: dict[int, str] = {}
    calls: dict[int, list[dict[str, str]]] = {}
    reasons: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            for piece in choice.delta.tool_calls or ():
                made = calls.setdefault(choice.index, [])
                if piece.id is not None:
                    assert piece.index == len(made) and piece.type == "function"
                    made.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
                made[piece.index]["arguments"] += piece.function.arguments or ""
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return content, calls, reasons


def test_a_required_call_fits_its_tools_schema(live) -> None:
    answer = chat(live, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments)
    # Left to choose, the random model writes text: the call above is the grammar's.
    free = chat(live, tools=TOOLS, tool_choice="auto")
    assert free.choices[0].message.tool_calls == []
    assert free.choices[0].finish_reason != "tool_calls"


def test_a_named_function_is_called_once_streamed_or_not(live) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = chat(live, tools=TOOLS, tool_choice=named)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_call("get_time", call.function.arguments)
    content, calls, reasons = collect(chat(live, tools=TOOLS, tool_choice=named, stream=True))
    assert reasons == {0: "tool_calls"} and content == {0: ""}
    assert [(c["name"], c["arguments"]) for c in calls[0]] == [
        ("get_time", call.function.arguments)
    ]


def test_parallel_required_calls_of_n_sampled_choices_fit(live) -> None:
    # Parallel calls may go on until max_tokens; a call is about 30 tokens, so the
    # first always completes, and only the last of a choice cut by the limit may not.
    options = {"tools": TOOLS, "tool_choice": "required", "n": 2, "temperature": 1.0, "seed": 5}
    whole = chat(live, max_tokens=200, **options)
    _, streamed, reasons = collect(chat(live, max_tokens=200, stream=True, **options))
    for choice in whole.choices:
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call.function.name, call.function.arguments)
        calls = streamed[choice.index]
        assert reasons[choice.index] == choice.finish_reason
        whole_calls = calls if reasons[choice.index] == "tool_calls" else calls[:-1]
        for call in whole_calls:
            check_call(call["name"], call["arguments"])
        assert [c["arguments"] for c in whole_calls] == [
            c.function.arguments for c in choice.message.tool_calls
        ][: len(whole_calls)]


def test_parallel_tool_calls_false_makes_one_call(live) -> None:
    for seed in range(3):
        answer = chat(
            live,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
        )
        assert len(answer.choices[0].message.tool_calls) == 1


def test_auto_answers_text_without_markup_and_none_offers_no_tools(live) -> None:
    whole = chat(live, tools=TOOLS)
    content, calls, reasons = collect(chat(live, tools=TOOLS, stream=True))
    assert calls == {} and content[0] == whole.choices[0].message.content
    assert reasons[0] == whole.choices[0].finish_reason
    # tool_choice none: the tools are not offered, so the answer is the one without them.
    none = chat(live, tools=TOOLS, tool_choice="none")
    plain = chat(live)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.content != whole.choices[0].message.content
    streamed, calls, _ = collect(chat(live, tools=TOOLS, tool_choice="none", stream=True))
    assert calls == {} and streamed[0] == none.choices[0].message.content


def test_the_history_of_calls_and_results_reaches_the_model(live) -> None:
    first = chat(live, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    message = first.choices[0].message
    (call,) = message.tool_calls
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = chat(live, messages=history, tools=TOOLS, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length")
    body = {"model": MODEL_NAME, "messages": history, "tools": TOOLS}
    tokens = httpx.post(live.base_url + "/tokenize", json=body, headers=HEADERS).json()["tokens"]
    answer = httpx.post(live.base_url + "/detokenize", json={"tokens": tokens}, headers=HEADERS)
    text = answer.json()["prompt"]
    assert call.function.arguments in text and "sunny, 21 C" in text and "get_time" in text


class GetWeather(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = pydantic.Field(ge=1, le=7)


def test_parse_with_a_pydantic_tool_works_unchanged(live) -> None:
    parsed = live.client().chat.completions.parse(
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=80,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    calls = parsed.choices[0].message.tool_calls
    assert calls and all(isinstance(c.function.parsed_arguments, GetWeather) for c in calls)


@pytest.mark.parametrize(
    ("options", "param", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot both",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
            "strin",
        ),
        # auto holds a call the model makes to its schema too: the schema must compile.
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
                ]
            },
            "tools",
            "strin",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "more than once"),
    ],
)
def test_tool_requests_that_cannot_be_served_are_400s(live, options, param, words) -> None:
    started = live.engine.metrics().generations_started
    with pytest.raises(openai.BadRequestError) as refused:
        chat(live, **options)
    assert refused.value.body["param"] == param and words in refused.value.body["message"]
    assert live.engine.metrics().generations_started == started


def test_tools_on_completions_are_refused(live) -> None:
    with pytest.raises(openai.BadRequestError, match="tools"):
        live.client().completions.create(model=MODEL_NAME, prompt="x", extra_body={"tools": TOOLS})


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_the_tool_call_parser_setting_picks_the_format(model: Path, parser: str) -> None:
    """`serve --tool-call-parser` (ServerSettings.tool_call_parser) overrides the format the
    template implies: the required call is written, held and read in that format."""
    server = start_live_server(model, max_sessions=2, tool_call_parser=parser)
    try:
        # The ChatML template has no place for tools: the format's own words offer them.
        body = {"messages": ASK, "tools": TOOLS}
        tokens = httpx.post(server.base_url + "/tokenize", json=body, headers=HEADERS)
        prompt = httpx.post(
            server.base_url + "/detokenize",
            json={"tokens": tokens.json()["tokens"]},
            headers=HEADERS,
        ).json()["prompt"]
        example = format_named(parser).write_calls(
            [("the_function_name", {"an_argument": "its value"})]
        )
        assert example in prompt and "<tool_call>" not in prompt
        for stream in (False, True):
            answer = chat(
                server,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                stream=stream,
            )
            if stream:
                _, calls, reasons = collect(answer)
                found = [(c["name"], c["arguments"]) for c in calls[0]]
                assert reasons[0] == "tool_calls"
            else:
                choice = answer.choices[0]
                assert choice.finish_reason == "tool_calls"
                found = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            assert len(found) == 1
            check_call(*found[0])
    finally:
        server.stop()
