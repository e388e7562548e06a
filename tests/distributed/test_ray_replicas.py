"""Two engine replicas on a local Ray instance (127.0.0.1, 2 CPUs), behind the OpenAI
server and behind offline `generate`: the same tokens as one engine, prefix affinity,
whole concurrent streams, health and metrics per replica, and a replica killed under
load. One Ray instance and one pair of replicas serve the whole module; the kill comes
last."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cellbatch.distributed import ReplicaSet
from cellbatch.distributed.backend import ReplicaBackend
from cellbatch.engine import Engine
from cellbatch.generation_config import GenConfig, SamplingParams
from served import API_KEY, MODEL_NAME, serve_in_thread

ENGINE = {"dtype": "float32", "kernels": "torch", "max_sessions": 16}
TIME_LIMIT_S = 90.0
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def replicas(tiny_chat_model: Path) -> Iterator[ReplicaSet]:
    started = ReplicaSet.start(
        str(tiny_chat_model), replicas=2, threads_per_replica=1, prefix_cache_entries=8, **ENGINE
    )
    yield started
    started.close()


@pytest.fixture(scope="module")
def engine(tiny_chat_model: Path) -> Iterator[Engine]:
    """One engine in this process: the results the replicas must match."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with Engine.from_pretrained(tiny_chat_model, **ENGINE) as made:
        yield made
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(replicas: ReplicaSet) -> Iterator[str]:
    base_url, live, thread = serve_in_thread(ReplicaBackend(replicas))
    yield base_url
    live.should_exit = True
    thread.join(TIME_LIMIT_S)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIME_LIMIT_S
    )


def prompts(count: int) -> list[str]:
    return [f"Item {i}: the {i * 3} boats of the harbour" for i in range(count)]


def expected_texts(engine: Engine, texts: list[str], new_tokens: int = NEW_TOKENS) -> list[str]:
    return [result.text for result in engine.generate(texts, max_new_tokens=new_tokens)]


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def per_replica(figures: dict[tuple[str, tuple], float], name: str, **labels: str) -> list[float]:
    return [
        figures.get((name, tuple(sorted({"replica": str(r), **labels}.items()))), 0.0)
        for r in range(2)
    ]


def gained(
    after: dict[tuple[str, tuple], float],
    before: dict[tuple[str, tuple], float],
    name: str,
    **labels: str,
) -> list[float]:
    """Each replica's growth of a figure between two scrapes."""
    return [
        a - b
        for a, b in zip(
            per_replica(after, name, **labels), per_replica(before, name, **labels), strict=True
        )
    ]


def stream_all(
    base_url: str,
    texts: list[str],
    new_tokens: int = NEW_TOKENS,
    streaming: list[int] | None = None,
) -> dict[int, tuple[str, str]]:
    """Stream every prompt at once: index -> (text, finish reason or the error). Each
    stream's index goes into `streaming` with its first chunk of text."""
    answers: dict[int, tuple[str, str]] = {}
    openai_client = client(base_url)

    def stream(index: int) -> None:
        pieces, finish = [], "no finish"
        try:
            for chunk in openai_client.completions.create(
                model=MODEL_NAME,
                prompt=texts[index],
                max_tokens=new_tokens,
                temperature=0,
                stream=True,
            ):
                if streaming is not None and not pieces and chunk.choices[0].text:
                    streaming.append(index)
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
        except openai.APIError as error:
            finish = f"error: {error.message}"
        answers[index] = ("".join(pieces), finish)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIME_LIMIT_S)
        assert not thread.is_alive(), "a stream hung"
    return answers


def test_greedy_answers_through_two_replicas_equal_one_engines(server, engine) -> None:
    texts = prompts(6)
    openai_client = client(server)
    answers: dict[int, str] = {}

    def ask(index: int) -> None:
        answer = openai_client.completions.create(
            model=MODEL_NAME, prompt=texts[index], max_tokens=NEW_TOKENS, temperature=0
        )
        answers[index] = answer.choices[0].text

    before = scrape(server)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIME_LIMIT_S)
    assert [answers[i] for i in range(len(texts))] == expected_texts(engine, texts)
    chat = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=NEW_TOKENS,
        temperature=0,
    )  # fmt: skip
    assert chat.choices[0].message.content == engine.chat(["hi"], max_new_tokens=NEW_TOKENS)[0].text
    after = scrape(server)
    served = gained(after, before, "cellbatch_replica_generation_tokens_total")
    assert all(tokens > 0 for tokens in served), served  # both replicas served some


