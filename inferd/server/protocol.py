"""Request bodies of the OpenAI API (https://platform.openai.com/docs/api-reference), as pydantic models.

Types are strict (a string is not a number), unknown fields are ignored as OpenAI ignores them, and
ranges follow OpenAI's reference. vLLM's extensions that users rely on (top_k, min_p, ignore_eos,
stop_token_ids) are accepted too.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# A logit_bias key: a token id written in decimal (a vocabulary's ids have at most 18 digits).
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,18}")

TOOLS_UNSUPPORTED = ("tool calling is not supported (this server does not parse tool calls); leave out tools and "
                     "tool_choice, or send tool_choice \"none\"")
_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # NaN and +-Infinity: "a finite number"


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


class _SamplingFields(BaseModel):
    model_config = _STRICT
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    n: Annotated[int, Field(ge=1, le=16)] = 1
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """A field sent as null takes its default, as in OpenAI's API (``"temperature": null`` is 1): the fields
        with a default other than None would otherwise refuse null."""
        if isinstance(data, dict) and None in data.values():
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}
        return data

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v, info):  # OpenAI answers such a request with a 400 too
        if v is not None and not info.data.get("stream", False):
            raise PydanticCustomError("stream_options", "only allowed when stream is true")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, v):
        if v is not None:
            for k in v:  # ASCII digits only, and few enough for int() ("²" is a digit to str.isdigit, not to int())
                if _TOKEN_ID_KEY.fullmatch(k) is None:
                    raise ValueError(f"keys must be token ids, got {k[:40]!r}")
        return v


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, a list of strings, token ids or lists of token ids;
    each prompt gives ``n`` choices. ``max_tokens`` defaults to 16 as in OpenAI, lowered to the room a
    prompt's context leaves (as vLLM does); 0 scores the prompt
    only (with ``echo`` and ``logprobs``). ``logprobs`` is the integer form (0..5 top tokens). ``suffix`` and a
    ``best_of`` other than ``n`` are refused (vLLM refuses them too): they would be ignored otherwise."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    suffix: str | None = None  # refused if given: no insertion
    best_of: Annotated[int, Field(ge=1, le=16)] | None = None  # refused unless it is n: no extra candidates


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message. ``content`` may be left out of an assistant message only (OpenAI's API requires it of the
    others); an empty string is content."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, v):
        if v:
            raise PydanticCustomError("tool_calls", TOOLS_UNSUPPORTED)
        return v

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing", "a {role} message needs content", {"role": self.role})
        return self


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``max_tokens`` defaults to the room left in the context. ``tools`` are accepted
    only with ``tool_choice: "none"`` (and then not shown to the model), ``functions`` only with ``function_call:
    "none"``, and no message may carry ``tool_calls``: the server does not parse tool calls."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None  # the deprecated form of tools
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): ``prompt`` or chat ``messages``."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings. ``input``: a string, a list of strings, token ids or lists of token ids;
    one embedding per item, in input order. ``encoding_format`` ``float`` or ``base64`` (little-endian
    float32, as OpenAI's client decodes it); ``dimensions`` must be the model's own if given."""

    model_config = _STRICT
    model: str
    input: Any

    @field_validator("input")
    @classmethod
    def _input_shape(cls, v):
        def ids(x) -> bool:
            return isinstance(x, list) and 0 < len(x) and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in x)

        if isinstance(v, str):
            return v
        if isinstance(v, list) and 0 < len(v) <= 2048 and (
                all(isinstance(x, str) for x in v) or ids(v) or all(ids(x) for x in v)):
            return v
        raise ValueError("must be a string, a list of 1-2048 strings, a list of token ids, or a list of 1-2048 "
                         "non-empty lists of token ids (ids in [0, 2^31))")

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
