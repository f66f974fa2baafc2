"""Request and response schemas of the OpenAI-compatible API (pydantic).

Requests accept the OpenAI parameters plus vLLM's well-known extensions (top_k, min_p,
repetition_penalty, ignore_eos, ...), validated strictly: no string-to-number or
bool-to-number coercion, OpenAI's ranges (temperature 0..2, penalties -2..2, ...), roles
from OpenAI's list, integers bounded to what the engine can carry, and bounds on lists and
strings that cost work per token (stop strings, samples, logit_bias entries). An unknown
parameter is refused with a 400 that names it, as OpenAI does. The bounds an operator may
want to move are RequestLimits (server options); the request models are built for one
set of limits (``request_models``), so /openapi.json describes the real constraints.
Responses follow OpenAI's shapes field by field.
"""

from __future__ import annotations

import time
from functools import lru_cache
from types import SimpleNamespace
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field,
                      StrictBool, StrictFloat, StrictInt, StrictStr, Tag, field_validator,
                      model_serializer, model_validator)

from kvflow.entrypoints.chat_utils import RESERVED_TEMPLATE_KWARGS
from kvflow.entrypoints.openai.structured import request_models as structured_models
from kvflow.entrypoints.openai.protocol_base import _Request
from kvflow.entrypoints.openai.server_args import RequestLimits
from kvflow.entrypoints.tools import check_parameters_schema
from kvflow.sampling_params import MAX_LOGPROBS, MAX_REPETITION_GUARD

# The longest chat template a request may bring (real templates are 1-10 KB).
MAX_CHAT_TEMPLATE_CHARS = 65536

# What the engine can carry: msgspec IPC and int64 tensors (seeds, priorities); token
# ids and token counts fit in 32 bits.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")
    # Optional fields left out of the JSON when None (extensions, stream deltas).
    _omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_nones(self, handler):
        data = handler(self)
        for name in self._omit_if_none:
            if name in data and data[name] is None:
                del data[name]
        return data


# --- requests -----------------------------------------------------------------------

Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]
def _integral(value: Any) -> Any:
    """1069.0 is an integer to JSON Schema (and so to the published schema): take it."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


TokenId = Annotated[StrictInt, BeforeValidator(_integral), Field(ge=0, le=INT32_MAX)]
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
ShortStr = Annotated[StrictStr, Field(max_length=1024)]


class StreamOptions(_Request):
    include_usage: StrictBool = False
    """Send a last chunk with the usage of the whole request (and ``usage: null`` before)."""
    include_obfuscation: StrictBool | None = None
    """Accepted for compatibility; no obfuscation padding is sent."""


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


def _part_kind(value: Any) -> str:
    return "[text]" if isinstance(value, dict) and value.get("type") == "text" else "[other]"


class OtherPart(BaseModel):
    """A content part that is not text (image_url, input_audio, file ...): refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: StrictStr

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"only text content parts are supported (type 'text'), got "
                         f"type {self.type!r}")


# (Tag names in brackets: error locations leave them out, see errors._validation_param.)
ContentPart = Annotated[Annotated[TextPart, Tag("[text]")]
                        | Annotated[OtherPart, Tag("[other]")], Discriminator(_part_kind)]
Role = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionCall(_Request):
    name: ShortStr
    arguments: StrictStr
    """The arguments as JSON text, as the model wrote them."""


class ToolCall(_Request):
    """A tool call of an earlier assistant turn (in the conversation history)."""

    id: ShortStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    # What _content_required checks, stated in the schema: content (not null), unless
    # an assistant message carries tool_calls.
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["role", "tool_calls"], "properties": {
            "role": {"const": "assistant"}, "tool_calls": {"type": "array",
                                                           "minItems": 1}}}]})
    role: Role
    content: StrictStr | list[ContentPart] | None = None
    """Text, or a list of text parts; null only for an assistant message with tool_calls."""
    name: ShortStr | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: ShortStr | None = None
    refusal: StrictStr | None = None
    reasoning_content: StrictStr | None = None

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (a string or a list of text parts); it "
                             "may be null only in an assistant message with tool_calls")
        return self


MAX_TOOLS = 128
"""Most tools (and most tool calls in one history message) per request: OpenAI's limit."""


