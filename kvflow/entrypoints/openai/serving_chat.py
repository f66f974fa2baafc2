"""POST /v1/chat/completions: the model's chat template, streaming, logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial

from fastapi import Request

from kvflow.entrypoints.chat_utils import render_chat
from kvflow.entrypoints.openai.chat_tools import ChatTools
from kvflow.entrypoints.openai.errors import kvflow_error_sse
from kvflow.entrypoints.openai.protocol import (ChatChoice, ChatCompletionResponse,
                                                ChatLogprobs, ChatResponseMessage,
                                                ChatTokenLogprob, TopLogprob)
from kvflow.entrypoints.openai.serving import (SSE_DONE, ChunkBuilder, OpenAIServing,
                                               chain_first, json_response, last_output,
                                               random_id, run_until_disconnect,
                                               sse_response, until_deadline, usage_info)
from kvflow.errors import InvalidParameterError, KvflowError
from kvflow.outputs import CompletionOutput, PositionLogprobs, RequestOutput

# Message fields that reach the chat template besides role and content.
_MESSAGE_EXTRAS = ("name", "tool_calls", "tool_call_id", "refusal", "reasoning_content")


def message_dict(m) -> dict:
    """A validated ChatMessage as chat templates expect it: text content (text parts
    joined by newlines, "" for none), the optional fields that were given."""
    content = m.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    elif content is None:  # an assistant turn of tool calls: templates expect a string
        content = ""
    extras = {k: getattr(m, k) for k in _MESSAGE_EXTRAS if getattr(m, k) is not None}
    if "tool_calls" in extras:
        extras["tool_calls"] = [c.model_dump() for c in extras["tool_calls"]]
    return {**extras, "role": m.role, "content": content}


class ChatServing(OpenAIServing):
    async def render(self, messages: list[dict], add_generation_prompt: bool,
                     template_kwargs: dict | None, chat_template: str | None = None
                     ) -> tuple[str, list[int]]:
        """Chat template -> (prompt text, token ids), in the tokenizer thread pool, limited
        in time and size (--chat-template-timeout, --max-chat-prompt-chars)."""
        a = self.args
        return await self.engine.run_in_pool(
            partial(render_chat, self.engine.tokenizer, messages, add_generation_prompt,
                    template_kwargs, timeout_s=a.chat_template_timeout,
                    max_chars=a.max_chat_prompt_chars, chat_template=chat_template))

    async def render_request(self, req) -> tuple[str, list[int], ChatTools]:
        """A chat (or /tokenize chat) request's prompt, with its tools rendered."""
        tools = ChatTools(self.engine.tokenizer, self.args, req)
        messages, template_kwargs = tools.template_input(
            [message_dict(m) for m in req.messages], req.chat_template_kwargs)
        text, ids = await self.render(messages, req.add_generation_prompt, template_kwargs,
                                      getattr(req, "chat_template", None))
        tools.prompt = text
        return text, ids, tools

    def check_request(self, req) -> None:
        if self.engine.tokenizer is None:
            raise InvalidParameterError("this model has no tokenizer, so it cannot chat; use "
                                        "/v1/completions with token ids", param="messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidParameterError("top_logprobs needs logprobs to be true",
                                        param="top_logprobs")

    async def create(self, req, raw: Request):
        self.engine.check_ready()
        lora = self.check_model(req.model)
        self.check_request(req)
        deadline = self.deadline()
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
        arrival = time.monotonic()
        text, ids, tools = await self.render_request(req)
        params = tools.sampling_params(params)
        request_id = random_id("chatcmpl")
        gen = self.engine.generate(request_id, {"prompt": text, "prompt_token_ids": ids},
                                   params, arrival_time=arrival, priority=req.priority,
                                   cache_salt=req.cache_salt, lora_request=lora)
        if req.stream:
            try:
                first = await run_until_disconnect(raw, gen.__anext__(), deadline)
            except BaseException:
                await gen.aclose()
                raise
            return sse_response(self._stream(req, request_id, first, gen, deadline, tools))
        try:
            final = await run_until_disconnect(raw, last_output(gen), deadline)
        finally:
            await gen.aclose()
        return json_response(self._response(req, request_id, final, tools))

    def _logprobs(self, req, c: CompletionOutput
                  ) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        top_n = req.top_logprobs or 0
        content = []
        for tid, pos in zip(c.token_ids, c.logprobs or []):
            content.append(self._token_logprob(tid, pos, top_n))
        return ChatLogprobs(content=content)

    def _token_logprob(self, tid: int, pos: PositionLogprobs, top_n: int
                       ) -> ChatTokenLogprob:
        lp = pos.get(tid)
        text = self.token_text(lp, tid)
        tops = [TopLogprob(token=(t_text := self.token_text(p, t)), logprob=p.logprob,
                           bytes=list(t_text.encode()))
                for t, p in self.top_entries(pos, top_n)]
        return ChatTokenLogprob(token=text, logprob=lp.logprob if lp is not None else
                                float("-inf"), bytes=list(text.encode()), top_logprobs=tops)

    def _response(self, req, request_id: str, ro: RequestOutput,
                  tools: ChatTools) -> ChatCompletionResponse:
        choices = []
        for c in sorted(ro.outputs, key=lambda c: c.index):
            parser = tools.choice_parser()
            message = parser.message(c.text) if parser else {"content": c.text}
            choices.append(ChatChoice(
                index=c.index, message=ChatResponseMessage(**message),
                logprobs=self._logprobs(req, c),
                finish_reason=parser.finish_reason(c.finish_reason) if parser
                else c.finish_reason, stop_reason=c.stop_reason,
                token_ids=c.token_ids if req.return_token_ids else None))
        usage = usage_info(len(ro.prompt_token_ids), sum(len(c.token_ids) for c in ro.outputs),
                           ro.num_cached_tokens)
        return ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=usage,
            system_fingerprint=self.fingerprint,
            prompt_token_ids=ro.prompt_token_ids if req.return_token_ids else None)

    async def _stream(self, req, request_id: str, first: RequestOutput, gen,
                      deadline: float | None, tools: ChatTools
                      ) -> AsyncIterator[bytes | str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk = ChunkBuilder(request_id, "chat.completion.chunk", self.model_name,
                             self.fingerprint)
        parsers = {i: tools.choice_parser() for i in range(req.n)}

        def choice(index: int, delta: dict, c: CompletionOutput | None = None) -> dict:
            lp = self._logprobs(req, c) if c is not None else None
            reason = c.finish_reason if c else None
            if reason is not None and parsers[index] is not None:
                reason = parsers[index].finish_reason(reason)
            d = {"index": index, "delta": delta,
                 "logprobs": lp.model_dump() if lp is not None else None,
                 "finish_reason": reason,
                 "stop_reason": c.stop_reason if c else None}
            if req.return_token_ids and c is not None:
                d["token_ids"] = c.token_ids
            return d

        completion_tokens = 0
        last = first
        try:
            for i in range(req.n):
                yield chunk([choice(i, {"role": "assistant", "content": ""})])
            async for ro in until_deadline(chain_first(first, gen), deadline):
                last = ro
                for c in ro.outputs:
                    completion_tokens += len(c.token_ids)
                    parser = parsers.get(c.index)
                    if parser is None:
                        yield chunk([choice(c.index, {"content": c.text}, c)])
                        continue
                    delta = parser.finish(c.text) if c.finish_reason is not None \
                        else parser.feed(c.text)
                    if delta or c.finish_reason is not None or req.logprobs:
                        yield chunk([choice(c.index, delta, c)])
            if include_usage:
                yield chunk([], usage_info(len(last.prompt_token_ids), completion_tokens,
                                           last.num_cached_tokens).model_dump())
        except KvflowError as e:
            yield kvflow_error_sse(e)
        finally:
            await gen.aclose()
        yield SSE_DONE
