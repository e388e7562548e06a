"""Fixtures shared by the test folders: the weights cache in a temporary folder, torch's
thread count put back after every test (and one thread for the modules that ask), and a
tiny random chat model the benchmarks (the packaged throughput benchmark,
cellbatch.bench, and the scripts of benchmarks/) run on, the default model's transformers
reference, and Runners over fake executors."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cellbatch.bench.workload import CHAT_PROMPTS
from fake_executor import FakeRunners


@pytest.fixture(scope="session", autouse=True)
def weights_cache_in_a_temporary_folder(tmp_path_factory: pytest.TempPathFactory):
    """Engines write converted weights to a cache folder by default: the tests' (and the
    processes they start) go to one of the session's own, never the user's."""
    os.environ["CELLBATCH_CACHE_DIR"] = str(tmp_path_factory.mktemp("weights-cache"))
    yield


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """An engine sets torch's thread count for the whole process (`threads=`): put it back
    after each test, so that no test runs on a count an earlier one happened to leave."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny-model tests (`pytestmark =
        pytest.mark.usefixtures("one_thread")`): tiny products, where a second intra-op thread
    only adds contention on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_bench_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with a word-level tokenizer and a ChatML template."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    words = sorted({w for text in CHAT_PROMPTS for w in text.split()} | {"user", "assistant"})
    vocab = {token: index for index, token in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(specials)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
        "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
    folder = tmp_path_factory.mktemp("tiny-chat")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def default_reference():  # -> transformers.PreTrainedModel
    """transformers' fp32 model of the embedded default model's GGUF file: the reference
    the default-model tests compare against, loaded once (reading and dequantising the
    file takes seconds). Tests only read it: PEFT's models of it (lora_adapters.py's
    make_adapter and peft_model) wrap copies."""
    from cellbatch.model.default import default_model_path
    from tiny_models import reference_model

    path = default_model_path()
    return reference_model(path.parent, gguf_file=path.name)


@pytest.fixture
def runners() -> Iterator[FakeRunners]:
    """Runners over fake executors, shut down and checked after the test (FakeRunners)."""
    made = FakeRunners()
    yield made
    made.close()
