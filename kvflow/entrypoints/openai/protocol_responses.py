"""Schemas of the OpenAI Responses API (``POST /v1/responses``), pydantic.

Requests are validated as strictly as chat requests (protocol.py): unknown fields and
unsupported features (built-in tools such as web_search, background mode, non-text
input parts) are refused with a 400 that names the field. Responses follow OpenAI's
shapes field by field, so the official client parses them into its own types.
"""

from __future__ import annotations

import time
from functools import lru_cache
from types import SimpleNamespace
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt,
                      StrictStr, Tag, field_validator, model_validator)

from kvflow.entrypoints.openai.protocol import (INT32_MAX, Float, Int64, ShortStr, _Request,
                                                _Response)
from kvflow.entrypoints.openai.server_args import RequestLimits
from kvflow.entrypoints.tools import check_parameters_schema


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class OtherInputPart(BaseModel):
    """input_image, input_file, input_audio, refusal ...: refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: StrictStr

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"only text content parts are supported (input_text, "
                         f"output_text), got type {self.type!r}")


def _part_kind(value: Any) -> str:
    return ("[text]" if isinstance(value, dict)
            and value.get("type") in ("input_text", "output_text") else "[other]")


InputPart = Annotated[Annotated[InputText, Tag("[text]")]
                      | Annotated[OtherInputPart, Tag("[other]")], Discriminator(_part_kind)]


class MessageItem(_Request):
    """A message: ``{"role", "content"}`` (the "easy" form) or with ``type: message``."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[InputPart]
    id: ShortStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(_Request):
    """A function call the model made earlier (sent back with its output)."""

    type: Literal["function_call"]
    call_id: ShortStr
    name: ShortStr
    arguments: StrictStr
    id: ShortStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: ShortStr
    output: StrictStr | list[InputPart]
    id: ShortStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class OtherItem(BaseModel):
    """reasoning, item_reference, built-in tool calls ...: refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: StrictStr

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"input items of type {self.type!r} are not supported (message, "
                         f"function_call, function_call_output)")


def _item_kind(value: Any) -> str:
    if not isinstance(value, dict):
        return "[message]"
    kind = value.get("type", "message")
    return f"[{kind}]" if kind in ("message", "function_call", "function_call_output") \
        else "[other]"


InputItem = Annotated[Annotated[MessageItem, Tag("[message]")]
                      | Annotated[FunctionCallItem, Tag("[function_call]")]
                      | Annotated[FunctionCallOutputItem, Tag("[function_call_output]")]
                      | Annotated[OtherItem, Tag("[other]")], Discriminator(_item_kind)]


class FunctionTool(_Request):
    type: Literal["function"]
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Annotated[StrictStr, Field(max_length=65536)] | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema of type object (checked, at most 32 levels deep)."""
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_parameters_schema(value)


class OtherTool(BaseModel):
    """web_search, file_search, code_interpreter, mcp ...: built-in tools, refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: StrictStr

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"built-in tools are not supported (type {self.type!r}); only "
                         f"function tools (type 'function')")


def _tool_kind(value: Any) -> str:
    return "[function]" if isinstance(value, dict) and value.get("type") == "function" \
        else "[other]"


Tool = Annotated[Annotated[FunctionTool, Tag("[function]")]
                 | Annotated[OtherTool, Tag("[other]")], Discriminator(_tool_kind)]


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: ShortStr


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[StrictStr, Field(max_length=64)] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    @model_validator(mode="after")
    def _schema_needed(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs its 'schema'")
        return self


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


@lru_cache(maxsize=8)
def responses_request_model(limits: RequestLimits = RequestLimits()) -> SimpleNamespace:
    lim = limits
    Items = Annotated[list[InputItem], Field(min_length=1, max_length=lim.max_messages)]

    class ResponsesRequest(_Request):
        model: ShortStr | None = None
        input: StrictStr | Items
        """Text (one user message) or a list of message and function-call items."""
        instructions: StrictStr | None = None
        """A system message put first; not carried over by previous_response_id."""
        max_output_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
        temperature: Annotated[Float, Field(ge=0, le=2)] | None = None
        top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
        top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] | None = None
        """kvflow/vLLM extension: -1 or 0: no limit."""
        seed: Int64 | None = None
        """kvflow/vLLM extension."""
        text: TextConfig | None = None
        tools: Annotated[list[Tool], Field(max_length=128)] | None = None
        tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
        parallel_tool_calls: StrictBool | None = None
        stream: StrictBool = False
        store: StrictBool = True
        """Keep the response (bounded, in memory) for GET /v1/responses/{id} and
        previous_response_id."""
        previous_response_id: ShortStr | None = None
        background: Literal[False] | None = None
        """Background mode is not supported: only false."""
        truncation: Literal["disabled"] | None = None
        """Only 'disabled': a conversation longer than the context is refused."""
        metadata: Annotated[dict[Annotated[str, Field(max_length=64)],
                                 Annotated[StrictStr, Field(max_length=512)]],
                            Field(max_length=16)] | None = None
        user: ShortStr | None = None
        service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
        prompt_cache_key: ShortStr | None = None
        safety_identifier: ShortStr | None = None

    return SimpleNamespace(responses=ResponsesRequest)


# --- responses ----------------------------------------------------------------------

class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOutput(_Response):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(_Response):
    cached_tokens: int = 0


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(_Response):
    code: str
    message: str


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage | FunctionCallOutput] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False
    usage: ResponseUsage | None = None
    user: str | None = None


class DeletedResponse(_Response):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
