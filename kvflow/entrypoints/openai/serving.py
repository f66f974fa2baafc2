"""What the completion and chat endpoints share: model check, sampling parameters,
client-disconnect handling, stream plumbing and logprob formatting."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

import msgspec
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from kvflow.engine.async_client import AsyncEngine
from kvflow.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from kvflow.entrypoints.openai.server_args import ServerArgs
from kvflow.entrypoints.openai.structured import constraint_limits, structured_params
from kvflow.errors import InvalidParameterError, ModelNotFoundError, RequestTimeoutError
from kvflow.outputs import Logprob, PositionLogprobs, RequestOutput
from kvflow.sampling_params import OutputKind, SamplingParams
from kvflow.structured_output.check import check_constraint

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty")


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# Stateless: encodes stream chunks, which are plain dicts shaped like protocol.py's chunk
# models (a test holds them to it); per token this costs a tenth of building and dumping
# pydantic models.
_JSON = msgspec.json.Encoder()


def sse_event(chunk: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + _JSON.encode(chunk) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ChunkBuilder:
    """The stream chunks of one response, chat or completion: the fields every chunk
    repeats are fixed once, each chunk then adds its choices (and the usage, in the last
    one). Plain dicts shaped like protocol.ChatCompletionChunk / CompletionChunk."""

    def __init__(self, request_id: str, obj: str, model: str,
                 fingerprint: str | None = None) -> None:
        self.head = {"id": request_id, "object": obj, "created": int(time.time()),
                     "model": model, "system_fingerprint": fingerprint}

    def __call__(self, choices: list[dict], usage: dict | None = None) -> bytes:
        return sse_event({**self.head, "choices": choices, "usage": usage})


def sse_response(events: AsyncIterator[bytes | str]) -> StreamingResponse:
    # no-cache / no buffering: proxies must pass each event on as it comes.
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable,
                               deadline: float | None = None):
    """Await ``work``; if the client disconnects first, cancel it (which aborts its engine
    requests) and raise ClientDisconnected; if ``deadline`` (loop time) passes first,
    cancel it and raise RequestTimeoutError."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    timeout = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop()
                                                .time())
    try:
        await asyncio.wait({task, watcher}, timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if watcher.done() and not watcher.cancelled():
        raise ClientDisconnected()
    raise timeout_error()


def timeout_error() -> RequestTimeoutError:
    return RequestTimeoutError("the request took longer than the server's request timeout "
                               "(--request-timeout) and was ended")


async def until_deadline(agen: AsyncIterator, deadline: float | None) -> AsyncIterator:
    """The items of ``agen`` while ``deadline`` (loop time) has not passed; then
    RequestTimeoutError (the pending item is cancelled, which aborts its request)."""
    if deadline is None:
        async for item in agen:
            yield item
        return
    loop = asyncio.get_running_loop()
    while True:
        try:
            item = await asyncio.wait_for(agen.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise timeout_error() from None
        yield item


async def gather_or_cancel(aws: list[Awaitable]) -> list:
    """Like asyncio.gather, but the first error cancels the rest before it is raised."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if pending:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    # Read every finished task's error (several prompts can fail at once, say two
    # empty ones), so none is left for asyncio to log as never retrieved.
    errors = [t.exception() for t in tasks if t.done() and not t.cancelled()]
    errors = [e for e in errors if e is not None]
    if errors:
        raise errors[0]
    return [t.result() for t in tasks]


async def last_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = None
    async for out in gen:
        pass
    assert out is not None and out.finished
    return out


async def chain_first(first: RequestOutput, gen: AsyncIterator[RequestOutput]
                      ) -> AsyncIterator[RequestOutput]:
    """The output already read from a request, then the rest of them."""
    yield first
    if not first.finished:
        async for out in gen:
            yield out


async def merge_streams(firsts: list[RequestOutput],
                        gens: list[AsyncIterator[RequestOutput]]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) pairs of several requests as they come, each starting with the
    output already read from it. Closing this closes (aborts) every request."""
    for i, first in enumerate(firsts):
        yield i, first
    live = [i for i, f in enumerate(firsts) if not f.finished]
    if len(live) == 1:
        i = live[0]
        async for out in gens[i]:
            yield i, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in gens[i]:
                queue.put_nowait((i, out, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        finally:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in live]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def close_all(gens: list[AsyncIterator]) -> None:
    for g in gens:
        await g.aclose()


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
               ) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class OpenAIServing:
    """Base of the endpoints that generate."""

    def __init__(self, engine: AsyncEngine, served_model_name: str,
                 args: ServerArgs | None = None) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.args = args or ServerArgs()
        self.loras = None  # LoRARegistry with --enable-lora (the server sets it)

    @property
    def fingerprint(self) -> str | None:
        """The engine's system_fingerprint (engine/determinism.py), once it is ready."""
        ready = getattr(self.engine, "ready", None)
        return (ready.fingerprint or None) if ready is not None else None

    def deadline(self) -> float | None:
        """Loop time by which a request arriving now must be done (--request-timeout)."""
        t = self.args.request_timeout
        return None if t is None else asyncio.get_running_loop().time() + t

    def check_model(self, name: str | None):
        """The LoRARequest of the adapter ``name`` picks (None: the base model); an
        unknown name is a 404."""
        if name is None or name == self.model_name or name == self.engine.config.model.model:
            return None
        lora = self.loras.get(name) if self.loras is not None else None
        if lora is not None:
            return lora
        served = [self.model_name] + (self.loras.names() if self.loras is not None else [])
        raise ModelNotFoundError(f"the model {name!r} does not exist: this server serves "
                                 f"{', '.join(map(repr, served))} (see /v1/models)",
                                 param="model")

    def sampling_params(self, req, *, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        values = dict(self.engine.config.model.generation_defaults)
        for name in _SAMPLING_FIELDS:
            value = getattr(req, name)
            if value is not None:
                values[name] = value
        has_tokenizer = self.engine.tokenizer is not None
        if req.stop and not has_tokenizer:
            raise InvalidParameterError("stop strings need a tokenizer and this model has "
                                        "none; use stop_token_ids", param="stop")
        return SamplingParams(
            structured_outputs=self.structured_outputs(req), n=req.n, seed=req.seed,
            stop=req.stop,
            logit_bias={int(k): float(v) for k, v in req.logit_bias.items()}
            if req.logit_bias else None, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
            repetition_guard=req.repetition_guard,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            detokenize=has_tokenizer,
            output_kind=OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY,
            **values)

    def structured_outputs(self, req):
        """The request's constraint (response_format / structured_outputs), checked
        against the server's limits: a 400 naming the field, before the engine."""
        so, param = structured_params(req)
        if so is not None:
            check_constraint(so, constraint_limits(self.args.limits), param)
        return so

    def token_text(self, lp: Logprob | None, token_id: int) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        tok = self.engine.tokenizer
        if tok is not None:
            return tok.decode([token_id], skip_special_tokens=False)
        return f"token_id:{token_id}"

    def top_entries(self, pos: PositionLogprobs, top_n: int) -> list[tuple[int, Logprob]]:
        """The top_n most likely tokens of a position, most likely first."""
        tops = [(t, lp) for t, lp in pos.items() if lp.rank is not None and lp.rank <= top_n]
        return sorted(tops, key=lambda e: e[1].rank)


def json_response(model, status_code: int = 200) -> Response:
    """A pydantic model as JSON (pydantic writes -inf logprobs as null; json.dumps can't)."""
    return Response(model.model_dump_json(), status_code=status_code,
                    media_type="application/json")
