"""From engine-core outputs to RequestOutputs: detokenization, stop strings, logprobs,
and the grouping of n samples under their request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvflow.core.sched_output import EngineCoreOutput, LogprobsEntry
from kvflow.engine.processor import ProcessedRequest, child_request_id
from kvflow.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, \
    RequestOutput
from kvflow.sampling_params import OutputKind, SamplingParams


@dataclass
class SampleState:
    """One of a request's n samples."""

    index: int
    detokenizer: object | None  # IncrementalDetokenizer when text is produced
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for delta outputs
    changed: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False  # delta outputs send them once
    num_cached_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's vector, once it is computed

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[RequestState, SampleState]] = {}

    def add_request(self, processed: ProcessedRequest, arrival_time: float | None = None
                    ) -> RequestState:
        params = processed.params
        samples = []
        for i in range(params.n):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                from kvflow.engine.detokenizer import IncrementalDetokenizer

                detok = IncrementalDetokenizer(
                    self.tokenizer, processed.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop_strings,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens)
            samples.append(SampleState(
                index=i, detokenizer=detok,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None))
        state = RequestState(
            request_id=processed.request_id, prompt=processed.prompt,
            prompt_token_ids=processed.prompt_token_ids, params=params, samples=samples,
            metrics=RequestMetrics(arrival_time=arrival_time or time.monotonic()),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self.requests[processed.request_id] = state
        for s in samples:
            self.child_to_parent[child_request_id(processed.request_id, s.index,
                                                  params.n)] = (state, s)
        return state

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the RequestOutputs to hand out and the (child id, stop string) pairs
        the engine core must end because a stop string matched."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        stopped: list[tuple[str, str]] = []
        for out in outputs:
            entry = self.child_to_parent.get(out.req_id)
            if entry is None:
                continue  # aborted meanwhile
            state, sample = entry
            if sample.finish_reason is not None:
                continue
            matched = self._add_tokens(state, sample, out)
            if matched is not None:
                sample.finish_reason, sample.stop_reason = "stop", matched
                stopped.append((out.req_id, matched))
            elif out.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            m = state.metrics
            if out.new_token_ids:
                m.first_token_time = m.first_token_time or now
                m.last_token_time = now
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            touched[state.request_id] = state
        results = []
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                self._forget(state)
            ro = self._make_output(state)
            if ro is not None:
                results.append(ro)
        return results, stopped

    def _add_tokens(self, state: RequestState, sample: SampleState,
                    out: EngineCoreOutput) -> str | None:
        new_ids = out.new_token_ids
        if out.pooled is not None:
            state.pooled = out.pooled
        matched = None
        if sample.detokenizer is not None and new_ids:
            matched = sample.detokenizer.update(new_ids)
            if matched is not None:  # tokens after the stop string are dropped
                new_ids = new_ids[: len(sample.detokenizer.output_token_ids)
                                  - len(sample.token_ids)]
        sample.token_ids.extend(new_ids)
        sample.changed = sample.changed or bool(new_ids) or out.finish_reason is not None
        if sample.logprobs is not None and out.new_logprobs:
            for entry in out.new_logprobs[: len(new_ids)]:
                sample.logprobs.append(self._position_logprobs(entry))
                sample.cumulative_logprob += entry[1][0]
        if (state.prompt_logprobs is not None and sample.index == 0
                and out.new_prompt_logprobs):
            state.prompt_logprobs.extend(self._position_logprobs(e)
                                         for e in out.new_prompt_logprobs)
        return matched

    def _position_logprobs(self, entry: LogprobsEntry) -> PositionLogprobs:
        ids, lps, rank = entry
        result: PositionLogprobs = {}
        for j, (tid, lp) in enumerate(zip(ids, lps)):
            if tid in result:
                continue
            text = self.tokenizer.decode([tid], skip_special_tokens=False) \
                if self.tokenizer is not None else None
            result[tid] = Logprob(logprob=lp, rank=rank if j == 0 else j, decoded_token=text)
        return result

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finished
        if kind == OutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == OutputKind.DELTA
        outs = []
        for s in state.samples:
            if delta and not s.changed:
                continue
            outs.append(self._completion(s, finished or s.finish_reason is not None, delta))
            s.changed = False
        if delta and not outs and not finished:
            return None
        prompt_lp = state.prompt_logprobs
        if delta and prompt_lp is not None:
            # Prompt logprobs go out once, with the first output that has them all.
            complete = len(prompt_lp) >= len(state.prompt_token_ids)
            prompt_lp = prompt_lp if complete and not state.prompt_logprobs_sent else None
            state.prompt_logprobs_sent = state.prompt_logprobs_sent or prompt_lp is not None
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=outs,
                             finished=finished, prompt_logprobs=prompt_lp,
                             metrics=state.metrics, num_cached_tokens=state.num_cached_tokens,
                             pooled=state.pooled)

    def _completion(self, s: SampleState, finished: bool, delta: bool) -> CompletionOutput:
        text = ""
        if s.detokenizer is not None:
            text = s.detokenizer.get_next_output_text(finished, delta)
        start = s.sent_tokens if delta else 0
        token_ids = s.token_ids[start:]
        logprobs = s.logprobs[start:] if s.logprobs is not None else None
        s.sent_tokens = len(s.token_ids)
        return CompletionOutput(index=s.index, text=text, token_ids=token_ids,
                                cumulative_logprob=s.cumulative_logprob, logprobs=logprobs,
                                finish_reason=s.finish_reason, stop_reason=s.stop_reason)

    def fail_request(self, child_id: str, message: str
                     ) -> tuple[RequestOutput | None, list[str]]:
        """The engine core ended ``child_id`` with an error: the whole request ends, its
        sample finishing with reason "error" (``extra["error"]`` says why). Returns the
        final output and the ids of its other samples still running (to abort)."""
        entry = self.child_to_parent.get(child_id)
        if entry is None:
            return None, []
        state, sample = entry
        siblings = [child_request_id(state.request_id, s.index, state.params.n)
                    for s in state.samples if s.finish_reason is None and s is not sample]
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = "error" if s is sample else "abort"
                s.changed = True
        state.metrics.finished_time = time.monotonic()
        self._forget(state)
        ro = self._make_output(state)
        if ro is not None:
            ro.extra["error"] = message
        return ro, siblings

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its engine-core ids that may still be running."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        n = state.params.n
        ids = [child_request_id(request_id, s.index, n) for s in state.samples
               if s.finish_reason is None]
        self._forget(state)
        return ids

    def _forget(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        n = state.params.n
        for s in state.samples:
            self.child_to_parent.pop(child_request_id(state.request_id, s.index, n), None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)
