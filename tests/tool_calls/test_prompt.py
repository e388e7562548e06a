"""Tools and tool messages reach a chat template: as they are when it has a place for
them, written out in the format's words when it has none."""

from __future__ import annotations

import json

from cellbatch.tool_calls.calls import Tool
from cellbatch.tool_calls.formats import HermesFormat
from cellbatch.tool_calls.prompt import conversation

WEATHER = Tool("get_weather", "The weather", {"type": "object", "properties": {}})
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
]


def test_a_template_with_tools_gets_them_and_object_arguments() -> None:
    messages, tools = conversation(HISTORY, [WEATHER], HermesFormat(), template_takes_tools=True)
    assert tools == [WEATHER.spec()]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[3] == HISTORY[3]
    assert conversation(HISTORY, [], HermesFormat(), True)[1] is None


def test_a_template_without_tools_gets_them_written_out() -> None:
    messages, tools = conversation(HISTORY, [WEATHER], HermesFormat(), template_takes_tools=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n")
    assert json.dumps(WEATHER.spec()) in messages[0]["content"]
    assert messages[2]["content"].count("<tool_call>") == 2
    assert '"arguments": {"city": "Rome"}' in messages[2]["content"]
    assert messages[3]["content"] == (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    )


def test_without_a_system_message_the_offer_opens_the_conversation() -> None:
    messages, _ = conversation(
        [{"role": "user", "content": "hi"}], [WEATHER], HermesFormat(), False
    )
    assert messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    untouched, _ = conversation([{"role": "user", "content": "hi"}], [], HermesFormat(), False)
    assert untouched == [{"role": "user", "content": "hi"}]
