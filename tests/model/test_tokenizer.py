"""The Tokenizer wrapper on a tiny word-level tokenizer saved beside a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cellbatch.model.tokenizer import load_tokenizer

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant", "hello", "there", "how", "are", "you"]
VOCAB = {token: i for i, token in enumerate(SPECIALS + WORDS)}
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def save_tokenizer(folder: Path, chat_template: str | None = TEMPLATE) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)


@pytest.fixture
def model_folder(tiny_checkpoint) -> Path:
    _, folder = tiny_checkpoint("llama")
    save_tokenizer(folder)
    # generation_config.json adds an EOS id the tokenizer does not call EOS.
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, VOCAB["you"]]}))
    return folder


def test_encode_decode_and_chat_template(model_folder: Path) -> None:
    tokenizer = load_tokenizer(model_folder)
    assert tokenizer.vocab_size == len(VOCAB)
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    assert ids == [VOCAB["hello"], VOCAB["there"]]
    assert tokenizer.decode(ids) == "hello there"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "how are you"}])
    expected = [
        "<|im_start|>",
        "user",
        "how",
        "are",
        "you",
        "<|im_end|>",
        "<|im_start|>",
        "assistant",
    ]
    assert chat == [VOCAB[t] for t in expected]


def test_stop_tokens_gather_eos_generation_config_and_end_of_turn(model_folder: Path) -> None:
    tokenizer = load_tokenizer(model_folder)
    # <|im_end|> (EOS and end of turn), "you" (generation config), <|endoftext|> (in vocab);
    # the config's own eos_token_id 2 is <|im_start|> in this toy vocabulary.
    expected = {VOCAB["<|im_end|>"], VOCAB["you"], VOCAB["<|endoftext|>"], 2}
    assert tokenizer.stop_tokens == expected


def test_loaded_once_per_file(model_folder: Path) -> None:
    assert load_tokenizer(model_folder) is load_tokenizer(str(model_folder))


def test_no_chat_template_is_a_clear_error(tiny_checkpoint) -> None:
    _, folder = tiny_checkpoint("qwen2")
    save_tokenizer(folder, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "hello"}])


def test_folder_without_tokenizer_files(tiny_checkpoint) -> None:
    _, folder = tiny_checkpoint("qwen3")
    with pytest.raises(FileNotFoundError, match="no usable tokenizer"):
        load_tokenizer(folder)


# A Hermes/Qwen-style template: the tools go into the system turn when given.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system {% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}<|im_end|>{% endif %}" + TEMPLATE
)


def test_a_template_with_a_place_for_tools_takes_them(tiny_checkpoint) -> None:
    """`takes_tools` tells a template that renders tools from one that ignores them, and
    the tools reach the prompt; the call format follows the template's markup."""
    from cellbatch.tool_calls.formats import format_for_template

    _, folder = tiny_checkpoint("llama")
    save_tokenizer(folder, TOOLS_TEMPLATE)
    tokenizer = load_tokenizer(folder)
    assert tokenizer.takes_tools
    tool = {"type": "function", "function": {"name": "hello", "parameters": {"type": "object"}}}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "you"}], tools=[tool])
    # "system" is not in the word-level vocabulary: <unk>.
    opening = ["<|im_start|>", "<unk>", "hello", "<|im_end|>"]
    assert chat[:4] == [VOCAB[token] for token in opening]
    assert format_for_template(tokenizer.chat_template_text).name == "hermes"
    assert format_for_template("<|start_header_id|>{{ tools }}").name == "llama3_json"
    assert format_for_template("[TOOL_CALLS] {{ tools }}").name == "mistral"


def test_a_template_without_a_place_for_tools_does_not_take_them(model_folder: Path) -> None:
    assert not load_tokenizer(model_folder).takes_tools
