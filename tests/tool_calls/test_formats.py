"""Reading tool calls out of answers in each format, whole and as they grow, and the
grammars that hold a model to them."""

from __future__ import annotations

import json

import pytest

from cellbatch.tool_calls.calls import PartialCall, Tool, scan_calls
from cellbatch.tool_calls.formats import (
    FORMATS,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    format_for_template,
    format_named,
)
from cellbatch.types import InvalidArgumentError

WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = Tool("get_time", parameters={"type": "object", "properties": {}})

HERMES_ANSWER = (
    "Let me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_scan_reads_calls_alone_listed_and_separated() -> None:
    alone = scan_calls('{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}')
    assert alone.calls == [PartialCall("f", '{"a": [1, {"b": "}"}]}', done=True)]
    listed = scan_calls('[{"name": "f", "arguments": {}}, {"name": "g", "parameters": {"x": 1}}]')
    assert [(c.name, c.arguments) for c in listed.calls] == [("f", "{}"), ("g", '{"x": 1}')]
    assert not listed.malformed and listed.end is not None
    separated = scan_calls('{"name": "f", "arguments": {}}; {"name": "g", "arguments": {}}', 0, ";")
    assert [c.name for c in separated.calls] == ["f", "g"]


def test_scan_of_a_growing_text_only_adds() -> None:
    text = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris"}, "extra": 1}'
    seen: list[PartialCall] = []
    for end in range(len(text) + 1):
        calls = scan_calls(text[:end]).calls
        assert len(calls) >= len(seen)
        for before, now in zip(seen, calls, strict=False):
            assert before.name == now.name
            assert now.arguments.startswith(before.arguments)
            assert now.done or not before.done
        seen = calls
    assert seen == [PartialCall("get_weather", '{"city": "Pa\\"ris"}', done=True)]


def test_scan_flags_what_cannot_be_a_call() -> None:
    assert scan_calls('{"title": "x"}').malformed
    assert scan_calls('{"name": 3}').malformed
    assert scan_calls('{"name": "f", "arguments": "text"}').malformed
    assert not scan_calls('{"na').malformed  # may still become one


def test_hermes_splits_content_and_calls() -> None:
    parsed = FORMATS["hermes"].parse(HERMES_ANSWER, final=True)
    assert parsed.content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]


def test_hermes_holds_back_what_may_become_markup() -> None:
    form = HermesFormat()
    assert form.parse("Hello <tool", final=False).content == "Hello "
    assert form.parse("Hello <tool", final=True).content == "Hello <tool"
    assert form.parse("a < b", final=False).content == "a < b"
    growing = form.parse('ok<tool_call>\n{"name": "get_weather", "arguments": {"ci', final=False)
    assert growing.content == "ok"
    assert growing.calls == (PartialCall("get_weather", '{"ci'),)


def test_hermes_keeps_a_broken_block_as_content() -> None:
    broken = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city"\n</tool_call> bye'
    parsed = HermesFormat().parse(broken, final=True)
    assert parsed.calls == ()
    assert parsed.content == broken
    # Keys in another order, or a list of calls in a block: still calls.
    loose = '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>'
    (call,) = HermesFormat().parse(loose, final=True).calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Rome"}


def test_every_growing_prefix_never_takes_back_content() -> None:
    for form, answer in [
        (HermesFormat(), HERMES_ANSWER + "\nDone."),
        (Llama3JsonFormat(), '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
        (MistralFormat(), '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
        (MistralFormat(), "Plain words, no calls [at all]."),
    ]:
        content = ""
        for end in range(len(answer) + 1):
            now = form.parse(answer[:end], final=False).content
            assert now.startswith(content), (form.name, answer[:end])
            content = now
        assert form.parse(answer, final=True).content.startswith(content)


def test_llama3_and_mistral_read_whole_answers() -> None:
    llama = Llama3JsonFormat().parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}',
        final=True,
    )
    assert [c.name for c in llama.calls] == ["get_weather", "get_time"] and llama.content == ""
    assert Llama3JsonFormat().parse("It is sunny.", final=True).calls == ()
    # The marker is a special token that decoded text drops: a bare list reads the same.
    for text in [
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
        ' [{"name": "get_time", "arguments": {}}]',
    ]:
        (call,) = MistralFormat().parse(text, final=True).calls
        assert call.name == "get_time"
    assert MistralFormat().parse("[1] is a footnote", final=True).content == "[1] is a footnote"


def test_grammars_name_each_tool_and_markers_by_token_id() -> None:
    hermes = HermesFormat().grammar([WEATHER, TIME], parallel=True, special_ids={})
    assert '"<tool_call>\\n" call_json' in hermes and '("\\n" call)*' in hermes
    schema = json.loads(hermes.split("%json ", 1)[1])
    assert [option["properties"]["name"]["const"] for option in schema["anyOf"]] == [
        "get_weather",
        "get_time",
    ]
    single = HermesFormat().grammar([WEATHER], parallel=False, special_ids={})
    assert "call)*" not in single
    mistral = MistralFormat().grammar([WEATHER], parallel=False, special_ids={"[TOOL_CALLS]": 5})
    assert 'calls: <[5]> "["' in mistral
    llama = json.loads(Llama3JsonFormat().grammar([WEATHER], False, {}).split("%json ", 1)[1])
    assert llama["required"] == ["name", "parameters"]


def test_definitions_move_to_the_root_and_clashes_are_refused() -> None:
    nested = Tool(
        "book",
        parameters={
            "type": "object",
            "properties": {"who": {"$ref": "#/$defs/Person"}},
            "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}}}},
        },
    )
    schema = json.loads(HermesFormat().grammar([nested], False, {}).split("%json ", 1)[1])
    assert "Person" in schema["$defs"] and "$defs" not in schema["properties"]["arguments"]
    clash = Tool("other", parameters={"type": "object", "$defs": {"Person": {"type": "string"}}})
    with pytest.raises(InvalidArgumentError, match="Person"):
        HermesFormat().grammar([nested, clash], False, {})


def test_the_format_follows_the_template_or_the_flag() -> None:
    assert format_for_template("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert format_for_template("<|start_header_id|>{% if tools %}").name == "llama3_json"
    assert format_for_template("<|im_start|>{{ message.content }}").name == "hermes"
    assert format_for_template(None).name == "hermes"
    assert format_named("mistral").name == "mistral"
    with pytest.raises(InvalidArgumentError, match="hermes"):
        format_named("bogus")


def test_a_call_cut_short_stays_a_call_and_its_markup_stays_out() -> None:
    whole = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
    cut = whole + '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    parsed = HermesFormat().parse(cut, final=True)
    assert parsed.content == ""
    assert [(c.name, c.arguments, c.done) for c in parsed.calls] == [
        ("get_time", "{}", True),
        ("get_weather", '{"ci', False),
    ]
    llama = Llama3JsonFormat().parse('{"name": "get_time", "parameters": {"zo', final=True)
    assert llama.content == "" and llama.calls == (PartialCall("get_time", '{"zo'),)
