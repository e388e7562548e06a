"""The Files and Batch APIs through the official client: a 200-line batch mixing chat,
completions and embeddings with malformed lines, a cancelled batch, the files' life and
limits, and `cellbatch run-batch` on the same file giving the same answers."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from cellbatch.cli import main
from cellbatch.server.batch_features import BatchSettings
from served import MODEL_NAME, LiveServer

MAX_BATCH_LINES = 250
MAX_FILE_BYTES = 96 * 1024
TERMINAL = ("completed", "failed", "cancelled", "expired")


def request_line(index: int) -> dict[str, Any]:
    """Line `index` of the mixed batch: chat, completion and embedding requests in turn."""
    kind = index % 3
    if kind == 0:
        url, body = (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": f"Tell me about the number {index}."}],
                "max_tokens": 6 + index % 5,
                "temperature": 0,
            },
        )
    elif kind == 1:
        url, body = (
            "/v1/completions",
            {
                "prompt": f"Line {index} says:",
                "max_tokens": 6,
                "temperature": 0,
                "model": MODEL_NAME,
            },
        )
    else:
        url, body = "/v1/embeddings", {"input": [f"embed {index}", f"and {index + 1}"]}
    return {"custom_id": f"request-{index}", "method": "POST", "url": url, "body": body}


MALFORMED = {
    40: "{this is not json",
    90: json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}),
    150: json.dumps(
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/images/generations", "body": {}}
    ),
}


def mixed_file() -> str:
    lines = [MALFORMED.get(i) or json.dumps(request_line(i)) for i in range(200)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def batch_server(
    start_server: Callable[..., LiveServer], tmp_path_factory: pytest.TempPathFactory
) -> LiveServer:
    data = tmp_path_factory.mktemp("batches")
    settings = BatchSettings(max_file_bytes=MAX_FILE_BYTES, max_batch_lines=MAX_BATCH_LINES)
    return start_server(data_dir=data, batches=settings, max_sessions=8)


def upload(client: openai.OpenAI, text: str, purpose: str = "batch") -> str:
    file = ("requests.jsonl", io.BytesIO(text.encode()))
    return client.files.create(file=file, purpose=purpose).id  # type: ignore[arg-type]


def wait_for(client: openai.OpenAI, batch_id: str, until: Callable[[Any], bool]) -> Any:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} never got there: {batch}")


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def finished(batch_server: LiveServer) -> dict[str, Any]:
    """The mixed batch, run to its end: the batch object and its files' lines."""
    client = batch_server.client()
    file_id = upload(client, mixed_file())
    created = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "mixed"},
    )
    assert created.status == "validating" and created.request_counts.total == 200
    batch = wait_for(client, created.id, lambda b: b.status in TERMINAL)
    return {
        "batch": batch,
        "file_id": file_id,
        "output": file_lines(client, batch.output_file_id),
        "errors": file_lines(client, batch.error_file_id),
    }


def test_a_mixed_batch_answers_every_line_once_and_fails_malformed_lines_alone(
    finished: dict[str, Any],
) -> None:
    batch = finished["batch"]
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 200
    assert (batch.request_counts.completed, batch.request_counts.failed) == (197, 3)
    assert batch.metadata == {"run": "mixed"} and batch.model == MODEL_NAME
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert getattr(batch, stamp) is not None
    assert batch.usage.input_tokens > 0 and batch.usage.output_tokens > 0
    output, errors = finished["output"], finished["errors"]
    assert len(output) == 197 and len(errors) == 3
    ids = [line["custom_id"] for line in output + errors]
    valid = {f"request-{i}" for i in range(200) if i not in MALFORMED}
    assert sorted(i for i in ids if i in valid) == sorted(valid)  # each exactly once
    assert {line["error"]["code"] for line in errors} == {
        "invalid_json", "invalid_request", "invalid_url"
    }  # fmt: skip
    assert {line["custom_id"] for line in errors} == {None, "no-body", "bad-url"}
    for line in output:
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req_")
        index = int(line["custom_id"].split("-")[1])
        expected = ("chat.completion", "text_completion", "list")[index % 3]
        assert response["body"]["object"] == expected


