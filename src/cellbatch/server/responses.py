"""OpenAI response bodies and stream chunks from finished or streaming jobs.

Owns: the shapes of what `/v1/completions` and `/v1/chat/completions` answer:
choices, finish reasons, usage (with prefix-cache hits as cached tokens), logprobs
in both APIs' formats, echoed prompts, the stream's role, content, finish and
usage chunks, and (tools offered) answers split into content and `tool_calls` with
`finish_reason: "tool_calls"`, streamed as `delta.tool_calls` whose arguments grow;
(a reasoning parser on) the reasoning as `reasoning_content`, streamed as its own deltas.
Promises: a choice's streamed text concatenates to its whole text; logprobs align
with the tokens shown; with `echo` the prompt (and its logprobs, the first token's
being null) comes first; with `max_tokens: 0` nothing generated is shown; call markup
never reaches `content` (a malformed call stays there, as written).
Never: runs or cancels generations (the service does).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from cellbatch.server.answers import AnswerStream, whole_answer
from cellbatch.server.api import FINISH_REASONS, ApiError, Backend, Choice, Plan
from cellbatch.server.protocol import FunctionCall, ToolCallMessage
from cellbatch.server.reply_bodies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunction,
    DeltaToolCall,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from cellbatch.server.service import Job
from cellbatch.types import FinishReason, GenerationUpdate, Token, TokenLogprob


class Responses:
    def __init__(self, backend: Backend, model_name: str) -> None:
        self.backend = backend
        self.model_name = model_name

    def failure(self, job: Job) -> ApiError | None:
        for choice in job.choices:
            if choice.finish_reason is FinishReason.FAILED:
                return ApiError(500, f"generation failed: {choice.error}", kind="server_error")
        return None

    def usage(self, job: Job) -> Usage:
        plan = job.plan
        completion = sum(0 if plan.drop_generated else len(choice.tokens) for choice in job.choices)
        prompt = sum(len(p) for p in plan.prompts)
        cached = sum(
            choice.handle.metrics().cached_tokens
            for choice in job.choices
            if choice.index % plan.n == 0
        )
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def completion_body(self, job: Job) -> CompletionResponse:
        choices = []
        for choice in job.choices:
            text, logprobs = self._completion_text(job.plan, choice)
            choices.append(
                CompletionChoice(
                    index=choice.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=self._finish(choice, job.plan),
                )
            )
        return CompletionResponse(model=self.model_name, choices=choices, usage=self.usage(job))

    def chat_body(self, job: Job) -> ChatCompletionResponse:
        choices = []
        for choice in job.choices:
            message = self._message(choice, job.plan)
            choices.append(
                ChatChoice(
                    index=choice.index,
                    message=message,
                    logprobs=self._chat_logprobs(choice.logprobs, job.plan),
                    finish_reason=self._finish(choice, job.plan, bool(message.tool_calls)),
                )
            )
        return ChatCompletionResponse(model=self.model_name, choices=choices, usage=self.usage(job))

    @staticmethod
    def _message(choice: Choice, plan: Plan) -> AssistantMessage:
        """The answer: its reasoning split off, and content and calls when tools were
        offered."""
        answer = whole_answer(plan.reading, "".join(choice.text))
        return AssistantMessage(
            content=answer.content,
            reasoning_content=answer.reasoning,
            tool_calls=[
                ToolCallMessage(
                    id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments)
                )
                for call in answer.calls
            ],
        )

    def completion_chunk(
        self, job: Job, stream_id: str, choice: Choice, update: GenerationUpdate
    ) -> CompletionResponse:
        """A stream chunk for one update; a choice's first chunk carries the echoed
        prompt (and its logprobs) in front."""
        plan = job.plan
        text = "" if plan.drop_generated else update.text
        entries = self._scored(update.tokens, update.logprobs, plan)
        if plan.echo and not choice.echoed:
            choice.echoed = True
            prompt = plan.prompts[choice.prompt_index]
            text = self._decode(prompt) + text
            entries = [*_prompt_scores(prompt, choice.prompt_logprobs), *entries]
        logprobs = None
        if plan.logprobs is not None:
            logprobs = self._completion_logprobs(entries, plan.logprobs, choice.offset)
            choice.offset += sum(len(piece) for piece in logprobs.tokens)
        reason = self._finish(choice, plan) if update.finish_reason is not None else None
        return CompletionResponse(
            id=stream_id,
            model=self.model_name,
            choices=[
                CompletionChoice(
                    index=choice.index, text=text, logprobs=logprobs, finish_reason=reason
                )
            ],
        )

    def chat_chunk(
        self,
        stream_id: str,
        created: int,
        choice: Choice,
        update: GenerationUpdate | None,
        plan: Plan,
    ) -> ChatCompletionChunk:
        """The role chunk (update None), or a content chunk, or the finish chunk."""
        if update is None:
            delta, logprobs, reason = ChatDelta(role="assistant", content=""), None, None
        else:
            delta = self._delta(choice, update, plan)
            logprobs = (
                self._chat_logprobs(list(update.logprobs), plan)
                if plan.logprobs is not None and update.logprobs
                else None
            )
            called = choice.answer_stream is not None and choice.answer_stream.made_calls
            reason = (
                self._finish(choice, plan, called) if update.finish_reason is not None else None
            )
        return ChatCompletionChunk(
            id=stream_id,
            created=created,
            model=self.model_name,
            choices=[
                ChatChunkChoice(
                    index=choice.index, delta=delta, logprobs=logprobs, finish_reason=reason
                )
            ],
        )

    def usage_chunk(
        self, job: Job, stream_id: str, created: int, chat: bool
    ) -> ChatCompletionChunk | CompletionResponse:
        usage = self.usage(job)
        if chat:
            return ChatCompletionChunk(
                id=stream_id, created=created, model=self.model_name, choices=[], usage=usage
            )
        return CompletionResponse(id=stream_id, model=self.model_name, choices=[], usage=usage)

    @staticmethod
    def _delta(choice: Choice, update: GenerationUpdate, plan: Plan) -> ChatDelta:
        """The update's text as a delta: reasoning, content, and call pieces when tools
        were offered."""
        if choice.answer_stream is None:
            choice.answer_stream = AnswerStream(plan.reading)
        read = choice.answer_stream.feed(update.text, update.finish_reason is not None)
        calls = [
            DeltaToolCall(
                index=piece.index,
                id=piece.id,
                type="function" if piece.id is not None else None,
                function=DeltaFunction(name=piece.name, arguments=piece.arguments),
            )
            for piece in read.calls
        ]
        return ChatDelta(
            content=read.content or None,
            reasoning_content=read.reasoning or None,
            tool_calls=calls or None,
        )

    @staticmethod
    def new_stream_id(chat: bool) -> str:
        return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _finish(self, choice: Choice, plan: Plan, called: bool = False) -> str | None:
        """OpenAI's finish reason; "tool_calls" for an answer that ended with calls."""
        if choice.finish_reason is None:
            return None
        if plan.drop_generated:
            return "length"
        reason = FINISH_REASONS.get(choice.finish_reason, "error")
        return "tool_calls" if called and reason == "stop" else reason

    def _completion_text(self, plan: Plan, choice: Choice) -> tuple[str, CompletionLogprobs | None]:
        text = "" if plan.drop_generated else "".join(choice.text)
        entries = self._scored(choice.tokens, choice.logprobs, plan)
        if plan.echo:
            prompt = plan.prompts[choice.prompt_index]
            text = self._decode(prompt) + text
            entries = [*_prompt_scores(prompt, choice.prompt_logprobs), *entries]
        if plan.logprobs is None:
            return text, None
        return text, self._completion_logprobs(entries, plan.logprobs, 0)

    def _completion_logprobs(
        self, entries: Sequence[tuple[Token, TokenLogprob | None]], top: int, offset: int
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for token, scored in entries:
            piece = self._token_text(token)
            result.tokens.append(piece)
            result.text_offset.append(offset)
            offset += len(piece)
            if scored is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                result.token_logprobs.append(scored.logprob)
                result.top_logprobs.append(
                    {self._token_text(t): lp for t, lp in scored.top[:top]} if top else {}
                )
        return result

    def _chat_logprobs(self, scored: Sequence[TokenLogprob], plan: Plan) -> ChatLogprobs | None:
        if plan.logprobs is None:
            return None
        content = []
        for entry in scored:
            piece = self._token_text(entry.token)
            content.append(
                ChatTokenLogprob(
                    token=piece,
                    logprob=entry.logprob,
                    bytes=list(piece.encode()),
                    top_logprobs=[
                        TopLogprob(
                            token=(p := self._token_text(t)), logprob=lp, bytes=list(p.encode())
                        )
                        for t, lp in entry.top[: plan.logprobs]
                    ],
                )
            )
        return ChatLogprobs(content=content)

    @staticmethod
    def _scored(
        tokens: Sequence[Token], logprobs: Sequence[TokenLogprob], plan: Plan
    ) -> list[tuple[Token, TokenLogprob | None]]:
        """Generated tokens with their logprobs, when the request shows them."""
        if plan.drop_generated or plan.logprobs is None:
            return []
        return list(zip(tokens, logprobs, strict=True))

    def _decode(self, tokens: Sequence[Token]) -> str:
        return self.backend.decode(tokens)

    def _token_text(self, token: Token) -> str:
        tokenizer = self.backend.tokenizer
        if tokenizer is None:
            return str(token)
        return tokenizer.decode([token], skip_special_tokens=False)


def _prompt_scores(
    prompt: Sequence[Token], scores: Sequence[TokenLogprob | None]
) -> list[tuple[Token, TokenLogprob | None]]:
    """Prompt tokens with their logprobs; tokens the generation did not score (the
    first, say) get None."""
    padded = [None] * (len(prompt) - len(scores)) + list(scores)
    return list(zip(prompt, padded, strict=True))
