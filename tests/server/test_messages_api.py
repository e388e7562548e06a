"""Anthropic's Messages API through the official `anthropic` client: a conversation
with `tool_use` and `tool_result`, streamed and not; stop sequences; count_tokens; the
key in `x-api-key`; errors in Anthropic's shape. The served model is tiny and random: a
call that parses and fits its schema is the grammar's doing."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
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
TOOLS = [{"name": "get_weather", "description": "Forecast", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # this SDK no longer names temperature


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = make_tiny_chat_checkpoint(tmp_path_factory.mktemp("messages") / "llama", CONTEXT)
    server = start_live_server(model, max_sessions=4)
    yield server
    server.stop()


def prompt_tokens(live: LiveServer, messages: list[dict[str, object]]) -> int:
    answer = httpx.post(
        f"{live.base_url}/tokenize",
        json={"model": MODEL_NAME, "messages": messages},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    return int(answer.json()["count"])


def test_a_tool_use_and_its_result(live: LiveServer) -> None:
    client = live.anthropic()
    called = client.messages.create(
        model=MODEL_NAME,
        max_tokens=60,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        **GREEDY,
    )
    assert called.stop_reason == "tool_use"
    (use,) = [block for block in called.content if block.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    conversation = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump() for block in called.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": '{"temp": 21}'},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    answered = client.messages.create(
        model=MODEL_NAME,
        max_tokens=6,
        messages=conversation,
        tools=TOOLS,
        tool_choice={"type": "none"},
        **GREEDY,
    )
    assert [block.type for block in answered.content] == ["text"]
    assert answered.stop_reason in ("max_tokens", "end_turn")
    # The model read the question, its call, the result and the new question.
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": json.dumps(use.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": '{"temp": 21}'},
        {"role": "user", "content": "And tomorrow?"},
    ]
    usage = answered.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt_tokens(live, history)
    counted = client.messages.count_tokens(
        model=MODEL_NAME, messages=conversation, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert counted.input_tokens == prompt_tokens(live, history)


def test_a_streamed_tool_use_equals_its_events(live: LiveServer) -> None:
    client = live.anthropic()
    with client.messages.stream(
        model=MODEL_NAME,
        max_tokens=60,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        **GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    pieces = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    (use,) = final.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert json.loads("".join(pieces)) == use.input
    jsonschema.validate(use.input, WEATHER)
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens > 0


def test_streamed_text_equals_the_whole_message(live: LiveServer) -> None:
    client = live.anthropic()
    whole = client.messages.create(
        model=MODEL_NAME,
        max_tokens=12,
        messages=[{"role": "user", "content": "Hello"}],
        system="Be brief.",
        **GREEDY,
    )
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    with client.messages.stream(
        model=MODEL_NAME,
        max_tokens=12,
        messages=[{"role": "user", "content": "Hello"}],
        system="Be brief.",
        **GREEDY,
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12


def test_a_stop_sequence_is_named(live: LiveServer) -> None:
    client = live.anthropic()
    free = client.messages.create(
        model=MODEL_NAME, max_tokens=24, messages=[{"role": "user", "content": "Hello"}], **GREEDY
    )
    text = free.content[0].text
    stop = text[6:9]
    assert stop.strip(), text
    stopped = client.messages.create(
        model=MODEL_NAME,
        max_tokens=24,
        messages=[{"role": "user", "content": "Hello"}],
        stop_sequences=["@@never@@", stop],
        **GREEDY,
    )
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]


def test_count_tokens_counts_the_prompt(live: LiveServer) -> None:
    counted = live.anthropic().messages.count_tokens(
        model=MODEL_NAME, system="Be brief.", messages=[{"role": "user", "content": "Hello"}]
    )
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert counted.input_tokens == prompt_tokens(live, expected)


def test_the_key_may_come_as_x_api_key_and_errors_are_anthropics(live: LiveServer) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    url = f"{live.base_url}/v1/messages"
    assert httpx.post(url, json=body, headers={"x-api-key": API_KEY}).status_code == 200
    refused = httpx.post(url, json=body, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        live.anthropic(api_key="wrong").messages.create(**body)
    with pytest.raises(anthropic.BadRequestError) as bad:
        live.anthropic().messages.create(**{**body, "max_tokens": 0})
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        live.anthropic().messages.create(**{**body, "model": "claude-nonesuch"})
    assert missing.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError):
        live.anthropic().messages.create(
            **{**body, "messages": [{"role": "user", "content": [image]}]}
        )
    with pytest.raises(anthropic.BadRequestError) as unsupported:
        live.anthropic().messages.create(**body, extra_body={"container": "ctr_1"})
    assert "container" in unsupported.value.body["error"]["message"]
    # The other routes keep OpenAI's shape.
    openai_refusal = httpx.post(f"{live.base_url}/v1/chat/completions", json={}, headers={})
    assert set(openai_refusal.json()) == {"error"}


def test_output_config_format_holds_the_answer_to_a_schema(live: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    message = live.anthropic().messages.create(
        model=MODEL_NAME,
        max_tokens=20,
        messages=[{"role": "user", "content": "Fine?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **GREEDY,
    )
    jsonschema.validate(json.loads(message.content[0].text), schema)
