"""What the API translations share (the OpenAI Responses API, the Anthropic Messages
API): each turns its request into chat messages and sampling fields, then runs them
through the chat route's own machinery (chat template render in the tokenizer pool,
SamplingParams with the model's generation defaults, the engine, disconnect and deadline
handling); only the request and response shapes are theirs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from fastapi import Request

from kvflow.engine.async_client import AsyncEngine
from kvflow.entrypoints.openai.chat_tools import ChatTools
from kvflow.entrypoints.openai.server_args import ServerArgs
from kvflow.entrypoints.openai.structured import constraint_limits
from kvflow.entrypoints.openai.serving import (OpenAIServing, chain_first, last_output,
                                               random_id, run_until_disconnect,
                                               until_deadline)
from kvflow.entrypoints.openai.serving_chat import ChatServing
from kvflow.errors import InvalidParameterError, RequestFailedError
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

# What OpenAIServing.sampling_params reads from a chat request, at the chat route's
# defaults; a translation overrides the fields its API has.
_CHAT_DEFAULTS: dict[str, Any] = dict(
    n=1, temperature=None, top_p=None, top_k=None, min_p=None, presence_penalty=None,
    frequency_penalty=None, repetition_penalty=None, seed=None, stop=None,
    stop_token_ids=None, ignore_eos=False, min_tokens=0, logit_bias=None,
    skip_special_tokens=True, spaces_between_special_tokens=True,
    include_stop_str_in_output=False, stream=False, repetition_guard=None)


def sampling_fields(**fields: Any) -> SimpleNamespace:
    unknown = set(fields) - set(_CHAT_DEFAULTS)
    assert not unknown, unknown
    return SimpleNamespace(**{**_CHAT_DEFAULTS, **fields})


class _Dumped(dict):
    """A plain dict where ChatTools expects a request model (it calls model_dump)."""

    def model_dump(self, **_: Any) -> dict:
        return dict(self)


def openai_tool(name: str, description: str | None, parameters: dict | None) -> dict:
    """A function tool in the chat route's (OpenAI chat's) shape."""
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def chat_tools(tokenizer, args: ServerArgs, tools: list[dict] | None,
               tool_choice: str | None = None, function: str | None = None,
               parallel: bool | None = None) -> ChatTools:
    """The chat route's tool machinery for translated tools (``openai_tool`` dicts):
    ``tool_choice`` none, auto or required, or ``function``: that function's call forced.
    plan_tools' errors name the fields ``tools`` and ``tool_choice``."""
    choice: Any = tool_choice
    if function is not None:
        choice = _Dumped({"type": "function", "function": {"name": function}})
    return ChatTools(tokenizer, args, SimpleNamespace(
        tools=[_Dumped(t) for t in tools] if tools else None, tool_choice=choice,
        parallel_tool_calls=parallel))


def tool_call_message(calls: list[tuple[str, str, str]], text: str = "") -> dict:
    """An assistant turn of tool calls, (call id, name, arguments JSON text) each, as the
    chat route's history carries it."""
    return {"role": "assistant", "content": text, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
        for cid, name, args in calls]}


@dataclass
class Generation:
    """One started request: its id, prompt token ids and outputs. For a stream,
    ``first`` is the first output (already read, so errors before any output still get
    a status code) and ``outputs()`` yields it and the rest, bounded by the deadline;
    otherwise ``first`` is the final output."""

    request_id: str
    prompt_ids: list[int]
    first: RequestOutput
    gen: AsyncIterator[RequestOutput] | None
    deadline: float | None
    clamped: bool = False
    """max_tokens was lowered to the room the context had left."""
    tools: ChatTools | None = None

    def parser(self):
        """A parser of one sample's text into content and tool calls (ChoiceParser), or
        None when the text is all content."""
        return self.tools.choice_parser() if self.tools is not None else None

    @staticmethod
    def delta(parser, c: CompletionOutput) -> dict:
        """One streamed output of a sample as a chat delta: its text as content, or what
        ``parser`` (from ``parser()``) makes of it (content, reasoning, tool calls),
        flushed at the sample's end."""
        if parser is None:
            return {"content": c.text} if c.text else {}
        return parser.finish(c.text) if c.finish_reason is not None else parser.feed(c.text)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        assert self.gen is not None
        async for ro in until_deadline(chain_first(self.first, self.gen), self.deadline):
            yield ro

    async def close(self) -> None:
        if self.gen is not None:
            await self.gen.aclose()


