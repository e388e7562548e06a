"""OpenAI's Responses API through the official `openai` client: a conversation with a
function tool round trip, streamed and not; `previous_response_id` across a server
restart (kept under --data-dir); a JSON-schema `text.format`; GET and DELETE; and the
requests that are refused. The served model is tiny and random: a call that parses and
fits its schema is the grammar's doing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from served import API_KEY, MODEL_NAME, LiveServer, start_live_server
from tiny_models import make_tiny_chat_checkpoint

CONTEXT = 1024  # the tools' description takes about 200 tokens of the prompt

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER}
]
ASK = "Weather in Paris?"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_checkpoint(tmp_path_factory.mktemp("responses") / "llama", CONTEXT)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def live(model: Path, data_dir: Path) -> Iterator[LiveServer]:
    server = start_live_server(model, max_sessions=4, data_dir=data_dir)
    yield server
    server.stop()


def prompt_tokens(live: LiveServer, messages: list[dict[str, object]], tools=None) -> int:
    """The prompt's length as the chat route's template renders these messages."""
    body: dict[str, object] = {"model": MODEL_NAME, "messages": messages}
    if tools:
        body["tools"] = [
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
            for t in tools
        ]
    answer = httpx.post(
        f"{live.base_url}/tokenize", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert answer.status_code == 200, answer.text
    return int(answer.json()["count"])


def test_a_function_tool_round_trip(live: LiveServer) -> None:
    client = live.client()
    first = client.responses.create(
        model=MODEL_NAME,
        input=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        parallel_tool_calls=False,
        max_output_tokens=60,
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    second = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=first.id,
        input=[result],
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_output_tokens=8,
    )
    assert second.previous_response_id == first.id
    assert second.output[-1].type == "message"
    # The model read the question, its call and the call's result.
    history = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'},
    ]
    assert second.usage.input_tokens == prompt_tokens(live, history)
    # The same conversation sent whole, without the kept response, is the same prompt.
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result]
    again = client.responses.create(
        model=MODEL_NAME,
        input=items,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_output_tokens=8,
        store=False,
    )
    assert again.usage.input_tokens == second.usage.input_tokens
    assert again.output_text == second.output_text


def test_a_streamed_call_gives_the_typed_events(live: LiveServer) -> None:
    events = list(
        live.client().responses.create(
            model=MODEL_NAME,
            input=ASK,
            tools=TOOLS,
            tool_choice="required",
            temperature=0,
            parallel_tool_calls=False,
            max_output_tokens=60,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    final = events[-1].response
    (call,) = final.output
    assert call.arguments == arguments == events[-3].arguments
    assert call.id == events[2].item.id and call.call_id == events[2].item.call_id
    jsonschema.validate(json.loads(arguments), WEATHER)
    kept = live.client().responses.retrieve(final.id)
    assert kept.model_dump() == final.model_dump()


def test_streamed_text_adds_up_to_the_kept_response(live: LiveServer) -> None:
    client = live.client()
    events = list(
        client.responses.create(
            model=MODEL_NAME, input="Hello", temperature=0, max_output_tokens=12, stream=True
        )
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == text
    whole = client.responses.create(
        model=MODEL_NAME, input="Hello", temperature=0, max_output_tokens=12
    )
    assert whole.output_text == text
    assert whole.usage.output_tokens == 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12


def test_a_json_schema_text_format_holds_the_answer(live: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green"]}, "count": {"type": "integer"}},
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    response = live.client().responses.create(
        model=MODEL_NAME,
        input="A colour and a number, as JSON.",
        temperature=0,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "c", "schema": schema}},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"
    free = live.client().responses.create(
        model=MODEL_NAME,
        input="A colour and a number, as JSON.",
        temperature=0,
        max_output_tokens=40,
    )
    with pytest.raises(ValueError):
        json.loads(free.output_text)  # the format's doing, not the model's


def test_kept_responses_are_read_and_deleted(live: LiveServer) -> None:
    client = live.client()
    made = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(made.id).output_text == made.output_text
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)
    unkept = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(
            model=MODEL_NAME, input="Go on", previous_response_id=unkept.id, max_output_tokens=4
        )
    assert refused.value.body["param"] == "previous_response_id"


def test_input_items_list_the_conversation_a_response_answered(live: LiveServer) -> None:
    client = live.client()
    first = client.responses.create(
        model=MODEL_NAME, input="Hi", instructions="Be brief", max_output_tokens=4
    )
    second = client.responses.create(
        model=MODEL_NAME,
        input=[{"role": "user", "content": "Again"}],
        previous_response_id=first.id,
        max_output_tokens=4,
    )
    newest_first = list(client.responses.input_items.list(second.id))
    # "Hi", the first answer's output, then "Again"; newest first by default.
    assert newest_first[0].type == "message" and newest_first[0].role == "user"
    assert newest_first[-1].role == "user" and newest_first[-1].content[0].text == "Hi"
    assert len(newest_first) == 2 + len(first.output)
    ids = [item.id for item in newest_first]
    assert len(set(ids)) == len(ids) and all(ids)
    assert [item.id for item in client.responses.input_items.list(first.id)] == [ids[-1]]
    page = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert [item.id for item in page.data] == [ids[-1]] and page.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=ids[-1], limit=100)
    assert [item.id for item in rest.data] == ids[-2::-1] and not rest.has_more
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.input_items.list(second.id, limit=101)
    assert refused.value.body["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_none")


def test_previous_response_id_survives_a_restart(model: Path, tmp_path: Path) -> None:
    first_server = start_live_server(model, max_sessions=2, data_dir=tmp_path)
    try:
        first = first_server.client().responses.create(
            model=MODEL_NAME,
            input="Name a colour.",
            instructions="Be brief.",
            temperature=0,
            max_output_tokens=6,
        )
    finally:
        first_server.stop()
    assert (tmp_path / "cellbatch.sqlite3").is_file()
    second_server = start_live_server(model, max_sessions=2, data_dir=tmp_path)
    try:
        client = second_server.client()
        assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
        second = client.responses.create(
            model=MODEL_NAME,
            input="Another.",
            previous_response_id=first.id,
            temperature=0,
            max_output_tokens=4,
        )
        # The first turn's input and answer, not its instructions (OpenAI's rule).
        history = [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Another."},
        ]
        assert second.usage.input_tokens == prompt_tokens(second_server, history)
    finally:
        second_server.stop()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": "Hi", "background": True}, "background"),
        ({"input": "Hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "Hi", "max_output_tokens": 5000}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
        (
            {
                "input": "Hi",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}},
            },
            "text.format",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_field(live: LiveServer, body, param: str) -> None:
    answer = httpx.post(
        f"{live.base_url}/v1/responses",
        json={"model": MODEL_NAME, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"].startswith(param), error
