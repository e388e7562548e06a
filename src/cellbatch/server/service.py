"""The bridge from OpenAI requests to the engine: plans, generations and answers.

Owns: turning a validated request into token prompts and a `GenConfig` per prompt,
starting their generations on the backend (one engine, or replicas: see `backend`),
following them as they stream; the set of live requests (to cancel them on
disconnect or shutdown) and the per-request timing the metrics observe.
Promises: every problem a request can have by itself (a prompt longer than the
context, a token outside the vocabulary, too many choices, bad stop strings) is an
`ApiError` with the status, message and parameter before anything runs; a request
that ends early (its client left, the server stops) cancels its generations within
a step; the streamed text is the runner's incremental text: no split characters and
no part of a stop string, ever.
Never: parses HTTP or frames events; the app does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from cellbatch.server.api import FINISH_REASONS, ApiError, Backend, Choice, Plan
from cellbatch.server.observability import ServerMetrics
from cellbatch.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from cellbatch.text_stream import check_stop_strings
from cellbatch.types import (
    GenConfig,
    GenerationUpdate,
    InvalidArgumentError,
    SamplingParams,
    Token,
)

if TYPE_CHECKING:
    from cellbatch.model.tokenizer import Tokenizer


@dataclass(eq=False)
class Job:
    """A running request: its choices and how they are going (compared by identity)."""

    plan: Plan
    choices: list[Choice]
    arrival: float
    first_token: float | None = None

    def cancel(self) -> None:
        for choice in self.choices:
            choice.handle.cancel()


class EngineService:
    def __init__(
        self,
        backend: Backend,
        served_model_name: str,
        metrics: ServerMetrics,
        max_queued_requests: int,
    ) -> None:
        self.backend = backend
        self.model_name = served_model_name
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.context_limit = int(backend.shape.max_session_tokens or 0)
        self._live: set[Job] = set()
        self._queued = 0  # requests whose generations have not produced a token yet

    # -- plans -----------------------------------------------------------------------------

    def plan_completion(self, request: CompletionRequest) -> Plan:
        prompts = self._completion_prompts(request.prompt)
        if request.max_tokens == 0 and not request.echo:
            raise ApiError(400, "max_tokens must be at least 1 (0 only with echo)", "max_tokens")
        drop = request.max_tokens == 0
        sampling = self._sampling(request, request.logprobs)
        if request.echo and request.logprobs is not None:
            sampling = replace(sampling, prompt_logprobs=request.logprobs)
        configs = [
            self._config(request, prompt, 1 if drop else request.max_tokens, sampling, "prompt")
            for prompt in prompts
        ]
        return Plan(prompts, configs, request.n, request.echo, drop, request.logprobs)

    def plan_chat(self, request: ChatCompletionRequest) -> Plan:
        tokenizer = self._tokenizer("apply the chat template")
        if not tokenizer.has_chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            prompt = tokenizer.apply_chat_template(messages)
        except Exception as error:  # the template rejected the conversation
            raise ApiError(
                400, f"the chat template refused the messages: {error}", "messages"
            ) from error
        top = request.top_logprobs if request.logprobs else None
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if request.logprobs and top is None:
            top = 0
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens == 0:
            raise ApiError(400, "max_tokens must be at least 1", "max_tokens")
        config = self._config(request, prompt, max_tokens, self._sampling(request, top), "messages")
        return Plan([prompt], [config], request.n, logprobs=top)

    def _completion_prompts(self, prompt: object) -> list[list[Token]]:
        if isinstance(prompt, str):
            texts: list[str | list[int]] = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            texts = [list(prompt)]
        else:
            texts = list(prompt)  # type: ignore[call-overload]
        if not texts:
            raise ApiError(400, "prompt is empty", "prompt")
        prompts = []
        for text in texts:
            tokens = self._tokenizer("encode text").encode(text) if isinstance(text, str) else text
            if not tokens:
                raise ApiError(400, "a prompt is empty: it must hold at least one token", "prompt")
            vocab = self.backend.vocab_size
            if any(not 0 <= t < vocab for t in tokens):
                raise ApiError(400, f"a token id is outside the vocabulary [0, {vocab})", "prompt")
            prompts.append(list(tokens))
        return prompts

    def _sampling(
        self, request: CompletionRequest | ChatCompletionRequest, top: int | None
    ) -> SamplingParams:
        try:
            asked = request.constraint()
        except ValueError as error:  # InvalidArgumentError among them
            raise ApiError(400, str(error), "response_format") from error
        constraint = None
        if asked is not None:
            constraint, field = asked
            try:
                self.backend.check_constraint(constraint)
            except InvalidArgumentError as error:
                raise ApiError(400, str(error), field.partition(".")[0]) from error
        rules = self._token_rules(request)
        try:
            return SamplingParams(
                **rules,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=max(0, request.top_k),
                min_p=request.min_p,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                repetition_penalty=request.repetition_penalty,
                logprobs=top,
                constraint=constraint,
            )
        except InvalidArgumentError as error:
            raise ApiError(400, str(error)) from error

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """The prompt's token ids (or the chat template's, for messages), as `/tokenize`."""
        tokenizer = self._tokenizer("tokenize")
        if (request.prompt is None) == (request.messages is None):
            raise ApiError(400, "give either prompt or messages, not both or neither", "prompt")
        if request.messages is not None:
            if not tokenizer.has_chat_template:
                raise ApiError(400, "this model has no chat template", "messages")
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            try:
                tokens = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=request.add_generation_prompt
                )
            except Exception as error:  # the template rejected the conversation
                raise ApiError(
                    400, f"the chat template refused the messages: {error}", "messages"
                ) from error
        else:
            assert request.prompt is not None
            tokens = tokenizer.encode(request.prompt, request.add_special_tokens)
        return TokenizeResponse(
            count=len(tokens), max_model_len=self.context_limit, tokens=list(tokens)
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        vocab = self.backend.vocab_size
        if any(token >= vocab for token in request.tokens):
            raise ApiError(400, f"a token id is outside the vocabulary [0, {vocab})", "tokens")
        tokenizer = self._tokenizer("detokenize")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens, False))

    def _token_rules(self, request: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        """SamplingParams' token rules from the request, each id checked against the
        vocabulary and each bad word tokenized (as it is and after a space, as vLLM)."""
        vocab = self.backend.vocab_size
        rules: dict[str, Any] = {"min_tokens": request.min_tokens}
        if request.logit_bias:
            pairs = []
            for key, bias in request.logit_bias.items():
                if not key.isdigit() or int(key) >= vocab:
                    raise ApiError(
                        400,
                        f"logit_bias key {key!r} is not a token id in [0, {vocab})",
                        "logit_bias",
                    )
                pairs.append((int(key), float(bias)))
            rules["logit_bias"] = tuple(pairs)
        if request.allowed_token_ids is not None:
            outside = [t for t in request.allowed_token_ids if t >= vocab]
            if outside or not request.allowed_token_ids:
                raise ApiError(
                    400,
                    f"allowed_token_ids must name token ids in [0, {vocab}), got "
                    f"{outside[:1] or 'none'}",
                    "allowed_token_ids",
                )
            rules["allowed_tokens"] = frozenset(request.allowed_token_ids)
        if request.bad_words:
            tokenizer = self._tokenizer("tokenize bad_words")
            sequences = {
                tuple(tokenizer.encode(text, add_special_tokens=False))
                for word in request.bad_words
                for text in (word, " " + word.lstrip())
            }
            rules["banned_sequences"] = tuple(sorted(s for s in sequences if s))
        return rules

    def _config(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        prompt: Sequence[Token],
        max_tokens: int | None,
        sampling: SamplingParams,
        prompt_param: str,
    ) -> GenConfig:
        room = self.context_limit - len(prompt)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = f" and {max_tokens} new tokens" if max_tokens is not None else ""
            raise ApiError(
                400,
                f"this model's context holds {self.context_limit} tokens, but the prompt has "
                f"{len(prompt)}{asked}; shorten the prompt or lower max_tokens",
                "max_tokens" if room >= 1 else prompt_param,
                code="context_length_exceeded",
            )
        if request.n > self.backend.shape.max_sessions:
            raise ApiError(
                400,
                f"n={request.n} is above the {self.backend.shape.max_sessions} sessions the "
                "server runs at once",
                "n",
            )
        try:
            stop_strings = check_stop_strings(request.stop_strings())
        except InvalidArgumentError as error:
            raise ApiError(400, f"stop: {error}", "stop") from error
        extra_stop = frozenset(request.stop_token_ids or ())
        if any(token >= self.backend.vocab_size for token in extra_stop):
            raise ApiError(
                400,
                f"stop_token_ids must name token ids in [0, {self.backend.vocab_size})",
                "stop_token_ids",
            )
        try:
            return GenConfig(
                max_new_tokens=max_tokens if max_tokens is not None else room,
                sampling=sampling,
                stop_strings=stop_strings,
                seed=request.seed,
                # ignore_eos: no stop token but the ones the request names (vLLM's).
                stop_tokens=frozenset() if request.ignore_eos else None,
                extra_stop_tokens=extra_stop,
                include_stop_string=request.include_stop_str_in_output,
            )
        except InvalidArgumentError as error:
            raise ApiError(400, str(error)) from error

    def _tokenizer(self, why: str) -> Tokenizer:
        if self.backend.tokenizer is None:
            raise ApiError(400, f"this model has no tokenizer, so the server cannot {why}")
        return self.backend.tokenizer

    # -- running ---------------------------------------------------------------------------

    def admit(self) -> None:
        """Refuse a new request when too many wait already."""
        if self._queued >= self.max_queued_requests:
            raise ApiError(
                429,
                f"{self._queued} requests are waiting to start; retry shortly",
                kind="rate_limit_error",
                code="too_many_requests",
            )

    async def start(self, plan: Plan) -> Job:
        """Start every generation of the plan on the backend."""
        arrival = time.perf_counter()
        self._queued += 1
        try:
            choices = await self.backend.start(plan)
        except Exception:
            self._queued -= 1
            raise
        request = Job(plan, choices, arrival)
        self._live.add(request)
        return request

    async def follow(self, request: Job) -> AsyncIterator[tuple[Choice, GenerationUpdate]]:
        """Each choice's updates as they come (choices interleaved), then the end."""
        queue: asyncio.Queue[tuple[Choice, GenerationUpdate] | None] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            async for update in choice.handle.stream():
                await queue.put((choice, update))
            await queue.put(None)

        tasks = [asyncio.create_task(pump(choice)) for choice in request.choices]
        last = request.arrival
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                choice, update = item
                self._record(choice, update)
                if update.tokens:
                    now = time.perf_counter()
                    if request.first_token is None:
                        request.first_token = now
                        self._queued -= 1
                        self.metrics.ttft.observe(now - request.arrival)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                yield choice, update
        finally:
            for task in tasks:
                task.cancel()
            request.cancel()  # a no-op for settled generations

    def finish(self, request: Job, endpoint: str) -> None:
        """Account for a request that ended (whatever way)."""
        if request in self._live:
            self._live.discard(request)
            if request.first_token is None:
                self._queued -= 1
            reasons = {choice.finish_reason for choice in request.choices}
            for reason in reasons:
                label = FINISH_REASONS.get(reason, "error") if reason else "abort"
                self.metrics.requests.labels(endpoint=endpoint, finish_reason=label).inc()
            self.metrics.e2e.observe(time.perf_counter() - request.arrival)

    def cancel_all(self) -> None:
        for request in list(self._live):
            request.cancel()

    def load(self) -> tuple[int, int]:
        """(requests generating, requests waiting for their first token)."""
        return len(self._live) - self._queued, self._queued

    @staticmethod
    def _record(choice: Choice, update: GenerationUpdate) -> None:
        choice.tokens.extend(update.tokens)
        choice.text.append(update.text)
        choice.logprobs.extend(update.logprobs)
        if update.prompt_logprobs:
            choice.prompt_logprobs = update.prompt_logprobs
        if update.finish_reason is not None:
            choice.finish_reason, choice.error = update.finish_reason, update.error


async def until_disconnected(
    work: asyncio.Future[Any], disconnected: Callable[[], object], every: float = 0.1
) -> bool:
    """Wait for `work`; True if the client left first (then `work` is left running)."""
    while not work.done():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(work), every)
        if not work.done() and await disconnected():  # type: ignore[misc]
            return True
    return False