def test_batch_answers_are_the_interactive_answers(
    batch_server: LiveServer, finished: dict[str, Any]
) -> None:
    client = batch_server.client()
    by_id = {line["custom_id"]: line["response"]["body"] for line in finished["output"]}
    for index in (0, 1, 2, 3, 4, 5, 99, 198):
        body = request_line(index)["body"]
        got = by_id[f"request-{index}"]
        if index % 3 == 0:
            direct = client.chat.completions.create(model=MODEL_NAME, **body)
            assert got["choices"][0]["message"]["content"] == direct.choices[0].message.content
        elif index % 3 == 1:
            direct_text = client.completions.create(**body).choices[0].text
            assert got["choices"][0]["text"] == direct_text
        else:
            vectors = client.embeddings.create(
                model=MODEL_NAME, encoding_format="float", **body
            ).data
            for item, vector in zip(got["data"], vectors, strict=True):
                np.testing.assert_allclose(item["embedding"], vector.embedding, atol=1e-6)


def test_run_batch_gives_the_servers_answers(
    finished: dict[str, Any], tiny_chat_model: Path, tmp_path: Path
) -> None:
    requests, answers = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    requests.write_text(mixed_file())
    report = tmp_path / "report.json"
    status = main([
        "run-batch", "-i", str(requests), "-o", str(answers), "--model", str(tiny_chat_model),
        "--dtype", "float32", "--kernels", "torch", "--served-model-name", MODEL_NAME,
        "--quiet", "--report-json", str(report),
    ])  # fmt: skip
    assert status == 1  # three lines failed
    offline = [json.loads(line) for line in answers.read_text().splitlines()]
    assert len(offline) == 200
    served = {line["custom_id"]: line for line in finished["output"]}
    for index, line in enumerate(offline):
        if index in MALFORMED:
            assert line["response"] is None and line["error"]["code"]
            continue
        assert line["custom_id"] == f"request-{index}"
        mine = line["response"]["body"]
        theirs = served[line["custom_id"]]["response"]["body"]
        if index % 3 == 2:
            for a, b in zip(mine["data"], theirs["data"], strict=True):
                np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-6)
        else:
            assert mine["choices"] == theirs["choices"], index
            assert mine["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]
    summary = json.loads(report.read_text())
    assert (summary["lines"], summary["completed"], summary["failed"]) == (200, 197, 3)


def test_a_cancelled_batch_ends_cancelled_with_every_line_answered_once(
    batch_server: LiveServer,
) -> None:
    client = batch_server.client()
    lines = [
        {
            "custom_id": f"long-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"Count {i}:", "max_tokens": 48, "ignore_eos": True},
        }
        for i in range(60)
    ]
    file_id = upload(client, "\n".join(json.dumps(line) for line in lines))
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
    )
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 2)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    ended = wait_for(client, batch.id, lambda b: b.status in TERMINAL)
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    counts = ended.request_counts
    assert counts.completed + counts.failed == counts.total == 60
    assert 2 <= counts.completed < 60
    output = file_lines(client, ended.output_file_id)
    errors = file_lines(client, ended.error_file_id)
    assert len(output) == counts.completed and len(errors) == counts.failed
    assert sorted(line["custom_id"] for line in output + errors) == sorted(
        line["custom_id"] for line in lines
    )
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert all(
        line["response"]["body"]["choices"][0]["finish_reason"] == "length" for line in output
    )
    # Cancelling again answers the batch as it is; a completed one cannot be cancelled.
    assert client.batches.cancel(batch.id).status == "cancelled"
    deadline = time.monotonic() + 10  # the cancelled lines' cells come back
    while batch_server.kv_cells_in_use() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert batch_server.kv_cells_in_use() == 0


