"""`/v1/files`: upload, list, read and delete files, as OpenAI's Files API does.

Owns: the routes `POST /v1/files` (multipart: `file`, `purpose`, optional
`expires_after[anchor]` and `expires_after[seconds]`), `GET /v1/files`, `GET
/v1/files/{file_id}`, `GET /v1/files/{file_id}/content` and `DELETE /v1/files/{file_id}`.
Promises: a file over `--max-file-bytes`, a purpose OpenAI does not have, a `batch` file
that is not UTF-8 text, or a bad expiry is a 400 naming the problem, and nothing is
kept; an unknown id is a 404; a file an unfinished batch reads cannot be deleted (400,
naming the batch); the content comes back byte for byte.
Never: parses a file's lines (the batch worker does).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.datastructures import UploadFile

from cellbatch.server.api import ApiError
from cellbatch.server.batch_protocol import UPLOAD_PURPOSES, FileDeleted, FileList, FileObject
from cellbatch.server.batch_store import BatchStore
from cellbatch.server.file_store import FileRecord, FileStore, FileTooLarge
from cellbatch.server.openapi import answers, errors
from cellbatch.server.reply_bodies import ErrorResponse

# What a multipart body adds around the file's own bytes, at most (boundaries, headers,
# the small fields): a Content-Length above the limit plus this is refused unread.
MULTIPART_SLACK = 64 * 1024
EXPIRY_SECONDS = (3600, 2592000)  # OpenAI's bounds on expires_after[seconds]

UPLOAD_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                # An anchor says when the expiry counts from; the seconds are the expiry.
                "dependentRequired": {"expires_after[anchor]": ["expires_after[seconds]"]},
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)},
                    "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                    "expires_after[seconds]": {
                        "type": "integer",
                        "minimum": EXPIRY_SECONDS[0],
                        "maximum": EXPIRY_SECONDS[1],
                    },
                },
            }
        }
    },
}


def files_router(files: FileStore, batches: BatchStore, max_file_bytes: int) -> APIRouter:
    router = APIRouter()

    @router.post(
        "/v1/files",
        responses=answers(FileObject, ErrorResponse, 400, 401),
        openapi_extra={"requestBody": UPLOAD_BODY},
    )
    async def create_file(request: Request) -> JSONResponse:
        declared = request.headers.get("content-length") or ""
        if declared.isdigit() and int(declared) > max_file_bytes + MULTIPART_SLACK:
            raise ApiError(
                400,
                f"the upload is {declared} bytes, above the {max_file_bytes}-byte limit "
                "on a file (--max-file-bytes); split it into smaller files",
                "file",
            )
        try:
            form = await request.form(max_files=1, max_fields=8)
        except Exception as error:  # Starlette's refusal of a malformed multipart body
            raise ApiError(
                400, f"the body is not a multipart form with one file: {error}"
            ) from error
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise ApiError(
                    400, "file is missing: send it as the multipart field `file`", "file"
                )
            if not isinstance(purpose, str) or purpose not in UPLOAD_PURPOSES:
                raise ApiError(
                    400,
                    f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}",
                    "purpose",
                )
            expires_at = _expiry(
                form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
            )
            try:
                record = await asyncio.to_thread(
                    files.save_upload,
                    upload.file,
                    upload.filename or "upload",
                    purpose,
                    expires_at,
                    max_file_bytes,
                )
            except FileTooLarge as error:
                raise ApiError(400, str(error), "file") from error
        finally:
            await form.close()
        if purpose == "batch" and not await asyncio.to_thread(_is_text, files, record):
            await asyncio.to_thread(files.delete, record.id)
            raise ApiError(
                400,
                "a batch file must be UTF-8 text: one JSON request per line (JSONL)",
                "file",
                code="invalid_file_encoding",
            )
        return JSONResponse(record.object().model_dump(mode="json"))

    @router.get("/v1/files", responses=answers(FileList, ErrorResponse, 400, 401))
    async def list_files(
        purpose: str | None = None,
        limit: int = Query(10000, ge=1, le=10000),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> JSONResponse:
        records, more = await asyncio.to_thread(files.page, purpose, limit, order == "asc", after)
        page = FileList.of([record.object() for record in records], more)
        return JSONResponse(page.model_dump(mode="json"))

    @router.get("/v1/files/{file_id}", responses=answers(FileObject, ErrorResponse, 401, 404))
    async def retrieve_file(file_id: str) -> JSONResponse:
        record = await _found(files, file_id)
        return JSONResponse(record.object().model_dump(mode="json"))

    @router.get(
        "/v1/files/{file_id}/content",
        response_class=FileResponse,
        responses={
            200: {
                "description": "the file's bytes",
                "content": {"application/octet-stream": {}},
            },
            **errors(ErrorResponse, 401, 404),
        },
    )
    async def file_content(file_id: str) -> FileResponse:
        record = await _found(files, file_id)
        return FileResponse(
            files.path(record.id), media_type="application/octet-stream", filename=record.filename
        )

    @router.delete(
        "/v1/files/{file_id}", responses=answers(FileDeleted, ErrorResponse, 400, 401, 404)
    )
    async def delete_file(file_id: str) -> JSONResponse:
        record = await _found(files, file_id)
        user = await asyncio.to_thread(batches.using_file, record.id)
        if user is not None:
            raise ApiError(
                400,
                f"the file {record.id} is the input of batch {user}, which has not finished; "
                "cancel the batch (or wait for it) first",
                "file_id",
            )
        await asyncio.to_thread(files.delete, record.id)
        return JSONResponse(FileDeleted(id=record.id).model_dump(mode="json"))

    return router


async def _found(files: FileStore, file_id: str) -> FileRecord:
    record = await asyncio.to_thread(files.get, file_id)
    if record is None:
        raise ApiError(404, f"no file with id {file_id!r}", "file_id", code="file_not_found")
    return record


def _expiry(anchor: Any, seconds: Any) -> int | None:
    """expires_at from the form's expires_after fields (None: the file stays)."""
    if anchor is None and seconds is None:
        return None
    if anchor is not None and anchor != "created_at":  # the only anchor, so the default
        raise ApiError(400, "expires_after[anchor] must be created_at", "expires_after")
    low, high = EXPIRY_SECONDS
    if not isinstance(seconds, str) or not seconds.isdigit() or not low <= int(seconds) <= high:
        raise ApiError(
            400, f"expires_after[seconds] must be an integer in [{low}, {high}]", "expires_after"
        )
    return int(time.time()) + int(seconds)


def _is_text(files: FileStore, record: FileRecord) -> bool:
    try:
        files.path(record.id).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
