"""`/v1/batches`: create, retrieve, list and cancel batch jobs, as OpenAI's Batch API does.

Owns: the routes `POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{batch_id}`
and `POST /v1/batches/{batch_id}/cancel`, and the checks a batch passes before it is
created.
Promises: a batch is created only on an existing `batch` file of UTF-8 text with at
most `--max-batch-lines` requests, for an endpoint the server runs and the `24h`
window, else a 400 naming the parameter (404 for an unknown file); it is created
`validating` and handed to the worker at once; cancelling a batch that runs moves it to
`cancelling` (it ends `cancelled` once its lines in flight have ended), cancelling one
that is cancelling or cancelled answers it as it is, and cancelling one that ended
otherwise is a 400 saying its status.
Never: runs a line (the worker does).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from cellbatch.server.api import ApiError
from cellbatch.server.batch_protocol import (
    BATCH_ENDPOINTS,
    BatchCreateRequest,
    BatchList,
    BatchObject,
    BatchRequestCounts,
)
from cellbatch.server.batch_store import BatchRecord, BatchStore, new_batch_id
from cellbatch.server.batch_worker import BatchWorker
from cellbatch.server.file_store import FileStore
from cellbatch.server.openapi import answers
from cellbatch.server.reply_bodies import ErrorResponse
from cellbatch.server.routing import parse, read_body

COMPLETION_WINDOWS = {"24h": 24 * 3600}


def batches_router(
    batches: BatchStore,
    files: FileStore,
    worker: BatchWorker,
    model_name: str,
    max_batch_lines: int,
    max_request_bytes: int,
) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/batches", responses=answers(BatchObject, ErrorResponse, 400, 401, 404, 413))
    async def create_batch(request: Request) -> JSONResponse:
        body = parse(BatchCreateRequest, await read_body(request, max_request_bytes))
        if body.endpoint not in BATCH_ENDPOINTS:
            raise ApiError(
                400,
                f"endpoint {body.endpoint!r} is not one this server runs batches on; use one "
                f"of {', '.join(BATCH_ENDPOINTS)}",
                "endpoint",
            )
        window = COMPLETION_WINDOWS[body.completion_window]  # the schema allows these alone
        file = await asyncio.to_thread(files.get, body.input_file_id)
        if file is None:
            raise ApiError(
                404,
                f"no file with id {body.input_file_id!r}; upload it first (POST /v1/files)",
                "input_file_id",
                code="file_not_found",
            )
        if file.purpose != "batch":
            raise ApiError(
                400,
                f"the file {file.id} was uploaded for {file.purpose!r}; a batch's input file "
                "is uploaded with purpose 'batch'",
                "input_file_id",
            )
        requests = await asyncio.to_thread(_count_requests, files, file.id)
        if requests == 0:
            raise ApiError(400, f"the file {file.id} holds no requests", "input_file_id")
        if requests > max_batch_lines:
            raise ApiError(
                400,
                f"the file {file.id} holds {requests} requests, above the {max_batch_lines} "
                "a batch takes here (--max-batch-lines); split it over several batches",
                "input_file_id",
            )
        now = int(time.time())
        expires = body.output_expires_after.seconds if body.output_expires_after else None
        record = BatchRecord(
            id=new_batch_id(),
            endpoint=body.endpoint,
            model=model_name,
            input_file_id=file.id,
            completion_window=body.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + window,
            counts=BatchRequestCounts(total=requests),
            metadata=body.metadata,
            output_expires_after=expires,
        )
        created = await asyncio.to_thread(batches.create, record)
        worker.submit(created.id)
        return JSONResponse(created.object().model_dump(mode="json"))

    @router.get("/v1/batches", responses=answers(BatchList, ErrorResponse, 400, 401))
    async def list_batches(
        after: str | None = None, limit: int = Query(20, ge=1, le=100)
    ) -> JSONResponse:
        records, more = await asyncio.to_thread(batches.page, after, limit)
        page = BatchList.of([record.object() for record in records], more)
        return JSONResponse(page.model_dump(mode="json"))

    @router.get("/v1/batches/{batch_id}", responses=answers(BatchObject, ErrorResponse, 401, 404))
    async def retrieve_batch(batch_id: str) -> JSONResponse:
        record = await _found(batches, batch_id)
        return JSONResponse(record.object().model_dump(mode="json"))

    @router.post(
        "/v1/batches/{batch_id}/cancel",
        responses=answers(BatchObject, ErrorResponse, 400, 401, 404),
    )
    async def cancel_batch(batch_id: str) -> JSONResponse:
        record = await _found(batches, batch_id)
        moved = await asyncio.to_thread(
            batches.move, batch_id, "cancelling", ("validating", "in_progress")
        )
        if moved:
            worker.cancel(batch_id)
        record = await _found(batches, batch_id)
        if not moved and record.status not in ("cancelling", "cancelled"):
            raise ApiError(
                400,
                f"the batch {batch_id} is {record.status}; only a batch that is validating or "
                "in progress can be cancelled",
                "batch_id",
            )
        return JSONResponse(record.object().model_dump(mode="json"))

    return router


async def _found(batches: BatchStore, batch_id: str) -> BatchRecord:
    record = await asyncio.to_thread(batches.get, batch_id)
    if record is None:
        raise ApiError(404, f"no batch with id {batch_id!r}", "batch_id", code="batch_not_found")
    return record


def _count_requests(files: FileStore, file_id: str) -> int:
    """The non-blank lines of a (UTF-8) file: the requests a batch on it has."""
    text = files.path(file_id).read_bytes().decode("utf-8", errors="replace")
    return sum(1 for line in text.split("\n") if line.strip())