def test_a_completed_batch_cannot_be_cancelled(
    batch_server: LiveServer, finished: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError, match="is completed"):
        batch_server.client().batches.cancel(finished["batch"].id)


def test_files_are_listed_read_and_deleted(batch_server: LiveServer) -> None:
    client = batch_server.client()
    text = '{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}\n'
    file_id = upload(client, text, purpose="user_data")
    record = client.files.retrieve(file_id)
    assert (record.bytes, record.purpose) == (len(text), "user_data")
    assert record.filename == "requests.jsonl"
    assert client.files.content(file_id).content == text.encode()
    assert file_id in [f.id for f in client.files.list(purpose="user_data")]
    first = client.files.list(limit=1)
    assert len(first.data) == 1 and first.has_more
    assert client.files.list(limit=1, after=first.data[0].id).data[0].id != first.data[0].id
    deleted = client.files.delete(file_id)
    assert deleted.deleted and deleted.id == file_id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(file_id)
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        client.batches.create(
            input_file_id=upload(client, text, "user_data"),
            endpoint="/v1/completions",
            completion_window="24h",
        )


def test_batches_are_listed_newest_first(
    batch_server: LiveServer, finished: dict[str, Any]
) -> None:
    client = batch_server.client()
    listed = client.batches.list(limit=100).data
    assert finished["batch"].id in [batch.id for batch in listed]
    created = [batch.created_at for batch in listed]
    assert created == sorted(created, reverse=True)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


@pytest.mark.parametrize(
    ("make", "param", "says"),
    [
        (lambda c: upload(c, "x" * (MAX_FILE_BYTES + 1)), "file", "--max-file-bytes"),
        (
            lambda c: upload(c, "{}\n" * (MAX_BATCH_LINES + 1)),
            "input_file_id",
            "--max-batch-lines",
        ),
        (lambda c: upload(c, "\n\n"), "input_file_id", "holds no requests"),
        (lambda c: "file-none", "input_file_id", "no file with id"),
    ],
)
def test_limits_and_bad_inputs_are_clear_refusals(
    batch_server: LiveServer, make: Callable[[openai.OpenAI], str], param: str, says: str
) -> None:
    client = batch_server.client()
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as caught:
        file_id = make(client)
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and says in error["message"]


@pytest.mark.parametrize(
    ("endpoint", "window", "param"),
    [("/v1/moderations", "24h", "endpoint"), ("/v1/completions", "1h", "completion_window")],
)
def test_an_endpoint_or_window_the_server_lacks_is_a_400(
    batch_server: LiveServer, endpoint: str, window: str, param: str
) -> None:
    client = batch_server.client()
    file_id = upload(client, json.dumps(request_line(1)))
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(
            input_file_id=file_id,
            endpoint=endpoint,  # type: ignore[arg-type]
            completion_window=window,  # type: ignore[arg-type]
        )
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param


def test_an_upload_that_is_not_text_or_has_a_bad_purpose_is_refused(
    batch_server: LiveServer,
) -> None:
    client = batch_server.client()
    with pytest.raises(openai.BadRequestError, match="UTF-8"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"\xff\xfe\x00")), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose must be one of"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="nonsense")  # type: ignore[arg-type]


def test_a_file_an_unfinished_batch_reads_cannot_be_deleted(batch_server: LiveServer) -> None:
    client = batch_server.client()
    lines = [
        json.dumps({"custom_id": f"d{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "x", "max_tokens": 32, "ignore_eos": True}})
        for i in range(30)
    ]  # fmt: skip
    file_id = upload(client, "\n".join(lines))
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
    )
    try:
        with pytest.raises(openai.BadRequestError, match=batch.id):
            client.files.delete(file_id)
    finally:
        client.batches.cancel(batch.id)
        wait_for(client, batch.id, lambda b: b.status in TERMINAL)
    assert client.files.delete(file_id).deleted
