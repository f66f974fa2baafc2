"""Schemas of the Anthropic Messages API (``POST /v1/messages``,
``POST /v1/messages/count_tokens``), pydantic.

Requests are validated as strictly as the OpenAI routes' (unknown fields refused with
the field named); what Claude-Code-style clients send and kvflow cannot honour in
substance but can ignore harmlessly is accepted and documented as such (``cache_control``
markers: prefix caching is automatic; ``thinking``: no thinking blocks come back;
thinking blocks of earlier turns are dropped). Image and document blocks and server
tools are refused with a 400 naming the field.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt,
                      StrictStr, Tag, field_validator, model_validator)

from kvflow.entrypoints.openai.protocol import (INT32_MAX, Float, ShortStr, _Request,
                                                _Response)
from kvflow.entrypoints.openai.server_args import RequestLimits
from kvflow.entrypoints.tools import check_parameters_schema


class CacheControl(_Request):
    """Accepted and ignored: kvflow's prefix cache keeps every prefix it can."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Request):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: ShortStr
    name: ShortStr
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: ShortStr
    content: StrictStr | list[TextBlock] | None = None
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Request):
    """A thinking block of an earlier assistant turn: accepted and dropped."""

    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: StrictStr


class OtherBlock(BaseModel):
    """image, document, search_result, server tool blocks ...: refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: StrictStr

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"content blocks of type {self.type!r} are not supported (text, "
                         f"tool_use, tool_result)")


_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _block_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else None
    return f"[{kind}]" if kind in _BLOCKS else "[other]"


ContentBlock = Annotated[Annotated[TextBlock, Tag("[text]")]
                         | Annotated[ToolUseBlock, Tag("[tool_use]")]
                         | Annotated[ToolResultBlock, Tag("[tool_result]")]
                         | Annotated[ThinkingBlock, Tag("[thinking]")]
                         | Annotated[RedactedThinkingBlock, Tag("[redacted_thinking]")]
                         | Annotated[OtherBlock, Tag("[other]")], Discriminator(_block_kind)]


class Message(_Request):
    role: Literal["user", "assistant"]
    content: StrictStr | list[ContentBlock]


class Tool(_Request):
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Annotated[StrictStr, Field(max_length=65536)] | None = None
    input_schema: dict[str, Any]
    """A JSON Schema of type object (checked, at most 32 levels deep)."""
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_parameters_schema(value)


class OtherTool(BaseModel):
    """Anthropic's server and client tools (web_search_..., bash_..., text_editor_...)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: StrictStr

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"tools of type {self.type!r} are not supported; only custom "
                         f"tools (name, description, input_schema)")


def _tool_kind(value: Any) -> str:
    return "[custom]" if isinstance(value, dict) and value.get("type", "custom") == "custom" \
        else "[other]"


AnyTool = Annotated[Annotated[Tool, Tag("[custom]")] | Annotated[OtherTool, Tag("[other]")],
                    Discriminator(_tool_kind)]


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: ShortStr | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _name(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' is required with type 'tool' and only there")
        return self


class Thinking(_Request):
    """Accepted and ignored: no thinking blocks come back."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None


class JsonOutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class OutputConfig(_Request):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    """Accepted and ignored (a model without thinking has one effort)."""
    format: JsonOutputFormat | None = None


class Diagnostics(_Request):
    """Accepted and ignored (no cache-miss diagnostics come back)."""

    previous_message_id: ShortStr | None = None


class Metadata(_Request):
    user_id: Annotated[StrictStr, Field(max_length=256)] | None = None


@lru_cache(maxsize=8)
def anthropic_request_models(limits: RequestLimits = RequestLimits()) -> SimpleNamespace:
    """``.messages`` and ``.count_tokens`` for one set of limits."""
    lim = limits
    StopStr = Annotated[StrictStr, Field(min_length=1, max_length=lim.max_stop_length)]
    Messages = Annotated[list[Message], Field(min_length=1, max_length=lim.max_messages)]
    System = StrictStr | Annotated[list[TextBlock], Field(max_length=lim.max_messages)]
    Tools = Annotated[list[AnyTool], Field(max_length=128)]

    class CountTokensRequest(_Request):
        model: ShortStr
        messages: Messages
        system: System | None = None
        tools: Tools | None = None
        tool_choice: ToolChoice | None = None
        thinking: Thinking | None = None
        output_config: OutputConfig | None = None
        cache_control: CacheControl | None = None

    class MessagesRequest(CountTokensRequest):
        max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
        """A ceiling: lowered to the room the context has left (never refused for it)."""
        stop_sequences: Annotated[list[StopStr], Field(max_length=lim.max_stop)] | None = None
        temperature: Annotated[Float, Field(ge=0, le=1)] | None = None
        top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
        top_k: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = None
        """0: no limit."""
        metadata: Metadata | None = None
        stream: StrictBool = False
        # Accepted for compatibility with the official client; they change nothing here.
        service_tier: Literal["auto", "standard_only"] | None = None
        inference_geo: ShortStr | None = None
        speed: Literal["standard", "fast"] | None = None
        diagnostics: Diagnostics | None = None

    return SimpleNamespace(messages=MessagesRequest, count_tokens=CountTokensRequest)


# --- responses ----------------------------------------------------------------------

class Usage(_Response):
    _omit_if_none = ("cache_read_input_tokens",)

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None


class MessagesResponse(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use",
                         "model_context_window_exceeded"] | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(_Response):
    input_tokens: int


class ErrorDetail(_Response):
    type: str
    message: str


class AnthropicErrorResponse(_Response):
    type: Literal["error"] = "error"
    error: ErrorDetail
