"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API as a thin
translation onto the chat route.

``system`` and the messages' text blocks become chat messages, rendered with the model's
chat template; a trailing assistant message is a prefill the model continues. The answer
comes back as a message with content blocks, stop_reason (end_turn, max_tokens,
stop_sequence, model_context_window_exceeded) and usage, or streamed as Anthropic's
events (message_start, content_block_start, ping, content_block_delta..., content_block_stop,
message_delta, message_stop). Errors use Anthropic's shape (errors.py, installed for
these paths by the server).
"""

# No "from __future__ import annotations": the routes' body types are built per app and
# FastAPI must see them as objects.

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response

from kvflow.entrypoints.anthropic.errors import anthropic_error_sse
from kvflow.entrypoints.anthropic.protocol import (AnthropicErrorResponse,
                                                   CountTokensResponse, MessagesResponse,
                                                   Usage, anthropic_request_models)
from kvflow.entrypoints.openai.serving import ClientDisconnected, json_response, sse_response
from kvflow.entrypoints.translate import (Generation, TranslatedServing, chat_tools,
                                          check_not_failed, openai_tool, tool_call_message)
from kvflow.errors import InvalidParameterError, KvflowError
from kvflow.outputs import CompletionOutput

CLIENT_CLOSED = 499


def _sse(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def _text(blocks) -> str:
    return "\n".join(b.text for b in blocks if b.type == "text")


def stop_info(c: CompletionOutput, clamped: bool, called: bool = False
              ) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished sample."""
    if called and c.finish_reason == "stop":
        return "tool_use", None
    if c.finish_reason == "length":
        return ("model_context_window_exceeded" if clamped else "max_tokens"), None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