def test_prompts_sharing_a_prefix_land_on_one_replica(server) -> None:
    shared = "A long preamble about the sea, the ships, the ports and the fish. " * 4
    openai_client = client(server)
    before = scrape(server)
    cached = []
    for i in range(4):
        answer = openai_client.completions.create(
            model=MODEL_NAME, prompt=f"{shared}Question {i}?", max_tokens=2, temperature=0
        )
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
    after = scrape(server)
    by_prefix = gained(after, before, "cellbatch_replica_routed_requests_total", reason="prefix")
    assert sorted(by_prefix) == [0, 3]  # the first found a replica, the others followed it
    hits = gained(after, before, "cellbatch_replica_prefix_cache_hits_total")
    assert hits.index(max(hits)) == by_prefix.index(3) and max(hits) >= 3
    assert all(tokens >= 48 for tokens in cached[1:]), cached


def test_32_concurrent_streams_complete_whole(server, engine) -> None:
    texts = prompts(32)
    expected = expected_texts(engine, texts)
    answers = stream_all(server, texts)
    assert [answers[i][0] for i in range(32)] == expected
    assert all(answers[i][1] in ("length", "stop") for i in range(32))


def test_embeddings_through_the_replicas_equal_one_engines(server, engine) -> None:
    texts = prompts(3)
    answer = client(server).embeddings.create(
        model=MODEL_NAME, input=texts, encoding_format="float"
    )
    expected = engine.embed(texts)
    for item, vector in zip(answer.data, expected, strict=True):
        assert item.embedding == pytest.approx(vector, abs=1e-6)


def test_health_and_metrics_show_each_replica_and_their_sum(server) -> None:
    health = httpx.get(server + "/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok"
    assert [(r["replica"], r["status"]) for r in body["replicas"]] == [(0, "ok"), (1, "ok")]
    figures = scrape(server)
    for name in ("cellbatch_generation_tokens_total", "cellbatch_kv_cells_capacity"):
        each = per_replica(figures, name.replace("cellbatch_", "cellbatch_replica_"))
        assert figures[name, ()] == sum(each) > 0
    assert per_replica(figures, "cellbatch_replica_up") == [1.0, 1.0]
    unauthorised = httpx.get(server + "/metrics")
    assert unauthorised.status_code == 401  # the same key as the one-engine server


def test_offline_generate_over_two_replicas_equals_one_engine(replicas, engine) -> None:
    texts = [*prompts(5), "The same start, then one way", "The same start, then another"]
    sampled = GenConfig(max_new_tokens=6, sampling=SamplingParams(temperature=0.9), seed=11)
    for params in (GenConfig(max_new_tokens=6), sampled):
        spread = replicas.generate(texts, params)
        alone = engine.generate(texts, params)
        assert [r.tokens for r in spread] == [r.tokens for r in alone]
        assert [r.finish_reason for r in spread] == [r.finish_reason for r in alone]


def test_a_replica_killed_under_load_restarts_and_only_its_streams_fail(server, engine) -> None:
    texts = [f"Story {i} of the long night at sea, told slowly" for i in range(12)]
    long = 96  # tokens: the streams still run when the replica dies
    expected = dict(enumerate(expected_texts(engine, texts, long)))
    victim = httpx.get(server + "/health").json()["replicas"][1]["pid"]
    answers: dict[int, tuple[str, str]] = {}
    started: list[int] = []
    streaming = threading.Thread(
        target=lambda: answers.update(stream_all(server, texts, long, started))
    )
    streaming.start()
    deadline = time.monotonic() + TIME_LIMIT_S
    while len(started) < len(texts):
        assert time.monotonic() < deadline and streaming.is_alive(), "the streams did not start"
        time.sleep(0.005)
    os.kill(victim, signal.SIGKILL)
    streaming.join(TIME_LIMIT_S)
    assert not streaming.is_alive(), "a stream hung"
    complete = [i for i, (text, finish) in answers.items() if finish in ("length", "stop")]
    failed = [i for i, (_, finish) in answers.items() if finish.startswith("error")]
    assert sorted(complete + failed) == list(range(len(texts)))
    assert all(answers[i][0] == expected[i] for i in complete)
    assert all("replica 1" in answers[i][1] for i in failed), answers
    assert failed and len(complete) >= len(texts) // 2  # replica 0's streams went on
    figures = scrape(server)
    assert per_replica(figures, "cellbatch_replica_failed_requests_total")[1] == len(failed)
    # Ray brings the replica back in a new process; the server sees it and uses it again.
    while True:
        body = httpx.get(server + "/health").json()
        replica = body["replicas"][1]
        if replica["status"] == "ok" and replica["pid"] != victim:
            break
        assert time.monotonic() < deadline + TIME_LIMIT_S, "replica 1 did not come back"
        time.sleep(0.5)
    assert body["status"] == "ok" and replica["restarts"] == 1
    again = stream_all(server, texts[:4], long)
    assert [again[i][0] for i in range(4)] == [expected[i] for i in range(4)]
