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
    DeletedResponse, FunctionCallOutput, FunctionToolChoice, IncompleteDetails,
    InputTokensDetails, OutputMessage, OutputText, OutputTokensDetails, ResponseError,
    ResponseObject, ResponseUsage, responses_request_model)
from kvflow.entrypoints.openai.responses_store import ResponseStore
from kvflow.entrypoints.openai.serving import ClientDisconnected, json_response, sse_response
from kvflow.entrypoints.translate import (Generation, TranslatedServing, chat_tools,
                                          check_not_failed, openai_tool, tool_call_message)
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
        if req.previous_response_id is not None and not self.store.enabled:
            raise InvalidParameterError("this server stores no responses "
                                        "(--responses-store-size 0), so previous_response_id "
                                        "cannot be used", param="previous_response_id")

    def tools(self, req):
        tools = [openai_tool(t.name, t.description, t.parameters) for t in req.tools or []]
        choice = req.tool_choice
        named = choice.name if isinstance(choice, FunctionToolChoice) else None
        return chat_tools(self.engine.tokenizer, self.args, tools,
                          None if named else choice, named, req.parallel_tool_calls)

    def conversation(self, req) -> list[dict]:
        """The chat messages of this turn, after the stored ones it continues; without the
        instructions (those belong to this request only). Function calls join the
        assistant turn they follow; their outputs are tool messages."""
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
            return messages
        for item in req.input:
            if item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append(tool_call_message([(item.call_id, item.name,
                                                        item.arguments)]))
            elif item.type == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": _text(item.output)})
            else:
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": _text(item.content)})
        return messages

    async def create(self, req, raw: Request):
        self.check_model(req.model)
        self.check_request(req)
        tools = self.tools(req)
        convo = self.conversation(req)
        messages = ([{"role": "system", "content": req.instructions}]
                    if req.instructions is not None else []) + convo
        fmt = req.text.format if req.text else None
        constraint = None
        if fmt is not None and fmt.type != "text":
            constraint = self.json_constraint(
                fmt.schema_ if fmt.type == "json_schema" else None,
                "text.format.schema" if fmt.type == "json_schema" else "text.format")
        params = self.params(req.stream, req.max_output_tokens, constraint,
                             temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                             seed=req.seed)
        g = await self.generate(raw, messages, params, req.stream,
                                request_id=_hex_id("resp"), tools=tools)
        head = self._head(req, g.request_id, params)
        if req.stream:
            return sse_response(self._stream(req, g, head, convo))
        c = g.first.outputs[0]
        check_not_failed(c)
        parser = g.parser()
        message = parser.message(c.text) if parser else {"content": c.text, "tool_calls": []}
        status = _item_status(c.finish_reason)
        items: list = []
        if message["content"] or not message["tool_calls"]:
            items.append(OutputMessage(id=_hex_id("msg"), status=status,
                                       content=[OutputText(text=message["content"] or "")]))
        items += [FunctionCallOutput(id=_hex_id("fc"), call_id=call["id"],
                                     name=call["function"]["name"],
                                     arguments=call["function"]["arguments"])
                  for call in message["tool_calls"]]
        resp = self._finish(head, items, c.finish_reason, len(g.prompt_ids),
                            len(c.token_ids), g.first.num_cached_tokens)
        self._keep(req, resp, convo, message["content"] or "", message["tool_calls"])
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
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            parallel_tool_calls=req.parallel_tool_calls is not False,
            text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
            if req.text and req.text.format else {"format": {"type": "text"}},
            store=req.store, metadata=req.metadata or {}, user=req.user)

    def _finish(self, head: ResponseObject, items: list, finish_reason: str | None,
                input_tokens: int, output_tokens: int, cached: int) -> ResponseObject:
        incomplete = finish_reason == "length"
        return head.model_copy(update=dict(
            status="incomplete" if incomplete else "completed",
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if incomplete else None,
            output=items,
            usage=ResponseUsage(
                input_tokens=input_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=cached),
                output_tokens=output_tokens, output_tokens_details=OutputTokensDetails(),
                total_tokens=input_tokens + output_tokens)))

    def _keep(self, req, resp: ResponseObject, convo: list[dict], text: str,
              calls: list[dict]) -> None:
        if req.store:
            turn = {"role": "assistant", "content": text}
            if calls:
                turn["tool_calls"] = calls
            self.store.put(resp.id, resp.model_dump(mode="json"), convo + [turn])

    async def _stream(self, req, g: Generation, head: ResponseObject, convo: list[dict]
                      ) -> AsyncIterator[bytes]:
        out = _EventWriter()
        start = head.model_dump(mode="json")
        yield out.event("response.created", response=start)
        yield out.event("response.in_progress", response=start)
        parser = g.parser()
        if parser is None:  # all content: the message opens at once, as OpenAI's does
            for e in out.text(""):
                yield e
        output_tokens = 0
        last = g.first
        try:
            async for ro in g.outputs():
                last = ro
                c = ro.outputs[0]
                output_tokens += len(c.token_ids)
                delta = g.delta(parser, c)
                for e in out.delta(delta):
                    yield e
            check_not_failed(last.outputs[0])
        except KvflowError as e:
            code = kvflow_error_code(e) or e.error_type
            yield out.event("error", code=code, message=e.message, param=e.param)
            failed = head.model_copy(update=dict(
                status="failed", error=ResponseError(code=code, message=e.message)))
            yield out.event("response.failed", response=failed.model_dump(mode="json"))
            return
        finally:
            await g.close()
        finish = last.outputs[0].finish_reason
        if not out.items and out.open is None:  # nothing at all: an empty message
            for e in out.text(""):
                yield e
        for e in out.close(_item_status(finish)):
            yield e
        resp = self._finish(head, out.items, finish, len(g.prompt_ids), output_tokens,
                            last.num_cached_tokens)
        text = "".join(i["content"][0]["text"] for i in out.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in out.items if i["type"] == "function_call"]
        self._keep(req, resp, convo, text, calls)
        kind = "response.incomplete" if resp.status == "incomplete" else "response.completed"
        yield out.event(kind, response=resp.model_dump(mode="json"))

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


