"""From OpenAI requests to plans: token prompts and a `GenConfig` for each.

Owns: `RequestPlanner`, which turns a validated request into what runs (completion
prompts, or chat messages through the template with the tools offered; the sampling,
token rules, constraint and stopping of each generation), the grammar that holds a
`required` or named tool_choice to the calls, the format tool calls are offered and
read in, how answers' reasoning is told apart (the parser, and whether each prompt
opened the reasoning), and `/tokenize` and `/detokenize`.
Promises: every problem a request can have by itself (a prompt longer than the
context, a token outside the vocabulary, too many choices, bad stop strings, a
tool_choice without its tool, a tool schema the grammar library rejects) is an
`ApiError` with the status, message and parameter, before anything runs.
Never: starts, follows or cancels generations (the service does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cellbatch.generation_config import Constraint, GenConfig, SamplingParams
from cellbatch.reasoning import ReasoningFormat, reasoning_for_template, reasoning_named
from cellbatch.server.answers import AnswerReading
from cellbatch.server.api import ApiError, Backend, Plan
from cellbatch.server.protocol import (
    TOKEN_KEY,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    ToolDefinition,
    ToolMessage,
)
from cellbatch.server.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeMessages,
    TokenizeRequest,
    TokenizeResponse,
)
from cellbatch.text_stream import check_stop_strings
from cellbatch.tool_calls.calls import Tool, ToolChoice, ToolMode
from cellbatch.tool_calls.formats import ToolFormat, format_for_template, format_named
from cellbatch.tool_calls.prompt import conversation
from cellbatch.types import InvalidArgumentError, Token

if TYPE_CHECKING:
    from cellbatch.model.tokenizer import Tokenizer


# A prompt's last tokens, enough to hold the reasoning tags a template ends it with.
PROMPT_TAIL_TOKENS = 16
# The chat template call's own arguments, which `chat_template_kwargs` may not set.
TEMPLATE_CALL_NAMES = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "return_dict",
     "continue_final_message", "chat_template", "documents", "tokenizer_kwargs"}
)  # fmt: skip


class RequestPlanner:
    def __init__(
        self,
        backend: Backend,
        tool_call_parser: str | None = None,
        reasoning_parser: str = "auto",
    ) -> None:
        self.backend = backend
        self.context_limit = int(backend.shape.max_session_tokens or 0)
        # The format tool calls are offered and read in: the flag's, else the template's.
        template = backend.tokenizer.chat_template_text if backend.tokenizer else ""
        self.tool_format: ToolFormat = (
            format_named(tool_call_parser) if tool_call_parser else format_for_template(template)
        )
        # How reasoning is told apart: the flag's parser, none, or the template's.
        self.reasoning: ReasoningFormat | None = (
            reasoning_for_template(template)
            if reasoning_parser == "auto"
            else None
            if reasoning_parser == "none"
            else reasoning_named(reasoning_parser)
        )

    def plan_completion(self, request: CompletionRequest) -> Plan:
        prompts = self.token_prompts(request.prompt)
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
        tools, choice = self._tool_choice(request.tools, request.tool_choice)
        offered = tools if choice.mode is not ToolMode.NONE else []
        prompt = self._chat_prompt(request.messages, offered, True, request.chat_template_kwargs)
        top = request.top_logprobs if request.logprobs else None
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(
                400, "top_logprobs needs logprobs: true", "top_logprobs", code="logprobs_needed"
            )
        if request.logprobs and top is None:
            top = 0
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens == 0:
            raise ApiError(400, "max_tokens must be at least 1", "max_tokens")
        tool_constraint = None
        if offered:
            tool_constraint = self._tool_constraint(offered, choice, request)
        sampling = self._sampling(request, top, tool_constraint)
        config = self._config(request, prompt, max_tokens, sampling, "messages")
        # An answer held to a constraint from its first token (but for tool_choice auto,
        # whose grammar takes any text first) has no reasoning: it is all content.
        free = sampling.constraint is None or (offered and choice.mode is ToolMode.AUTO)
        reasoning = self.reasoning if free else None
        reading = AnswerReading(
            reasoning,
            reasoning is not None and reasoning.opened_by(self._prompt_tail(prompt)),
            self.tool_format if offered else None,
            request.parallel_tool_calls,
        )
        return Plan([prompt], [config], request.n, logprobs=top, reading=reading)

    def _prompt_tail(self, prompt: Sequence[Token]) -> str:
        tokenizer = self._tokenizer("read the prompt")
        return tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)

    def _chat_prompt(
        self,
        messages: Sequence[ChatMessage | ToolMessage],
        tools: list[Tool],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[Token]:
        """The conversation through the chat template, the offered tools and the
        request's `chat_template_kwargs` with it."""
        taken = sorted(set(template_kwargs or ()) & TEMPLATE_CALL_NAMES)
        if taken:
            raise ApiError(
                400,
                f"chat_template_kwargs may not set {', '.join(taken)}: the server sets "
                "them from the request's own fields",
                "chat_template_kwargs",
            )
        tokenizer = self._tokenizer("apply the chat template")
        if not tokenizer.has_chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        turns, template_tools = conversation(
            [message.as_template_message() for message in messages],
            tools,
            self.tool_format,
            tokenizer.takes_tools,
        )
        try:
            return tokenizer.apply_chat_template(
                turns, add_generation_prompt, template_tools, template_kwargs
            )
        except Exception as error:  # the template rejected the conversation
            raise ApiError(
                400,
                f"the chat template refused the messages: {error}",
                "messages",
                code="template_refused",
            ) from error

    @staticmethod
    def _tool_choice(
        definitions: list[ToolDefinition] | None,
        asked: str | NamedToolChoice | None,
    ) -> tuple[list[Tool], ToolChoice]:
        """The request's tools and how they may be called (OpenAI's defaults: auto with
        tools, none without)."""
        tools = [
            Tool(
                d.function.name,
                d.function.description or "",
                d.function.parameters or {"type": "object", "properties": {}},
            )
            for d in definitions or ()
        ]
        names = [tool.name for tool in tools]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ApiError(
                400, f"tools name {repeated[0]!r} more than once", "tools", code="invalid_tools"
            )
        if isinstance(asked, NamedToolChoice):
            choice = ToolChoice(ToolMode.FUNCTION, asked.function.name)
            if choice.name not in names:
                raise ApiError(
                    400,
                    f"tool_choice names the function {choice.name!r}, which is not among "
                    f"the tools ({', '.join(names) or 'none given'})",
                    "tool_choice",
                    code="unknown_tool",
                )
        else:
            choice = ToolChoice(ToolMode(asked or ("auto" if tools else "none")))
        if choice.mode is not ToolMode.NONE and not tools:
            raise ApiError(
                400,
                f"tool_choice {choice.mode.value!r} needs tools; give them",
                "tool_choice",
                code="unknown_tool",
            )
        return tools, choice

    def _tool_constraint(
        self, tools: list[Tool], choice: ToolChoice, request: ChatCompletionRequest
    ) -> Constraint:
        """The grammar the answer is held to, compiled now so that a schema the library
        rejects is a 400: calls alone (required, or one call of the named function), or
        text or calls (auto: a call the model makes still fits its tool)."""
        try:
            asked = request.constraint()
        except ValueError:
            asked = None  # _sampling says what is wrong with it
        if asked is not None:
            raise ApiError(
                400,
                f"{asked[1]} and tools (tool_choice {choice.mode.value!r}) cannot both hold "
                "the answer; drop one, or send tool_choice 'none'",
                asked[1].partition(".")[0],
                code="invalid_constraint",
            )
        named = choice.mode is ToolMode.FUNCTION
        called = [tool for tool in tools if not named or tool.name == choice.name]
        tokenizer = self._tokenizer("hold calls to a grammar")
        special = {
            marker: token
            for marker in self.tool_format.special_markers
            if (token := tokenizer.special_token_id(marker)) is not None
        }
        parallel = not named and request.parallel_tool_calls
        free_text = choice.mode is ToolMode.AUTO
        try:
            grammar = self.tool_format.grammar(called, parallel, special, free_text)
            constraint = Constraint.grammar(grammar)
            self.backend.check_constraint(constraint)
        except InvalidArgumentError as error:
            raise ApiError(
                400, f"the tools' schemas: {error}", "tools", code="invalid_tools"
            ) from error
        return constraint

    def token_prompts(self, prompt: object, param: str = "prompt") -> list[list[Token]]:
        """The token prompts of a completion's `prompt` (or an embedding's `input`,
        named by `param`): a string, token ids, or a list of either; each checked
        against the vocabulary."""
        if isinstance(prompt, str):
            texts: list[str | list[int]] = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            texts = [list(prompt)]
        else:
            texts = list(prompt)  # type: ignore[call-overload]
        if not texts:
            raise ApiError(400, f"{param} is empty", param)
        prompts = []
        for text in texts:
            tokens = self._tokenizer("encode text").encode(text) if isinstance(text, str) else text
            if not tokens:
                raise ApiError(
                    400, f"an item of {param} is empty: it must hold at least one token", param
                )
            vocab = self.backend.vocab_size
            if any(not 0 <= t < vocab for t in tokens):
                raise ApiError(400, f"a token id is outside the vocabulary [0, {vocab})", param)
            prompts.append(list(tokens))
        return prompts

    def _sampling(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        top: int | None,
        constraint: Constraint | None = None,
    ) -> SamplingParams:
        """The request's sampling; `constraint` is the tools' grammar, when one holds
        the answer (the request then gives no other)."""
        try:
            asked = request.constraint()
        except ValueError as error:  # InvalidArgumentError among them
            raise ApiError(400, str(error), "response_format", code="invalid_constraint") from error
        if asked is not None:
            constraint, field = asked
            try:
                self.backend.check_constraint(constraint)
            except InvalidArgumentError as error:
                raise ApiError(
                    400, str(error), field.partition(".")[0], code="invalid_constraint"
                ) from error
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
        asked = request.root
        if isinstance(asked, TokenizeMessages):
            tools, _ = self._tool_choice(asked.tools, None)
            tokens = self._chat_prompt(
                asked.messages, tools, asked.add_generation_prompt, asked.chat_template_kwargs
            )
        else:
            tokens = tokenizer.encode(asked.prompt, asked.add_special_tokens)
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
                if not TOKEN_KEY.fullmatch(key) or int(key) >= vocab:
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
        new_tokens = max_tokens if max_tokens is not None else room
        if 0 < new_tokens < request.min_tokens:
            raise ApiError(
                400,
                f"min_tokens ({request.min_tokens}) is above the {new_tokens} new tokens this "
                "request may generate; lower min_tokens or raise max_tokens",
                "min_tokens",
                code="min_tokens_above_max_tokens",
            )
        try:
            return GenConfig(
                max_new_tokens=new_tokens,
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