class FunctionDefinition(_Request):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    """Letters, digits, underscores and dashes, at most 64 characters (OpenAI's rule)."""
    description: Annotated[StrictStr, Field(max_length=65536)] | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema of type object for the arguments (checked against the JSON Schema
    meta-schema; at most 32 levels deep). Left out: any object."""
    strict: StrictBool | None = None
    """Accepted; arguments of calls the grammar enforces (tool_choice "required" or a
    named function) always follow the schema."""

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_parameters_schema(value)


class ChatTool(_Request):
    type: Literal["function"]
    """Only function tools are served."""
    function: FunctionDefinition


class NamedFunction(_Request):
    name: ShortStr


class NamedToolChoice(_Request):
    """Force a call of this function (it must be one of ``tools``)."""

    type: Literal["function"]
    function: NamedFunction


def _check_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value:
        clash = sorted(set(value) & RESERVED_TEMPLATE_KWARGS)
        if clash:
            raise ValueError(f"may not set {', '.join(clash)} (the renderer's own "
                             f"arguments: {', '.join(sorted(RESERVED_TEMPLATE_KWARGS))})")
    return value


@lru_cache(maxsize=8)
def request_models(limits: RequestLimits = RequestLimits()) -> SimpleNamespace:
    """The request models for one set of limits: ``.completion``, ``.chat``,
    ``.tokenize`` (completion or chat form), ``.detokenize``."""
    lim = limits
    StopStr = Annotated[StrictStr, Field(min_length=1, max_length=lim.max_stop_length)]

    ResponseFormat, StructuredOutputs = structured_models(lim)
    TemplateKwargs = Annotated[dict[str, Any] | None, Field(
        description="extra variables for the chat template; may not set "
        + ", ".join(sorted(RESERVED_TEMPLATE_KWARGS)))]

    ChatTemplate = Annotated[StrictStr, Field(
        min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS,
        description="vLLM extension: a Jinja chat template (or the name of one of the "
        "model's templates) used for this request instead of the model's")]

    class SamplingRequest(_Request):
        """Parameters shared by completions and chat completions."""

        model: ShortStr | None = None
        n: Annotated[StrictInt, Field(ge=1, le=lim.max_n)] = 1
        temperature: Annotated[Float, Field(ge=0, le=2)] | None = None
        top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
        top_k: Annotated[StrictInt, Field(
            ge=-1, le=INT64_MAX, description="-1 or 0: no limit; at or above the "
            "vocabulary size: no limit")] | None = None
        min_p: Annotated[Float, Field(ge=0, le=1)] | None = None
        presence_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
        frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
        repetition_penalty: Annotated[Float, Field(gt=0, le=100)] | None = None
        seed: Int64 | None = None
        stop: StopStr | Annotated[list[StopStr], Field(max_length=lim.max_stop)] | None = None
        stop_token_ids: Annotated[list[TokenId], Field(max_length=lim.max_stop)] | None = None
        ignore_eos: StrictBool = False
        min_tokens: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] = 0
        stream: StrictBool = False
        stream_options: StreamOptions | None = None
        user: ShortStr | None = None
        logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                                   Annotated[Float, Field(ge=-100, le=100)]],
                              Field(max_length=lim.max_logit_bias)] | None = None
        skip_special_tokens: StrictBool = True
        spaces_between_special_tokens: StrictBool = True
        include_stop_str_in_output: StrictBool = False
        priority: Int64 = 0
        """kvflow/vLLM extension: lower values are served first (and preempted last)."""
        cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=1024)] | None = None
        """kvflow/vLLM extension: requests share cached prefix KV only with the same salt."""
        return_token_ids: StrictBool = False
        """kvflow/vLLM extension: add token_ids (and prompt_token_ids) to each choice."""
        structured_outputs: StructuredOutputs | None = None
        """kvflow/vLLM extension: constrain the output (json schema, regex, choice, grammar)."""
        repetition_guard: Annotated[StrictInt, Field(
            ge=0, le=MAX_REPETITION_GUARD)] | None = None
        """kvflow extension: end the answer (finish_reason stop, stop_reason repetition)
        once it ends in one block of tokens repeated 3 times over at least this many
        tokens; 0: off; unset: the server's default (see /v1/models)."""
        # Accepted for compatibility; they change nothing here.
        store: StrictBool | None = None
        metadata: Annotated[dict[Annotated[str, Field(max_length=64)],
                                 Annotated[StrictStr, Field(max_length=512)]],
                            Field(max_length=16)] | None = None
        service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
        prompt_cache_key: ShortStr | None = None
        safety_identifier: ShortStr | None = None

    TokenPrompt = Annotated[list[TokenId], Field(min_length=1)]

    Prompt = Annotated[StrictStr, Field(min_length=1)]  # an empty prompt is refused

    class CompletionRequest(SamplingRequest):
        prompt: (Prompt | Annotated[list[Prompt], Field(min_length=1,
                                                        max_length=lim.max_prompts)]
                 | TokenPrompt
                 | Annotated[list[TokenPrompt], Field(min_length=1,
                                                      max_length=lim.max_prompts)])
        max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = 16
        echo: StrictBool = False
        logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
        best_of: Annotated[StrictInt, Field(ge=1, le=lim.max_n)] | None = None
        suffix: StrictStr | None = None

    Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=lim.max_messages)]

    class ChatCompletionRequest(SamplingRequest):
        messages: Messages
        max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
        max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
        logprobs: StrictBool = False
        top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
        tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
        """Functions the model may call (rendered through the chat template)."""
        tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
        """none: no tools offered or parsed; auto (the default with tools): the model's
        calls are parsed; required: at least one call, and named: a call of that function,
        both enforced by the grammar engine so the arguments follow the schema."""
        parallel_tool_calls: StrictBool | None = None
        """false: at most one tool call per response (default true)."""
        response_format: ResponseFormat | None = None
        add_generation_prompt: StrictBool = True
        chat_template_kwargs: TemplateKwargs = None
        chat_template: ChatTemplate | None = None

        _kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)

    class TokenizeCompletionRequest(_Request):
        model: ShortStr | None = None
        prompt: StrictStr
        add_special_tokens: StrictBool = True

    class TokenizeChatRequest(_Request):
        model: ShortStr | None = None
        messages: Messages
        tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
        """Rendered as a chat request with these tools renders them."""
        add_generation_prompt: StrictBool = True
        chat_template_kwargs: TemplateKwargs = None

        _kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)

    def tokenize_kind(value: Any) -> str:
        return "[chat]" if isinstance(value, dict) and "messages" in value else "[completion]"

    TokenizeRequest = Annotated[
        Annotated[TokenizeCompletionRequest, Tag("[completion]")]
        | Annotated[TokenizeChatRequest, Tag("[chat]")], Discriminator(tokenize_kind)]

    class DetokenizeRequest(_Request):
        model: ShortStr | None = None
        tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]

    return SimpleNamespace(completion=CompletionRequest, chat=ChatCompletionRequest,
                           tokenize=TokenizeRequest, detokenize=DetokenizeRequest,
                           tokenize_completion=TokenizeCompletionRequest,
                           tokenize_chat=TokenizeChatRequest, sampling=SamplingRequest)


