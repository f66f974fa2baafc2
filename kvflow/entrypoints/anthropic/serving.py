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
from kvflow.entrypoints.translate import Generation, TranslatedServing, check_not_failed
from kvflow.errors import InvalidParameterError, KvflowError
from kvflow.outputs import CompletionOutput

CLIENT_CLOSED = 499


def _sse(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def _text(blocks) -> str:
    return "\n".join(b.text for b in blocks if b.type == "text")


def stop_info(c: CompletionOutput, clamped: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished sample."""
    if c.finish_reason == "length":
        return ("model_context_window_exceeded" if clamped else "max_tokens"), None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


class MessagesServing(TranslatedServing):
    id_prefix = "msg"

    def check_request(self, req) -> None:
        self.check_tokenizer("messages")
        if req.tools:
            raise InvalidParameterError("tools are not supported by this server yet",
                                        param="tools")
        if req.tool_choice is not None and req.tool_choice.type not in ("auto", "none"):
            raise InvalidParameterError("tool_choice needs tools, which this server does not "
                                        "support yet (only 'auto' or 'none')",
                                        param="tool_choice")
        if req.output_config is not None and req.output_config.format is not None:
            raise InvalidParameterError("output_config.format (structured output) is not "
                                        "supported by this server yet",
                                        param="output_config.format")
        for i, m in enumerate(req.messages):
            if isinstance(m.content, str):
                continue
            for j, b in enumerate(m.content):
                if b.type in ("tool_use", "tool_result"):
                    raise InvalidParameterError(
                        f"{b.type} blocks need tools, which this server does not support "
                        f"yet", param=f"messages.{i}.content.{j}")

    def conversation(self, req) -> tuple[list[dict], str | None]:
        """(chat messages, prefill): a trailing assistant message is not a turn of its
        own but the start of the answer."""
        messages: list[dict] = []
        if req.system is not None:
            system = req.system if isinstance(req.system, str) else _text(req.system)
            messages.append({"role": "system", "content": system})
        for m in req.messages:
            content = m.content if isinstance(m.content, str) else _text(m.content)
            messages.append({"role": m.role, "content": content})
        prefill = None
        if messages[-1]["role"] == "assistant":
            prefill = messages.pop()["content"]
            if not any(m["role"] != "system" for m in messages):
                raise InvalidParameterError("the conversation needs a user message before a "
                                            "final assistant message", param="messages")
        return messages, prefill

    async def count_tokens(self, req) -> CountTokensResponse:
        self.engine.check_ready()
        self.check_model(req.model)
        self.check_request(req)
        messages, prefill = self.conversation(req)
        _, ids = await self.render(messages, None, prefill)
        return CountTokensResponse(input_tokens=len(ids))

    async def create(self, req, raw: Request):
        self.check_model(req.model)
        self.check_request(req)
        messages, prefill = self.conversation(req)
        params = self.params(req.stream, req.max_tokens, temperature=req.temperature,
                             top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences)
        request_id = f"msg_{uuid.uuid4().hex}"
        g = await self.generate(raw, messages, params, req.stream, request_id=request_id,
                                clamp_max_tokens=True, prefill=prefill)
        if req.stream:
            return sse_response(self._stream(g))
        c = g.first.outputs[0]
        check_not_failed(c)
        reason, sequence = stop_info(c, g.clamped)
        return json_response(MessagesResponse(
            id=request_id, content=[{"type": "text", "text": c.text}] if c.text else [],
            model=self.model_name, stop_reason=reason, stop_sequence=sequence,
            usage=Usage(input_tokens=len(g.prompt_ids), output_tokens=len(c.token_ids))))

    async def _stream(self, g: Generation) -> AsyncIterator[bytes]:
        yield _sse("message_start", {"type": "message_start", "message": {
            "id": g.request_id, "type": "message", "role": "assistant", "content": [],
            "model": self.model_name, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(g.prompt_ids), "output_tokens": 0}}})
        yield _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}})
        yield _sse("ping", {"type": "ping"})
        output_tokens = 0
        last = g.first
        try:
            async for ro in g.outputs():
                last = ro
                c = ro.outputs[0]
                output_tokens += len(c.token_ids)
                if c.text:
                    yield _sse("content_block_delta", {
                        "type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": c.text}})
            check_not_failed(last.outputs[0])
        except KvflowError as e:
            yield anthropic_error_sse(e.http_status, e.message)
            return
        finally:
            await g.close()
        reason, sequence = stop_info(last.outputs[0], g.clamped)
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
        yield _sse("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                     "usage": {"output_tokens": output_tokens}})
        yield _sse("message_stop", {"type": "message_stop"})


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
