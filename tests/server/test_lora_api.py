"""LoRA adapters over HTTP, through the official `openai` client: listed beside the model,
picked by `model`, loaded and unloaded while 16 clients stream."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import torch

from cellbatch.generation_config import GenConfig
from lora_adapters import make_adapter
from served import API_KEY, MODEL_NAME, LiveServer

MAX_TOKENS = 12
MESSAGES = [
    [{"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Write a short poem about the sea and its ships."}],
    [{"role": "user", "content": "Hi"}],
]


@pytest.fixture(scope="module")
def adapters(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Five adapters of the served tiny model, strong enough to change its answers."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_chat_model), dtype=torch.float32
    )
    root = tmp_path_factory.mktemp("served-adapters")
    return {
        name: make_adapter(base, root / name, rank=4 + 4 * i, seed=i, std=0.3)
        for i, name in enumerate(("sql", "poet", "terse", "hot-a", "hot-b"))
    }


@pytest.fixture(scope="module")
def server(start_server, adapters: dict[str, Path]) -> LiveServer:
    stable = {name: str(adapters[name]) for name in ("sql", "poet", "terse")}
    # 5 adapters, plus room for each of the hot test's 4 unloads to drain while its
    # adapter loads again (draining adapters count against max_loras).
    return start_server(lora_adapters=stable, prefix_cache_entries=8, max_loras=5 + 4)


def post(server: LiveServer, path: str, body: dict, key: str | None = API_KEY):
    """(status, body text) of a POST with a JSON body."""
    request = urllib.request.Request(
        server.base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}
        | ({"Authorization": f"Bearer {key}"} if key else {}),
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def answer(
    server: LiveServer,
    model: str,
    messages: list,
    stream: bool = False,
    started: Callable[[], None] = lambda: None,
) -> str:
    """The greedy answer's text; streamed, `started()` runs at the first chunk (the
    server has started the generation: it holds its adapter)."""
    client = server.client()
    options = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        return client.chat.completions.create(**options).choices[0].message.content or ""
    text = []
    for number, chunk in enumerate(client.chat.completions.create(**options, stream=True)):
        if number == 0:
            started()
        text += [chunk.choices[0].delta.content or ""] if chunk.choices else []
    return "".join(text)


def test_models_lists_each_adapter_with_its_parent(server, adapters) -> None:
    cards = {card.id: card for card in server.client().models.list().data}
    assert list(cards)[:1] == [MODEL_NAME]
    for name in ("sql", "poet", "terse"):
        card = cards[name].model_dump()
        assert card["parent"] == MODEL_NAME and card["root"] == str(adapters[name])
        assert card["max_model_len"] == cards[MODEL_NAME].max_model_len


def test_model_picks_the_adapter_and_answers_as_the_engine_does(server) -> None:
    texts = {model: answer(server, model, MESSAGES[1]) for model in (MODEL_NAME, "sql", "poet")}
    assert len(set(texts.values())) == 3  # each adapter says something of its own
    tokens = server.engine.chat_tokens(MESSAGES[1])
    for model in ("sql", "poet"):
        (result,) = server.engine.generate(
            [tokens], GenConfig(max_new_tokens=MAX_TOKENS, adapter=model)
        )
        assert result.text == texts[model]
    with pytest.raises(openai.NotFoundError) as refused:
        answer(server, "nope", MESSAGES[0])
    assert refused.value.code == "model_not_found"
    assert all(f"'{name}'" in refused.value.message for name in (MODEL_NAME, "sql", "poet"))


def test_loading_and_unloading_follow_vllms_api(server, adapters, tmp_path) -> None:
    status, text = post(
        server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/"}, key=None
    )
    assert status == 401
    status, text = post(
        server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}
    )
    assert (
        status == 400 and "adapter_config.json is missing" in json.loads(text)["error"]["message"]
    )
    status, text = post(
        server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["sql"])}
    )
    assert status == 400 and "already loaded" in text
    body = {"lora_name": "hot-a", "lora_path": str(adapters["hot-a"])}
    assert post(server, "/v1/load_lora_adapter", body) == (
        200,
        "Success: LoRA adapter 'hot-a' added successfully.",
    )
    assert "hot-a" in [card.id for card in server.client().models.list().data]
    assert answer(server, "hot-a", MESSAGES[0])
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "hot-a"}) == (
        200,
        "Success: LoRA adapter 'hot-a' removed successfully.",
    )
    status, text = post(server, "/v1/unload_lora_adapter", {"lora_name": "hot-a"})
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
    assert "hot-a" not in [card.id for card in server.client().models.list().data]


def test_metrics_count_generations_and_tokens_per_adapter(server) -> None:
    answer(server, "terse", MESSAGES[2])
    with urllib.request.urlopen(
        urllib.request.Request(
            server.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
        )
    ) as response:
        text = response.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (sample.name, sample.labels.get("adapter")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("cellbatch_lora_adapters_loaded", None)] >= 3
    assert samples[("cellbatch_lora_generations_total", "terse")] >= 1
    assert samples[("cellbatch_lora_generation_tokens_total", "terse")] >= 1


def test_hot_loading_and_unloading_under_16_streaming_clients(server, adapters) -> None:
    """16 clients stream chats for the base and the adapters while adapters are loaded
    and unloaded: no request fails, and each answer is the one its model gives alone
    (an unloaded adapter's streams in flight finish with it)."""
    hot = ["hot-a", "hot-b"]
    expected: dict[tuple[str, int], str] = {}
    for name in hot:
        body = {"lora_name": name, "lora_path": str(adapters[name])}
        assert post(server, "/v1/load_lora_adapter", body)[0] == 200
    models = [MODEL_NAME, "sql", "poet", "terse", *hot]
    for model in models:
        for index, messages in enumerate(MESSAGES):
            expected[(model, index)] = answer(server, model, messages)
    live = set(models)  # models a client may pick now
    starting = dict.fromkeys(models, 0)  # requests sent whose generation has not started
    lock = threading.Condition()
    failures: list[str] = []
    done = threading.Event()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not done.is_set():
            with lock:
                model = rng.choice(sorted(live))
                starting[model] += 1
            index = rng.randrange(len(MESSAGES))
            pending = [True]

            def started(model: str = model, pending: list[bool] = pending) -> None:
                with lock:
                    starting[model] -= pending.pop()
                    lock.notify_all()

            try:
                text = answer(server, model, MESSAGES[index], stream=True, started=started)
            except Exception as error:  # every failure is the test's finding
                failures.append(f"{model}: {error!r}")
                continue
            finally:
                if pending:
                    started()
            if text != expected[(model, index)]:
                failures.append(f"{model} prompt {index}: {text!r} != {expected[(model, index)]!r}")

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(16)]
    for thread in threads:
        thread.start()
    try:
        for round_ in range(4):
            time.sleep(0.5)
            name = hot[round_ % 2]
            with lock:
                live.discard(name)  # no new request names it; streams in flight go on
                assert lock.wait_for(lambda name=name: starting[name] == 0, 60)
            assert post(server, "/v1/unload_lora_adapter", {"lora_name": name})[0] == 200
            time.sleep(0.3)
            body = {"lora_name": name, "lora_path": str(adapters[name])}
            status, text = post(server, "/v1/load_lora_adapter", body)
            assert status == 200, text
            with lock:
                live.add(name)
    finally:
        done.set()
        for thread in threads:
            thread.join(120)
    assert failures == []
    usage = server.engine.adapter_usage()
    assert all(usage[name].generations > 0 for name in models[1:])