class MessagesServing(TranslatedServing):
    id_prefix = "msg"

    def check_request(self, req) -> None:
        self.check_tokenizer("messages")

    def tools(self, req):
        tools = [openai_tool(t.name, t.description, t.input_schema) for t in req.tools or []]
        tc = req.tool_choice
        kind = tc.type if tc is not None else None
        choice = {"any": "required", "tool": None}.get(kind, kind)
        parallel = False if tc is not None and tc.disable_parallel_tool_use else None
        return chat_tools(self.engine.tokenizer, self.args, tools, choice,
                          tc.name if kind == "tool" else None, parallel)

    def conversation(self, req) -> tuple[list[dict], str | None]:
        """(chat messages, prefill). tool_use blocks are the assistant turn's tool calls,
        tool_result blocks tool messages (before the user text beside them); a trailing
        assistant message of text is not a turn of its own but the start of the answer."""
        messages: list[dict] = []
        if req.system is not None:
            system = req.system if isinstance(req.system, str) else _text(req.system)
            messages.append({"role": "system", "content": system})
        for m in req.messages:
            if isinstance(m.content, str):
                messages.append({"role": m.role, "content": m.content})
                continue
            text = _text(m.content)
            if m.role == "assistant":
                calls = [(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
                         for b in m.content if b.type == "tool_use"]
                messages.append(tool_call_message(calls, text) if calls
                                else {"role": "assistant", "content": text})
                continue
            for b in m.content:
                if b.type == "tool_result":
                    content = b.content if isinstance(b.content, str) or b.content is None \
                        else _text(b.content)
                    content = content or ""
                    if b.is_error:
                        content = f"Error: {content}"
                    messages.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                     "content": content})
            if text or not any(b.type == "tool_result" for b in m.content):
                messages.append({"role": "user", "content": text})
        prefill = None
        if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
            prefill = messages.pop()["content"]
            if not any(m["role"] != "system" for m in messages):
                raise InvalidParameterError("the conversation needs a user message before a "
                                            "final assistant message", param="messages")
        return messages, prefill

    async def count_tokens(self, req) -> CountTokensResponse:
        self.engine.check_ready()
        self.check_model(req.model)
        self.check_request(req)
        tools = self.tools(req)
        messages, prefill = self.conversation(req)
        messages, template_kwargs = tools.template_input(messages, None)
        _, ids = await self.render(messages, template_kwargs, prefill)
        return CountTokensResponse(input_tokens=len(ids))

    async def create(self, req, raw: Request):
        self.check_model(req.model)
        self.check_request(req)
        tools = self.tools(req)
        messages, prefill = self.conversation(req)
        fmt = req.output_config.format if req.output_config is not None else None
        constraint = self.json_constraint(fmt.schema_, "output_config.format.schema") \
            if fmt is not None else None
        params = self.params(req.stream, req.max_tokens, constraint,
                             temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                             stop=req.stop_sequences)
        request_id = f"msg_{uuid.uuid4().hex}"
        g = await self.generate(raw, messages, params, req.stream, request_id=request_id,
                                clamp_max_tokens=True, prefill=prefill, tools=tools)
        if req.stream:
            return sse_response(self._stream(g))
        c = g.first.outputs[0]
        check_not_failed(c)
        parser = g.parser()
        message = parser.message(c.text) if parser else {"content": c.text, "tool_calls": []}
        content: list[dict] = [{"type": "text", "text": message["content"]}] \
            if message["content"] else []
        content += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                     "input": _arguments(call["function"]["arguments"])}
                    for call in message["tool_calls"]]
        reason, sequence = stop_info(c, g.clamped, bool(message["tool_calls"]))
        return json_response(MessagesResponse(
            id=request_id, content=content, model=self.model_name, stop_reason=reason,
            stop_sequence=sequence,
            usage=Usage(input_tokens=len(g.prompt_ids), output_tokens=len(c.token_ids))))

    async def _stream(self, g: Generation) -> AsyncIterator[bytes]:
        yield _sse("message_start", {"type": "message_start", "message": {
            "id": g.request_id, "type": "message", "role": "assistant", "content": [],
            "model": self.model_name, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(g.prompt_ids), "output_tokens": 0}}})
        blocks = _Blocks()
        parser = g.parser()
        if parser is None:  # all text: its block opens at once
            for e in blocks.text(""):
                yield e
        yield _sse("ping", {"type": "ping"})
        output_tokens = 0
        last = g.first
        try:
            async for ro in g.outputs():
                last = ro
                c = ro.outputs[0]
                output_tokens += len(c.token_ids)
                delta = g.delta(parser, c)
                for e in blocks.delta(delta):
                    yield e
            check_not_failed(last.outputs[0])
        except KvflowError as e:
            yield anthropic_error_sse(e.http_status, e.message)
            return
        finally:
            await g.close()
        reason, sequence = stop_info(last.outputs[0], g.clamped, blocks.called)
        for e in blocks.close():
            yield e
        yield _sse("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                     "usage": {"output_tokens": output_tokens}})
        yield _sse("message_stop", {"type": "message_stop"})


class _Blocks:
    """The stream's content blocks, opened and closed as the text turns from text to
    tool calls (one block open at a time, indexes counting from 0). A tool_use block's
    input goes out as one input_json_delta when the block closes: the client parses the
    joined deltas as a JSON object, which the model's text is only once complete (and
    only when it is an object at all; see _arguments)."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.args: list[str] = []  # the open tool_use block's arguments so far
        self.called = False

    def _open(self, block: dict) -> list[bytes]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        return events + [_sse("content_block_start", {"type": "content_block_start",
                                                      "index": self.index,
                                                      "content_block": block})]

    def text(self, text: str) -> list[bytes]:
        events = self._open({"type": "text", "text": ""}) if self.kind != "text" else []
        if text:
            events.append(_sse("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "text_delta", "text": text}}))
        return events

    def delta(self, delta: dict) -> list[bytes]:
        events = self.text(delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls", []):
            fn = call["function"]
            if call.get("id"):
                self.called = True
                events += self._open({"type": "tool_use", "id": call["id"],
                                      "name": fn["name"], "input": {}})
                self.args = []
            if fn.get("arguments") and self.kind == "tool_use":
                self.args.append(fn["arguments"])
        return events

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "tool_use":
            events.append(_sse("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": json.dumps(
                    _arguments("".join(self.args)), ensure_ascii=False)}}))
        self.kind = None
        return events + [_sse("content_block_stop", {"type": "content_block_stop",
                                                      "index": self.index})]


def _arguments(text: str) -> dict:
    """A call's arguments as the object Anthropic's tool_use.input is (the text the
    model wrote, when it is not a JSON object, under "arguments")."""
    try:
        value = json.loads(text)
    except ValueError:
        return {"arguments": text}
    return value if isinstance(value, dict) else {"arguments": value}


def _errors(*statuses: int) -> dict[int, Any]:
    return {status: {"model": AnthropicErrorResponse} for status in statuses}


def add_anthropic_routes(app: FastAPI, state) -> MessagesServing:
    serving = MessagesServing(state.engine, state.model_name, state.args, state.chat)
    models = anthropic_request_models(state.args.limits)
    MessagesRequest, CountTokensRequest = models.messages, models.count_tokens

    @app.post("/v1/messages", response_model=None, tags=["anthropic"], responses={
        200: {"model": MessagesResponse, "description": "the message; with stream: true, "
              "server-sent events (message_start ... message_stop)",
              "content": {"text/event-stream": {}}},
        **_errors(400, 401, 404, 413, 429, 500, 503, 504)})
    async def messages(body: MessagesRequest, raw: Request):
        try:
            return await serving.create(body, raw)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse,
              tags=["anthropic"], responses=_errors(400, 401, 404, 413, 503))
    async def count_tokens(body: CountTokensRequest):
        return json_response(await serving.count_tokens(body))

    return serving