class TranslatedServing(OpenAIServing):
    """Base of a route that speaks another API over the chat route's machinery."""

    id_prefix = "req"

    def __init__(self, engine: AsyncEngine, served_model_name: str, args: ServerArgs,
                 chat: ChatServing) -> None:
        super().__init__(engine, served_model_name, args)
        self.chat = chat

    def check_tokenizer(self, param: str) -> None:
        if self.engine.tokenizer is None:
            raise InvalidParameterError("this model has no tokenizer, so it cannot chat; use "
                                        "/v1/completions with token ids", param=param)

    async def render(self, messages: list[dict], template_kwargs: dict | None = None,
                     prefill: str | None = None) -> tuple[str, list[int]]:
        """The chat template's prompt for ``messages``; ``prefill``: the start of the
        assistant's answer, which the model continues (Anthropic's trailing assistant
        message)."""
        text, ids = await self.chat.render(messages, True, template_kwargs)
        if prefill:
            text += prefill
            ids = await self.engine.run_in_pool(self.engine.tokenizer.encode, text, False)
        return text, ids

    def params(self, stream: bool, max_tokens: int | None,
               constraint: StructuredOutputsParams | None = None, **fields: Any
               ) -> SamplingParams:
        params = self.sampling_params(sampling_fields(stream=stream, **fields),
                                      max_tokens=max_tokens, logprobs=None)
        params.structured_outputs = constraint
        return params

    def json_constraint(self, schema: dict | None, param: str) -> StructuredOutputsParams:
        """The output must be JSON following ``schema`` (None: any JSON object), through
        the structured-output engine; checked against the server's limits (a 400 naming
        ``param``, before the engine)."""
        from kvflow.structured_output.check import check_constraint

        try:
            so = StructuredOutputsParams(json_object=True) if schema is None \
                else StructuredOutputsParams(json=schema)
        except InvalidParameterError as e:
            raise InvalidParameterError(e.message, param=param) from None
        check_constraint(so, constraint_limits(self.args.limits), param)
        return so

    async def generate(self, raw: Request, messages: list[dict], params: SamplingParams,
                       stream: bool, template_kwargs: dict | None = None,
                       request_id: str | None = None, clamp_max_tokens: bool = False,
                       prefill: str | None = None, tools: ChatTools | None = None
                       ) -> Generation:
        """Render ``messages``, submit them and wait for the first (stream) or the final
        output; a client that disconnects or a deadline that passes aborts the request.
        ``clamp_max_tokens``: a max_tokens past the context's room is lowered to it (for
        APIs where max_tokens is a required ceiling that clients set high), instead of
        refused. ``tools``: rendered into the prompt as the chat route does; the sampling
        changes they need applied to ``params``."""
        self.engine.check_ready()
        deadline = self.deadline()
        arrival = time.monotonic()
        if tools is not None:
            messages, template_kwargs = tools.template_input(messages, template_kwargs)
            params = tools.sampling_params(params)
        text, ids = await self.render(messages, template_kwargs, prefill)
        if tools is not None:
            tools.prompt = text
        room = self.engine.config.model.max_model_len - len(ids)
        clamped = (clamp_max_tokens and params.max_tokens is not None and room >= 1
                   and params.max_tokens > room)
        if clamped:
            params.max_tokens = room
        request_id = request_id or random_id(self.id_prefix)
        gen = self.engine.generate(request_id, {"prompt": text, "prompt_token_ids": ids},
                                   params, arrival_time=arrival)
        if stream:
            try:
                first = await run_until_disconnect(raw, gen.__anext__(), deadline)
            except BaseException:
                await gen.aclose()
                raise
            return Generation(request_id, ids, first, gen, deadline, clamped, tools)
        try:
            final = await run_until_disconnect(raw, last_output(gen), deadline)
        finally:
            await gen.aclose()
        return Generation(request_id, ids, final, None, deadline, clamped, tools)


def check_not_failed(c: CompletionOutput) -> None:
    """A sample the engine could not run ("error") is the server's failure, not the
    client's: a 500 in the API's own error shape."""
    if c.finish_reason == "error":
        raise RequestFailedError("the engine could not run this request and ended it; "
                                 "other requests go on")
