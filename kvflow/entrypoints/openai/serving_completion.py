"""POST /v1/completions: prompts as text, lists of texts or token ids; echo; streaming."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from kvflow.entrypoints.openai.errors import kvflow_error_sse
from kvflow.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                CompletionResponse)
from kvflow.entrypoints.openai.serving import (SSE_DONE, ChunkBuilder, OpenAIServing,
                                               close_all, gather_or_cancel, json_response,
                                               last_output, merge_streams, random_id,
                                               run_until_disconnect, sse_response,
                                               until_deadline, usage_info)
from kvflow.errors import InvalidParameterError, KvflowError
from kvflow.outputs import CompletionOutput, PositionLogprobs, RequestOutput


def normalize_prompts(prompt) -> list[str | list[int]]:
    """One entry per prompt: a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidParameterError("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    for p in prompt:
        if isinstance(p, list) and not p:
            raise InvalidParameterError("a token id prompt must not be empty", param="prompt")
    return list(prompt)


class CompletionServing(OpenAIServing):
    async def create(self, req, raw: Request):
        self.engine.check_ready()
        deadline = self.deadline()
        lora = self.check_model(req.model)
        if req.suffix:
            raise InvalidParameterError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidParameterError("best_of is not supported (other than best_of == n)",
                                        param="best_of")
        prompts = normalize_prompts(req.prompt)
        prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                                      prompt_logprobs=prompt_lp)
        request_id = random_id("cmpl")
        arrival = time.monotonic()
        gens = [self.engine.generate(f"{request_id}-{i}", p, params, arrival_time=arrival,
                                     priority=req.priority, cache_salt=req.cache_salt,
                                     lora_request=lora)
                for i, p in enumerate(prompts)]
        if req.stream:
            try:
                firsts = await run_until_disconnect(
                    raw, gather_or_cancel([g.__anext__() for g in gens]), deadline)
            except BaseException:
                await close_all(gens)
                raise
            return sse_response(self._stream(req, request_id, firsts, gens, deadline))
        try:
            finals = await run_until_disconnect(raw, gather_or_cancel(
                [last_output(g) for g in gens]), deadline)
        finally:
            await close_all(gens)
        return json_response(self._response(req, request_id, finals))

    # --- non-streaming --------------------------------------------------------------
    def _response(self, req, request_id: str,
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for i, ro in enumerate(finals):
            prompt_tokens += len(ro.prompt_token_ids)
            cached += ro.num_cached_tokens
            prompt_text = self._prompt_text(ro) if req.echo else ""
            for c in sorted(ro.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                choices.append(self._choice(req, i * req.n + c.index, ro, c, prompt_text,
                                            with_prompt=req.echo))
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                  usage=usage_info(prompt_tokens, completion_tokens, cached),
                                  system_fingerprint=self.fingerprint)

    def _choice(self, req, index: int, ro: RequestOutput,
                c: CompletionOutput, prompt_text: str, with_prompt: bool
                ) -> CompletionChoice:
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            offset = 0
            if with_prompt:
                offset = self._add_prompt_logprobs(logprobs, ro)
            self._add_logprobs(logprobs, c.token_ids, c.logprobs or [], offset)
        return CompletionChoice(
            index=index, text=(prompt_text if with_prompt else "") + c.text,
            logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            token_ids=c.token_ids if req.return_token_ids else None,
            prompt_token_ids=ro.prompt_token_ids if req.return_token_ids and with_prompt
            else None)

    def _prompt_text(self, ro: RequestOutput) -> str:
        """The echoed prompt: as sent, or token ids decoded with their special tokens, so
        that it is the concatenation of the prompt's logprob tokens (text_offset points
        into it)."""
        if ro.prompt is not None:
            return ro.prompt
        tok = self.engine.tokenizer
        return tok.decode(ro.prompt_token_ids, skip_special_tokens=False) \
            if tok is not None else ""

    def _add_prompt_logprobs(self, out: CompletionLogprobs, ro: RequestOutput) -> int:
        positions = ro.prompt_logprobs or []
        offset = 0
        for j, tid in enumerate(ro.prompt_token_ids):
            pos = positions[j] if j < len(positions) else None
            text = self.token_text(pos.get(tid) if pos else None, tid)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if pos is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(pos[tid].logprob if tid in pos else None)
                out.top_logprobs.append(self._top_dict(pos))
        return offset

    def _add_logprobs(self, out: CompletionLogprobs, token_ids: list[int],
                      positions: list[PositionLogprobs], offset: int) -> int:
        for tid, pos in zip(token_ids, positions):
            lp = pos.get(tid)
            text = self.token_text(lp, tid)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob if lp is not None else None)
            out.top_logprobs.append(self._top_dict(pos))
            out.text_offset.append(offset)
            offset += len(text)
        return offset

    def _top_dict(self, pos: PositionLogprobs) -> dict[str, float]:
        # The sampled token and the top-N, as vLLM returns them.
        return {self.token_text(lp, t): lp.logprob for t, lp in pos.items()}

    # --- streaming ------------------------------------------------------------------
    async def _stream(self, req, request_id: str, firsts: list[RequestOutput], gens: list,
                      deadline: float | None) -> AsyncIterator[bytes | str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk = ChunkBuilder(request_id, "text_completion", self.model_name,
                             self.fingerprint)

        n = req.n
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        completion_tokens = 0
        prompt_tokens = [len(f.prompt_token_ids) for f in firsts]
        cached = [0] * len(firsts)
        merged = merge_streams(firsts, gens)
        try:
            async for i, ro in until_deadline(merged, deadline):
                cached[i] = max(cached[i], ro.num_cached_tokens)
                for c in ro.outputs:
                    index = i * n + c.index
                    completion_tokens += len(c.token_ids)
                    yield chunk([self._stream_choice(req, index, ro, c, index not in echoed,
                                                     offsets)])
                    echoed.add(index)
            if include_usage:
                yield chunk([], usage_info(sum(prompt_tokens), completion_tokens,
                                           sum(cached)).model_dump())
        except KvflowError as e:
            yield kvflow_error_sse(e)
        finally:
            await merged.aclose()
            await close_all(gens)
        yield SSE_DONE

    def _stream_choice(self, req, index: int, ro: RequestOutput,
                       c: CompletionOutput, first: bool, offsets: dict[int, int]) -> dict:
        """A choice of a stream chunk (CompletionChoice's shape)."""
        with_prompt = req.echo and first
        prompt_text = self._prompt_text(ro) if with_prompt else ""
        logprobs = None
        if req.logprobs is not None:
            lp = CompletionLogprobs()
            offset = offsets.get(index, 0)
            if with_prompt:
                offset = self._add_prompt_logprobs(lp, ro)
            offsets[index] = self._add_logprobs(lp, c.token_ids, c.logprobs or [], offset)
            logprobs = lp.model_dump()
        choice = {"index": index, "text": prompt_text + c.text, "logprobs": logprobs,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids
            if first:
                choice["prompt_token_ids"] = ro.prompt_token_ids
        return choice
