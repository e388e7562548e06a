"""vLLM's `/tokenize` and `/detokenize` request and response shapes, as pydantic models.

Owns: the fields those routes read and answer with, as vLLM names them.
Promises: a tokenize request gives a prompt or chat messages (with the template's
options), never both or neither; a field of the wrong type fails validation (a 400
naming it).
Never: tokenizes (the planner does) or touches the engine.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator

from cellbatch.server.protocol import Message, TemplateKwargs, TokenId, ToolDefinition


class TokenizePrompt(BaseModel):
    """vLLM's `/tokenize` of a completion prompt."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str
    messages: None = None
    add_special_tokens: bool = True


class TokenizeMessages(BaseModel):
    """vLLM's `/tokenize` of chat messages, through the template."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: TemplateKwargs | None = None


class TokenizeRequest(RootModel[TokenizePrompt | TokenizeMessages]):
    """A prompt or messages (the other left out, or null)."""

    @model_validator(mode="before")
    @classmethod
    def _one_of_them(cls, body: Any) -> Any:
        if isinstance(body, dict) and (body.get("prompt") is None) == (
            body.get("messages") is None
        ):
            raise ValueError("give either prompt or messages, not both or neither")
        return body

    @property
    def model(self) -> str | None:
        return self.root.model


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
