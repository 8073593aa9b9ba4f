"""Request bodies of the OpenAI API (https://platform.openai.com/docs/api-reference), as pydantic models.

Types are strict (a string is not a number), unknown fields are ignored as OpenAI ignores them, and
ranges follow OpenAI's reference. vLLM's extensions that users rely on (top_k, min_p, ignore_eos,
stop_token_ids) are accepted too.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


class _SamplingFields(BaseModel):
    model_config = _STRICT
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    n: Annotated[int, Field(ge=1, le=128)] = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("n > 1 is not supported yet")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported yet; only 0 is accepted")
        return v


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, a list of strings, token ids or lists of token ids;
    each prompt is one choice. ``max_tokens`` defaults to 16 as in OpenAI."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    @field_validator("echo", "logprobs")
    @classmethod
    def _unsupported(cls, v):
        if v not in (False, None):
            raise ValueError("echo and logprobs are not supported yet")
        return v


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``max_tokens`` defaults to the room left in the context."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("logprobs are not supported yet")
        return v
