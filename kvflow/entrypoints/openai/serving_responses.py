"""POST /v1/responses (the OpenAI Responses API), GET and DELETE /v1/responses/{id}.

A thin translation onto the chat route: ``instructions`` and the ``input`` items become
chat messages (after the stored conversation of ``previous_response_id``), rendered with
the model's chat template and generated like a chat completion; the answer comes back as
a Response object, or streamed as the Responses API's typed events (response.created,
response.in_progress, output_item/content_part added, output_text deltas, the matching
done events, then response.completed or response.incomplete), with sequence numbers.
"""

# No "from __future__ import annotations": the routes' body types are built per app and
# FastAPI must see them as objects.

import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kvflow.entrypoints.openai.errors import kvflow_error_code
from kvflow.entrypoints.openai.protocol import ErrorResponse
from kvflow.entrypoints.openai.protocol_responses import (
    DeletedResponse, IncompleteDetails, InputTokensDetails, OutputMessage, OutputText,
    OutputTokensDetails, ResponseError, ResponseObject, ResponseUsage,
    responses_request_model)
from kvflow.entrypoints.openai.responses_store import ResponseStore
from kvflow.entrypoints.openai.serving import ClientDisconnected, json_response, sse_response
from kvflow.entrypoints.translate import Generation, TranslatedServing, check_not_failed
from kvflow.errors import InvalidParameterError, KvflowError

_JSON = msgspec.json.Encoder()
CLIENT_CLOSED = 499