# --- responses ----------------------------------------------------------------------

class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    _omit_if_none = ("token_ids", "prompt_token_ids")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(_Response):
    name: str
    arguments: str


class ResponseToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(_Response):
    _omit_if_none = ("reasoning_content",)

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None
    """The model's thinking (with --reasoning-parser), apart from its answer."""


class ChatChoice(_Response):
    _omit_if_none = ("token_ids",)

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Response):
    _omit_if_none = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(_Response):
    _omit_if_none = ("name",)

    name: str | None = None
    arguments: str = ""


class DeltaToolCall(_Response):
    """A tool call in a stream: the first delta of a call has its id, type and name, the
    next ones add to its arguments (the same index)."""

    _omit_if_none = ("id", "type")

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    _omit_if_none = ("role", "content", "reasoning_content", "tool_calls")

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Response):
    _omit_if_none = ("token_ids",)

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvflow"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    # kvflow extensions: the sampling defaults applied to fields a request leaves out.
    generation_defaults: dict[str, float | int] | None = None
    generation_source: str | None = None
    max_tokens_default: int | None = None
    repetition_guard: int | None = None
    # Whether a request's outputs depend on what else shares its steps (batch-invariant
    # or batch-variant, and why), and the fingerprint responses carry (docs/determinism.md).
    determinism: str | None = None
    determinism_why: str | None = None
    system_fingerprint: str | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    """OpenAI's error body; the routes document their error statuses with it (the
    bodies themselves are written by errors.py)."""

    error: ErrorInfo