class _EventWriter:
    """The Responses stream's events: numbered, and the output items opened and closed
    as the text turns from content to function calls (one item open at a time)."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict] = []  # finished output items
        self.open: dict | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _JSON.encode(data) + b"\n\n"

    def _loc(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def text(self, text: str) -> list[bytes]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self.close("completed")
            self.open = {"id": _hex_id("msg"), "type": "message", "role": "assistant",
                         "status": "in_progress", "content": [], "_text": []}
            item = {k: v for k, v in self.open.items() if k != "_text"}
            events.append(self.event("response.output_item.added",
                                     output_index=len(self.items), item=item))
            events.append(self.event("response.content_part.added", **self._loc(),
                                     content_index=0,
                                     part=OutputText(text="").model_dump(mode="json")))
        if text:
            self.open["_text"].append(text)
            events.append(self.event("response.output_text.delta", **self._loc(),
                                     content_index=0, delta=text, logprobs=[]))
        return events

    def delta(self, delta: dict) -> list[bytes]:
        events = self.text(delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls", []):
            fn = call["function"]
            if call.get("id"):
                events += self.close("completed")
                self.open = {"id": _hex_id("fc"), "type": "function_call",
                             "call_id": call["id"], "name": fn["name"], "arguments": "",
                             "status": "in_progress"}
                events.append(self.event("response.output_item.added",
                                         output_index=len(self.items), item=dict(self.open)))
            if fn.get("arguments") and self.open and self.open["type"] == "function_call":
                self.open["arguments"] += fn["arguments"]
                events.append(self.event("response.function_call_arguments.delta",
                                         **self._loc(), delta=fn["arguments"]))
        return events

    def close(self, status: str) -> list[bytes]:
        if self.open is None:
            return []
        item, loc, events = self.open, self._loc(), []
        if item["type"] == "message":
            part = OutputText(text="".join(item.pop("_text"))).model_dump(mode="json")
            events.append(self.event("response.output_text.done", **loc, content_index=0,
                                     text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", **loc, content_index=0,
                                     part=part))
            item = {**item, "status": status, "content": [part]}
        else:
            events.append(self.event("response.function_call_arguments.done", **loc,
                                     name=item["name"], arguments=item["arguments"]))
            item = {**item, "status": "completed"}
        events.append(self.event("response.output_item.done",
                                 output_index=loc["output_index"], item=item))
        self.items.append(item)
        self.open = None
        return events


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