class ResponseNotFoundError(KvflowError):
    http_status = 404
    error_type = "not_found_error"


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesServing(TranslatedServing):
    id_prefix = "resp"

    def __init__(self, engine, served_model_name, args, chat, store: ResponseStore) -> None:
        super().__init__(engine, served_model_name, args, chat)
        self.store = store

    def check_request(self, req) -> None:
        self.check_tokenizer("input")
        if req.tools:
            raise InvalidParameterError("function tools are not supported by this server "
                                        "yet", param="tools")
        if req.tool_choice not in (None, "none", "auto"):
            raise InvalidParameterError("tool_choice needs tools, which this server does not "
                                        "support yet (only 'none' or 'auto')",
                                        param="tool_choice")
        if not isinstance(req.input, str):
            for i, item in enumerate(req.input):
                if item.type in ("function_call", "function_call_output"):
                    raise InvalidParameterError(
                        f"{item.type} items need function tools, which this server does "
                        f"not support yet", param=f"input.{i}")
        fmt = req.text.format if req.text else None
        if fmt is not None and fmt.type != "text":
            raise InvalidParameterError(f"text.format {fmt.type!r} (structured output) is not "
                                        f"supported by this server yet; only 'text'",
                                        param="text.format")
        if req.previous_response_id is not None and not self.store.enabled:
            raise InvalidParameterError("this server stores no responses "
                                        "(--responses-store-size 0), so previous_response_id "
                                        "cannot be used", param="previous_response_id")

    def conversation(self, req) -> list[dict]:
        """The chat messages of this turn, after the stored ones it continues; without the
        instructions (those belong to this request only)."""
        messages: list[dict] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise InvalidParameterError(
                    f"previous response with id {req.previous_response_id!r} not found (it "
                    f"was not stored, or the store let it go)", param="previous_response_id")
            messages.extend(prev.messages)
        if isinstance(req.input, str):
            messages.append({"role": "user", "content": req.input})
        else:
            for item in req.input:
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": _text(item.content)})
        return messages

    async def create(self, req, raw: Request):
        self.check_model(req.model)
        self.check_request(req)
        convo = self.conversation(req)
        messages = ([{"role": "system", "content": req.instructions}]
                    if req.instructions is not None else []) + convo
        params = self.params(req.stream, req.max_output_tokens, temperature=req.temperature,
                             top_p=req.top_p, top_k=req.top_k, seed=req.seed)
        g = await self.generate(raw, messages, params, req.stream,
                                request_id=_hex_id("resp"))
        head = self._head(req, g.request_id, params)
        if req.stream:
            return sse_response(self._stream(req, g, head, convo))
        c = g.first.outputs[0]
        check_not_failed(c)
        item = OutputMessage(id=_hex_id("msg"), status=_item_status(c.finish_reason),
                             content=[OutputText(text=c.text)])
        resp = self._finish(head, item, c.finish_reason, len(g.prompt_ids), len(c.token_ids),
                            g.first.num_cached_tokens)
        self._keep(req, resp, convo, c.text)
        return json_response(resp)

    def _head(self, req, request_id: str, params) -> ResponseObject:
        """The response object's fields that the request decides (status in_progress)."""
        choice = req.tool_choice
        return ResponseObject(
            id=request_id, status="in_progress",
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            model=self.model_name, previous_response_id=req.previous_response_id,
            temperature=params.temperature, top_p=params.top_p,
            tool_choice=(choice if isinstance(choice, str) or choice is None
                         else choice.model_dump()) or "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False,
            text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
            if req.text and req.text.format else {"format": {"type": "text"}},
            store=req.store, metadata=req.metadata or {}, user=req.user)

    def _finish(self, head: ResponseObject, item: OutputMessage, finish_reason: str | None,
                input_tokens: int, output_tokens: int, cached: int) -> ResponseObject:
        incomplete = finish_reason == "length"
        return head.model_copy(update=dict(
            status="incomplete" if incomplete else "completed",
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if incomplete else None,
            output=[item],
            usage=ResponseUsage(
                input_tokens=input_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=cached),
                output_tokens=output_tokens, output_tokens_details=OutputTokensDetails(),
                total_tokens=input_tokens + output_tokens)))

    def _keep(self, req, resp: ResponseObject, convo: list[dict], text: str) -> None:
        if req.store:
            self.store.put(resp.id, resp.model_dump(mode="json"),
                           convo + [{"role": "assistant", "content": text}])

    async def _stream(self, req, g: Generation, head: ResponseObject, convo: list[dict]
                      ) -> AsyncIterator[bytes]:
        seq = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            data = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return (b"event: " + kind.encode() + b"\ndata: " + _JSON.encode(data) + b"\n\n")

        item_id = _hex_id("msg")
        loc = {"item_id": item_id, "output_index": 0, "content_index": 0}
        start = head.model_dump(mode="json")
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        yield event("response.output_item.added", output_index=0, item=OutputMessage(
            id=item_id, status="in_progress", content=[]).model_dump(mode="json"))
        yield event("response.content_part.added", **loc,
                    part=OutputText(text="").model_dump(mode="json"))
        pieces: list[str] = []
        output_tokens = 0
        last = g.first
        try:
            async for ro in g.outputs():
                last = ro
                c = ro.outputs[0]
                output_tokens += len(c.token_ids)
                if c.text:
                    pieces.append(c.text)
                    yield event("response.output_text.delta", **loc, delta=c.text,
                                logprobs=[])
            check_not_failed(last.outputs[0])
        except KvflowError as e:
            code = kvflow_error_code(e) or e.error_type
            yield event("error", code=code, message=e.message, param=e.param)
            failed = head.model_copy(update=dict(
                status="failed", error=ResponseError(code=code, message=e.message)))
            yield event("response.failed", response=failed.model_dump(mode="json"))
            return
        finally:
            await g.close()
        text = "".join(pieces)
        finish = last.outputs[0].finish_reason
        part = OutputText(text=text)
        item = OutputMessage(id=item_id, status=_item_status(finish), content=[part])
        yield event("response.output_text.done", **loc, text=text, logprobs=[])
        yield event("response.content_part.done", **loc, part=part.model_dump(mode="json"))
        yield event("response.output_item.done", output_index=0,
                    item=item.model_dump(mode="json"))
        resp = self._finish(head, item, finish, len(g.prompt_ids), output_tokens,
                            last.num_cached_tokens)
        self._keep(req, resp, convo, text)
        kind = "response.incomplete" if resp.status == "incomplete" else "response.completed"
        yield event(kind, response=resp.model_dump(mode="json"))

    def retrieve(self, response_id: str) -> dict:
        entry = self.store.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(f"no stored response with id {response_id!r}",
                                        param="response_id")
        return entry.response

    def delete(self, response_id: str) -> DeletedResponse:
        if not self.store.delete(response_id):
            raise ResponseNotFoundError(f"no stored response with id {response_id!r}",
                                        param="response_id")
        return DeletedResponse(id=response_id)


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _errors(*statuses: int) -> dict:
    return {status: {"model": ErrorResponse} for status in statuses}


def add_responses_routes(app: FastAPI, state) -> ResponsesServing:
    """The Responses routes over the server's engine and chat machinery."""
    serving = ResponsesServing(state.engine, state.model_name, state.args, state.chat,
                               ResponseStore(state.args.responses_store_size))
    ResponsesRequest = responses_request_model(state.args.limits).responses

    @app.post("/v1/responses", response_model=None, responses={
        200: {"model": ResponseObject, "description": "the response; with stream: true, "
              "server-sent events (response.created ... response.completed)",
              "content": {"text/event-stream": {}}},
        **_errors(400, 401, 404, 413, 429, 500, 503, 504)})
    async def responses(body: ResponsesRequest, raw: Request):
        try:
            return await serving.create(body, raw)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject,
             responses=_errors(401, 404))
    async def get_response(response_id: str):
        return JSONResponse(serving.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse,
                responses=_errors(401, 404))
    async def delete_response(response_id: str):
        return json_response(serving.delete(response_id))

    return serving
