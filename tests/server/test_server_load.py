"""`cellbatch serve` under load: many concurrent streams with disconnects over a pool
too small for all of them, the queue limit, Prometheus metrics, and a SIGTERM in the
middle of it all (the real command, in a subprocess)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from cellbatch.generation_config import GenConfig
from cellbatch.runner.admission import GROWTH_CELLS
from served import API_KEY, MODEL_NAME

CLIENTS = 64
NEW_TOKENS = GROWTH_CELLS + 16  # each stream outgrows the growth reserve it started with
TIME_LIMIT_S = 120.0


def prompts(count: int) -> list[str]:
    return [f"Tell me fact number {i} about the sea and its {i * 7} fishes." for i in range(count)]


def test_64_streams_with_disconnects_are_whole_and_leave_no_cell_in_use(start_server) -> None:
    # Prefix cache off (its snapshots would hold cells) and a pool for ~16 streams.
    live = start_server(prefix_cache_entries=0, max_sessions=64, max_cells=16 * 64)
    client = live.client(max_retries=0, timeout=TIME_LIMIT_S)
    texts = prompts(CLIENTS)
    # What each stream must add up to: the same prompts, greedy, straight from the engine.
    encoded = [live.engine.tokenizer.encode(text) for text in texts]
    expected = [
        live.engine.decode(result.tokens)
        for result in live.engine.generate(encoded, GenConfig(max_new_tokens=NEW_TOKENS))
    ]
    rng = random.Random(5)
    leaving = set(rng.sample(range(CLIENTS), CLIENTS // 3))
    outcome: dict[int, str] = {}
    whole: dict[int, str] = {}

    def stream(index: int) -> None:
        pieces = []
        with client.completions.create(
            model=MODEL_NAME,
            prompt=texts[index],
            max_tokens=NEW_TOKENS,
            temperature=0,
            stream=True,
        ) as events:
            for number, chunk in enumerate(events):
                pieces.append(chunk.choices[0].text)
                if index in leaving and number == index % 5:
                    outcome[index] = "left"
                    return  # closing the stream drops the connection
                if chunk.choices[0].finish_reason is not None:
                    outcome[index] = chunk.choices[0].finish_reason
        whole[index] = "".join(pieces)
        outcome.setdefault(index, "no finish")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIME_LIMIT_S)
        assert not thread.is_alive(), "a stream hung"
    assert len(outcome) == CLIENTS
    stayed = [i for i in range(CLIENTS) if i not in leaving]
    assert all(outcome[i] in ("length", "stop") for i in stayed)
    assert [whole[i] for i in stayed] == [expected[i] for i in stayed]  # nothing lost or doubled
    assert httpx.get(live.base_url + "/health").status_code == 200
    deadline = time.monotonic() + 10
    while live.kv_cells_in_use() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.kv_cells_in_use() == 0
    assert live.engine.metrics().preemptions > 0  # the pool was too small for all at once


def test_beyond_the_queue_limit_requests_get_429_with_retry_after(start_server) -> None:
    live = start_server(max_queued_requests=1, max_sessions=1, prefix_cache_entries=0)
    statuses: list[int] = []
    retry_after: list[str | None] = []

    def ask() -> None:
        answer = httpx.post(
            live.base_url + "/v1/completions",
            json={"prompt": "hello there", "max_tokens": 40, "temperature": 0},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=TIME_LIMIT_S,
        )
        statuses.append(answer.status_code)
        if answer.status_code == 429:
            retry_after.append(answer.headers.get("retry-after"))
            assert answer.json()["error"]["type"] == "rate_limit_error"

    threads = [threading.Thread(target=ask) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIME_LIMIT_S)
    assert 200 in statuses and 429 in statuses
    assert all(value == "1" for value in retry_after)


def test_metrics_parse_and_count_what_was_sent(live) -> None:
    def scrape() -> dict[tuple[str, tuple], float]:
        text = httpx.get(
            live.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
        ).text
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    before = scrape()
    client = live.client()
    for _ in range(3):
        client.completions.create(model=MODEL_NAME, prompt="count me", max_tokens=4, temperature=0)
    client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    after = scrape()
    key = ("cellbatch_requests_total", (("endpoint", "completions"), ("finish_reason", "length")))
    assert after[key] - before.get(key, 0.0) == 3
    chat = [
        value - before.get(name, 0.0)
        for name, value in after.items()
        if name[0] == "cellbatch_requests_total" and ("endpoint", "chat/completions") in name[1]
    ]
    assert sum(chat) == 1
    ttft = ("cellbatch_time_to_first_token_seconds_count", ())
    assert after[ttft] - before.get(ttft, 0.0) == 4
    assert after[("cellbatch_generation_tokens_total", ())] > 0
    assert after[("cellbatch_kv_cells_capacity", ())] == live.engine.shape.max_cells
    for name in ("cellbatch_requests_running", "cellbatch_requests_waiting"):
        assert (name, ()) in after


def test_sigterm_during_load_exits_0_within_the_grace_period(tiny_chat_model: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    grace = 2.0
    command = [
        str(Path(sys.executable).with_name("cellbatch")),
        "serve",
        "--model", str(tiny_chat_model),
        "--port", str(port),
        "--kernels", "torch",
        "--threads", "1",
        "--shutdown-timeout", str(grace),
        "--served-model-name", MODEL_NAME,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CELLBATCH_API_KEY": API_KEY}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + TIME_LIMIT_S
        while True:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline, "the server never answered /health"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0
        )
        endings: list[str | None] = []

        def stream() -> None:
            finish = None
            try:
                for chunk in client.completions.create(
                    model=MODEL_NAME, prompt="A long tale", max_tokens=200, stream=True
                ):
                    finish = chunk.choices[0].finish_reason or finish
            except (openai.APIError, httpx.HTTPError):
                finish = "dropped"
            endings.append(finish)

        threads = [threading.Thread(target=stream) for _ in range(8)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        stopped_at = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=TIME_LIMIT_S)
        took = time.monotonic() - stopped_at
        for thread in threads:
            thread.join(TIME_LIMIT_S)
        assert code == 0
        assert took <= grace + 1.0 + 1.0  # the grace period, a second, and process exit
        assert len(endings) == 8 and all(e in ("length", "stop", "abort") for e in endings)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_an_error_inside_a_request_is_a_500_for_it_alone(live, monkeypatch) -> None:
    planner = live.server.config.app.state.planner

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(planner, "plan_completion", broken)
    answer = httpx.post(
        live.base_url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    ok = live.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert ok.choices
