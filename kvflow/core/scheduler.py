"""Iteration-level scheduler: one token-budget rule, no prefill/decode modes (pure Python).

Each step every running request is owed ``num_tokens - num_computed_tokens`` tokens
(the rest of its prompt, or one decode token). The budget goes to running requests
first, then to waiting ones in order of service. A long prompt takes what is left of the
budget (chunked prefill), so prefill chunks and decodes share a step. When blocks run
out, the running request served last (lowest priority, then latest arrival) is
preempted by recompute: its blocks are freed and it goes back to the waiting queue.
"""

from __future__ import annotations

import bisect

from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager, cdiv
from kvflow.core.request import Request, RequestStatus
from kvflow.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvflow.errors import InvalidParameterError, PromptTooLongError


def check_request_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                       block_size: int, num_blocks: int) -> int:
    """Refuse what can never run; return the resolved max_tokens.

    ``max_tokens=None`` means "up to the context length".
    """
    if num_prompt_tokens == 0:
        raise InvalidParameterError("the prompt is empty; give at least one token",
                                    param="prompt")
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {num_prompt_tokens} tokens, leaving no room to generate; shorten the prompt "
            f"to at most {max_model_len - 1} tokens", param="prompt")
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt_tokens
    elif num_prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for max_tokens); lower max_tokens to at most "
            f"{max_model_len - num_prompt_tokens} or shorten the prompt", param="max_tokens")
    needed = cdiv(num_prompt_tokens + max_tokens, block_size)
    if needed > num_blocks:
        raise PromptTooLongError(
            f"the request needs up to {num_prompt_tokens + max_tokens} tokens "
            f"({needed} KV blocks) but the whole KV cache holds {num_blocks * block_size} "
            f"tokens ({num_blocks} blocks); lower max_tokens or give the cache more memory",
            param="max_tokens")
    return max_tokens


