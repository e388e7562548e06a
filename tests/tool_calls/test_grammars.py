"""The tool call grammars, run by llguidance over the default model's tokenizer: what
each lets through and what it stops."""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
import pytest

from cellbatch.model.default import default_model_path
from cellbatch.model.tokenizer import Tokenizer, load_tokenizer
from cellbatch.tool_calls.calls import Tool
from cellbatch.tool_calls.formats import HermesFormat, Llama3JsonFormat, MistralFormat, ToolFormat

WEATHER = Tool(
    "get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
BAD_CALL = '{"name": "get_weather", "arguments": {"town": "Paris"}}'


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def vocabulary(tokenizer: Tokenizer) -> Any:
    return llguidance.hf.from_tokenizer(
        tokenizer.backend, n_vocab=tokenizer.vocab_size, eos_token=2
    )


def accepts(vocabulary: Any, tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar lets the model write exactly `text` and then end."""
    matcher = llguidance.LLMatcher(vocabulary, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(token) for token in tokens) and matcher.is_accepting()


def call_in(form: ToolFormat, arguments: str) -> str:
    if isinstance(form, Llama3JsonFormat):
        return arguments.replace('"arguments"', '"parameters"')
    if isinstance(form, MistralFormat):
        return f"[{arguments}]"  # the marker is text here: this vocabulary lacks it
    return f"<tool_call>\n{arguments}\n</tool_call>"


@pytest.mark.parametrize("form", [HermesFormat(), Llama3JsonFormat(), MistralFormat()])
def test_required_takes_calls_that_fit_and_nothing_else(form, vocabulary, tokenizer) -> None:
    grammar = form.grammar([WEATHER], parallel=True, special_ids={})
    marker = "[TOOL_CALLS]" if isinstance(form, MistralFormat) else ""
    assert accepts(vocabulary, tokenizer, grammar, marker + call_in(form, CALL))
    assert not accepts(vocabulary, tokenizer, grammar, marker + call_in(form, BAD_CALL))
    assert not accepts(vocabulary, tokenizer, grammar, "It is sunny.")


@pytest.mark.parametrize("form", [HermesFormat(), Llama3JsonFormat(), MistralFormat()])
def test_auto_takes_text_or_calls_that_fit(form, vocabulary, tokenizer) -> None:
    grammar = form.grammar([WEATHER], parallel=True, special_ids={}, free_text=True)
    marker = "[TOOL_CALLS]" if isinstance(form, MistralFormat) else ""
    assert accepts(vocabulary, tokenizer, grammar, "It is sunny, {maybe} [or not] <b>.")
    assert accepts(vocabulary, tokenizer, grammar, marker + call_in(form, CALL))
    assert not accepts(vocabulary, tokenizer, grammar, marker + call_in(form, BAD_CALL))


def test_hermes_auto_takes_text_before_the_calls(vocabulary, tokenizer) -> None:
    grammar = HermesFormat().grammar([WEATHER], parallel=False, special_ids={}, free_text=True)
    assert accepts(
        vocabulary, tokenizer, grammar, f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>"
    )
    assert not accepts(
        vocabulary, tokenizer, grammar, f"Sure.<tool_call>\n{BAD_CALL}\n</tool_call>"
    )
    two = f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>"
    assert not accepts(vocabulary, tokenizer, grammar, two)  # parallel off: one call
