"""The Files and Batch APIs' request and response shapes, as OpenAI names them.

Owns: the file object and its list and deletion answers; the batch object (status,
timestamps, request counts, usage, errors), the body that creates a batch and the
batch list; one line of a batch's input file (`BatchInputLine`) and of its output and
error files (`BatchOutputLine`); the purposes, endpoints and statuses the server takes.
Promises: responses serialise to exactly the shapes the official `openai` client
parses (`FileObject`, `Batch`, `FileDeleted`); a create body of the wrong shape fails
validation, which the app answers with a 400 naming the field.
Never: stores, reads files or runs anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Self

# Purposes a client may upload a file for (OpenAI's); only `batch` files feed batches.
UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
# Purposes of the files the server writes itself.
OUTPUT_PURPOSE = "batch_output"

# The routes a batch's lines may run on (each line names its own `url`).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
# Statuses a batch never leaves.
TERMINAL_STATUSES = ("failed", "completed", "expired", "cancelled")


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None


class _Page(BaseModel):
    """A page of a list (OpenAI's cursor pages: `after` the last id to go on)."""

    object: Literal["list"] = "list"
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False

    @classmethod
    def of(cls, data: list[Any], more: bool) -> Self:
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        page = {"data": data, "first_id": first, "last_id": last, "has_more": more}
        return cls.model_validate(page)


class FileList(_Page):
    data: list[FileObject]


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class OutputExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=3600, le=2592000)]


class BatchCreateRequest(BaseModel):
    """The body of `POST /v1/batches`."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: Annotated[str, Field(min_length=1)]
    # The route refuses the others with a message naming these.
    endpoint: Annotated[str, Field(json_schema_extra={"enum": list(BATCH_ENDPOINTS)})]
    completion_window: Literal["24h"]
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = None
    output_expires_after: OutputExpiresAfter | None = None


class BatchRequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    code: str | None = None
    line: int | None = None
    message: str | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = Field(default_factory=BatchRequestCounts)
    usage: BatchUsage | None = None
    metadata: dict[str, str] | None = None


class BatchList(_Page):
    data: list[BatchObject]


@dataclass(frozen=True)
class Usage:
    """Tokens one line (or a whole batch) used."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


class BatchInputLine(BaseModel):
    """One line of a batch's input file."""

    model_config = ConfigDict(extra="ignore")

    custom_id: Annotated[str, Field(min_length=1)]
    method: str
    url: str
    body: dict[str, Any]


class LineResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineError(BaseModel):
    code: str
    message: str


class BatchOutputLine(BaseModel):
    """One line of a batch's output or error file: the answer a line's request got
    (`response`, whatever its status), or why it got none (`error`)."""

    id: str
    custom_id: str | None
    response: LineResponse | None = None
    error: LineError | None = None