class Scheduler:
    """Decides, step by step, which requests run and with which KV blocks."""

    def __init__(self, config: SchedulerConfig, block_size: int, num_blocks: int) -> None:
        self.config = config
        self.block_size = block_size
        self.kv = KVCacheManager(num_blocks, block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key
        self.running: list[Request] = []
        # n > 1: samples that wait for their first sibling to compute the shared prompt.
        self.pending_forks: dict[str, list[Request]] = {}
        self.finished_req_ids: set[str] = set()  # the worker must drop their state
        self._in_worker: set[str] = set()  # requests whose full data the worker holds
        self.num_preemptions = 0

    # --- admission ----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raises a kvflow error if it can never run."""
        if request.request_id in self.requests:
            raise InvalidParameterError(f"request id {request.request_id!r} is already in use",
                                        param="request_id")
        request.max_tokens = check_request_fits(
            request.num_prompt_tokens, request.sampling_params.max_tokens,
            self.config.max_model_len, self.block_size, self.kv.num_blocks)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        parent = request.fork_parent
        if parent is not None and parent.request_id in self.requests and (
                parent.num_computed_tokens < parent.num_prompt_tokens):
            self.pending_forks.setdefault(parent.request_id, []).append(request)
        else:
            self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        keys = [r.sort_key() for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, request.sort_key()), request)

    def _release_forks(self, parent_id: str) -> None:
        for child in self.pending_forks.pop(parent_id, []):
            self._enqueue(child)

    # --- one step -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        computed_before: dict[str, int] = {}
        order: list[Request] = []
        preempted: list[Request] = []
        samples: set[str] = set()  # requests whose chunk this step ends in a sample

        def take(req: Request, n: int, ids: list[int]) -> None:
            nonlocal budget
            num_scheduled[req.request_id] = n
            new_block_ids[req.request_id] = ids
            computed_before[req.request_id] = req.num_computed_tokens
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens_scheduled_for:
                req.num_placeholders += 1  # this step samples its next token
                samples.add(req.request_id)
            budget -= n
            order.append(req)

        # 1. Running requests first.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens_scheduled_for - req.num_computed_tokens, budget)
            if n <= 0 or self._will_finish(req):
                i += 1
                continue
            ids = self.kv.allocate_slots(req, n)
            while ids is None:
                victim = max(self.running, key=Request.sort_key)
                vi = self.running.index(victim)
                self.running.pop(vi)
                if victim.request_id in num_scheduled:  # already given tokens this step
                    budget += num_scheduled.pop(victim.request_id)
                    if victim.request_id in samples:
                        victim.num_placeholders -= 1
                    del new_block_ids[victim.request_id], computed_before[victim.request_id]
                    order.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if vi < i:
                    i -= 1
                if victim is req:
                    break
                ids = self.kv.allocate_slots(req, n)
            if ids is None:
                continue  # req itself was preempted; running[i] is now the next one
            take(req, n, ids)
            i += 1

        # 2. Waiting requests, in order of service, while budget, seats and blocks last.
        # Not after a preemption: what was just freed goes to the running requests.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if req.num_placeholders:
                break  # preempted while its last token was in flight: wait for it
            parent = req.fork_parent
            if parent is not None and not req.block_ids:
                # K/V the parent computes in this very step are not in the cache yet.
                self.kv.fork(parent, req, computed_before.get(parent.request_id,
                                                              parent.num_computed_tokens))
            n = req.num_tokens - req.num_computed_tokens
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            ids = self.kv.allocate_slots(req, n)
            if ids is None:
                self.kv.free(req)  # give back any forked blocks; retry next step
                req.num_computed_tokens = req.num_cached_tokens = 0
                break
            self.waiting.pop(0)
            req.fork_parent = None
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            take(req, n, ids)

        return self._build_output(order, num_scheduled, new_block_ids, computed_before,
                                  preempted)

    def _will_finish(self, req: Request) -> bool:
        """True when the tokens in flight already reach max_tokens or max_model_len."""
        if not req.num_placeholders:
            return False
        return (req.num_output_tokens + req.num_placeholders >= req.max_tokens
                or req.num_tokens_scheduled_for >= self.config.max_model_len)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._in_worker.discard(req.request_id)
        self._enqueue(req)

    def _build_output(self, order, num_scheduled, new_block_ids, computed_before,
                      preempted) -> SchedulerOutput:
        new_reqs, cached_reqs = [], []
        for req in order:
            rid = req.request_id
            if rid in self._in_worker:
                cached_reqs.append(CachedRequestData(rid, new_block_ids[rid],
                                                     computed_before[rid]))
            else:
                self._in_worker.add(rid)
                new_reqs.append(NewRequestData(
                    req_id=rid, token_ids=list(req.all_token_ids),
                    num_prompt_tokens=req.num_prompt_tokens,
                    sampling_params=req.sampling_params, block_ids=list(req.block_ids),
                    num_computed_tokens=computed_before[rid]))
        out = SchedulerOutput(
            new_reqs=new_reqs, cached_reqs=cached_reqs, num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids={r.request_id for r in preempted},
            finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        return out

    # --- results ---------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, free what finished."""
        row = {rid: i for i, rid in enumerate(runner_out.req_ids)}
        outputs: list[EngineCoreOutput] = []
        for rid in sched_out.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue  # finished or aborted while the step ran
            i = row.get(rid)
            sampled = runner_out.sampled_token_ids[i] if i is not None else []
            new_tokens: list[int] = []
            for token in sampled:
                req.num_placeholders -= 1
                req.append_output_token(token)
                new_tokens.append(token)
                if self._check_stop(req, token):
                    break
            logprobs = None
            if runner_out.logprobs is not None and i is not None and runner_out.logprobs[i]:
                logprobs = runner_out.logprobs[i][: len(new_tokens)]
            prompt_lp = runner_out.prompt_logprobs.get(rid)
            if req.num_computed_tokens >= req.num_prompt_tokens and rid in self.pending_forks:
                self._release_forks(rid)
            if new_tokens or prompt_lp or req.is_finished():
                outputs.append(EngineCoreOutput(
                    req_id=rid, new_token_ids=new_tokens, new_logprobs=logprobs,
                    new_prompt_logprobs=prompt_lp, finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason, num_cached_tokens=req.num_cached_tokens))
            if req.is_finished():
                # A request preempted while this step ran waits instead of running.
                (self.running if req in self.running else self.waiting).remove(req)
                self._drop(req)
        return outputs

    def _check_stop(self, req: Request, token: int) -> bool:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in sp.all_stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return True
        if (req.num_output_tokens >= req.max_tokens
                or req.num_tokens >= self.config.max_model_len):
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    # --- ending requests from outside (aborts, stop strings) --------------------
    def finish_requests(self, req_ids: list[str] | set[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                        stop_reason: int | str | None = None) -> list[Request]:
        """End requests wherever they are; returns the ones that were still alive."""
        ended = []
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            else:
                parent = req.fork_parent
                if parent is not None and req in self.pending_forks.get(parent.request_id, []):
                    self.pending_forks[parent.request_id].remove(req)
            req.status = status
            req.stop_reason = stop_reason
            self._drop(req)
            ended.append(req)
        return ended

    def _drop(self, req: Request) -> None:
        self.kv.free(req)
        del self.requests[req.request_id]
        if req.request_id in self._in_worker:
            self._in_worker.discard(req.request_id)
            self.finished_req_ids.add(req.request_id)
        # Samples still waiting for this one's prompt now compute it themselves.
        self._release_forks(req.request_id)
        for child in self.waiting:
            if child.fork_parent is req:
                child.fork_parent = None

    # --- state ------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(v) for v in self.pending_forks.values())

    @property
    def num_running(self) -> int:
        return len(self.running)
