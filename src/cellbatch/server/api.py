"""What the server's parts share: the backend interface, plans, choices and API errors.

Owns: `Backend` (where a plan's generations run: one engine here, replicas on Ray in
`cellbatch.distributed`) and `ChoiceHandle` (what a choice streams from), `Plan` (what a
request runs) and `Choice` (one of its generations as it streams), `ApiError` (a
request that cannot be served, with what the client is told), `Interrupted` (one the
server cut short) and the finish reasons' OpenAI names.
Promises: a leaf of the server package (but for `answers`, which imports nothing of
the server): the app, the service, the responses, the local backend and the replicas'
backend all import it, and it imports none of them.
Never: plans, runs or answers anything.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cellbatch.generation_config import Constraint, GenConfig
from cellbatch.metrics import GenerationMetrics
from cellbatch.server.answers import AnswerReading, AnswerStream
from cellbatch.types import FinishReason, GenerationUpdate, Token, TokenLogprob

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from cellbatch.engine import EngineLimits
    from cellbatch.model.adapters import AdapterInfo
    from cellbatch.model.tokenizer import Tokenizer

FINISH_REASONS = {
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.TOKEN_LIMIT: "length",
    FinishReason.CANCELLED: "abort",
}


class ApiError(Exception):
    """A request that cannot be served, with what the client is told."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status,
            message,
            param,
            kind,
            code,
        )


class Interrupted(ApiError):
    """A request whose generations were cancelled before they finished, by the server
    (it stops) rather than by its client: it has no answer to give."""

    def __init__(self, message: str = "the server stopped before the request finished") -> None:
        super().__init__(503, message, kind="server_error")


@dataclass
class Choice:
    """One generation of a request, as it streams."""

    index: int
    prompt_index: int
    handle: ChoiceHandle
    tokens: list[Token] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    finish_reason: FinishReason | None = None
    error: str = ""
    echoed: bool = False  # streaming: the prompt went out with the first chunk
    offset: int = 0  # streaming: characters of token text sent so far (logprobs offsets)
    # Streaming a conversation: the reasoning, content and calls sent so far.
    answer_stream: AnswerStream | None = None


@dataclass
class Plan:
    """What a request runs: token prompts, each with its config, n choices each."""

    prompts: list[list[Token]]
    configs: list[GenConfig]
    n: int
    echo: bool = False
    drop_generated: bool = False  # echo with max_tokens 0: one token runs, none is shown
    logprobs: int | None = None
    # How a conversation's answers are read: reasoning, and calls when tools are offered
    # (the default: plain text).
    reading: AnswerReading = field(default_factory=AnswerReading)


class ChoiceHandle(Protocol):
    """One choice's generation as the service follows it (a GenerationHandle is one)."""

    def stream(self) -> AsyncIterator[GenerationUpdate]: ...

    def cancel(self) -> None: ...

    def metrics(self) -> GenerationMetrics: ...


class Backend(Protocol):
    tokenizer: Tokenizer | None
    vocab_size: int
    shape: EngineLimits

    def decode(self, tokens: Sequence[Token]) -> str: ...

    def check_constraint(self, constraint: Constraint) -> None:
        """Compiles `constraint` for the served model's tokenizer; InvalidArgumentError
        naming the problem when it does not compile (before anything runs)."""
        ...

    async def start(self, plan: Plan) -> list[Choice]:
        """Launch every generation of the plan; the choices stream as they run."""
        ...

    def embedding_size(self, dimensions: int | None) -> int:
        """The size of the embeddings asked for (None: the model's own);
        InvalidArgumentError for one the model does not allow."""
        ...

    def embedding_sizes(self) -> tuple[int, tuple[int, ...] | None]:
        """The model's hidden size and the sizes its embeddings may be shortened to
        (None: none; empty: any), for the published schema."""
        ...

    async def embed(
        self, prompts: Sequence[Sequence[Token]], pooling: str, priority: int
    ) -> list[GenerationUpdate]:
        """Each prompt's pooled hidden states (checked prompts: in the vocabulary and
        within the context), as its generation's summary: `embedding` set, or a failure."""
        ...

    async def health(self) -> tuple[bool, dict[str, object]]:
        """(serving, what /health shows)."""
        ...

    def adapters(self) -> list[AdapterInfo]:
        """The LoRA adapters served now, in load order."""
        ...

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in folder `path` as `name`; InvalidArgumentError (or
        OutOfResourcesError) saying why when it cannot, having loaded nothing."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Stop serving `name` (its running generations finish with it);
        InvalidArgumentError when no adapter has that name."""
        ...

    def collector(self) -> Collector:
        """The engine figures (and the backend's own) for /metrics, read at scrape
        time, from any thread."""
        ...

    def stopping(self) -> bool: ...

    def close(self) -> None: ...
