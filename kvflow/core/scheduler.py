"""Iteration-level scheduler: one token-budget rule, no prefill/decode modes (pure Python).

Each step every running request is owed ``num_tokens - num_computed_tokens`` tokens
(the rest of its prompt, or one decode token, plus any draft tokens proposed for it:
speculative decoding verifies them in the same step, and afterwards
``num_computed_tokens`` and the block table roll back past the rejected ones). The budget goes to running requests
first, then to waiting ones in order of service. A long prompt takes what is left of the
budget (chunked prefill), so prefill chunks and decodes share a step. When blocks run
out, the running request served last (lowest priority, then latest arrival) is
preempted by recompute: its blocks are freed and it goes back to the waiting queue.
Client requests share seats and prompt tokens fairly (core/fairness.py): a request's n
samples hold a bounded number of seats, and two prompts split a step's prompt budget.
A request whose LoRA adapter has no device slot is passed over while one running adapter
drains for it (core/adapter_seats.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from dataclasses import dataclass

from kvflow.config import SchedulerConfig, check_preemption_mode
from kvflow.core.adapter_seats import AdapterSeats
from kvflow.core.block_pool import BlockPool
from kvflow.core.fairness import StepShares, default_max_seqs_per_request, owes_prompt
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.latency import LatencyTarget
from kvflow.core.repetition import loop_period, should_check
from kvflow.core.request import Request, RequestStatus
from kvflow.core.spec_stats import SpecDecodingStats
from kvflow.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvflow.errors import InvalidParameterError, PromptTooLongError
from kvflow.pooling.params import check_pooling_fits
from kvflow.utils import cdiv


def peak_kv(num_tokens: int, num_prompt_tokens: int, block_size: int,
            sliding_window: int | None = None, max_chunk: int | None = None
            ) -> tuple[int, int]:
    """(tokens, blocks) a request of ``num_tokens`` in all holds at its peak. Without a
    freeing window, all of them. With one (``freeable_window``), a step computing tokens
    c..c+n-1 holds keys from c - window + 1 on: window - 1 + n tokens (n at most
    ``max_chunk`` prompt tokens, the whole prompt without chunked prefill), over at most
    one block more than they fill (the window's first block is partly behind it)."""
    held, blocks = num_tokens, cdiv(num_tokens, block_size)
    if sliding_window is not None:
        chunk = num_prompt_tokens if max_chunk is None else min(num_prompt_tokens, max_chunk)
        held = min(held, sliding_window - 1 + max(chunk, 1))
        blocks = min(blocks, cdiv(held, block_size) + 1)
    return held, blocks


def check_request_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                       block_size: int, num_blocks: int, sliding_window: int | None = None,
                       max_chunk: int | None = None) -> int:
    """Refuse what can never run; return the resolved max_tokens.

    ``max_tokens=None`` means "up to the context length". ``sliding_window``: the window
    behind which a request's blocks are freed (``freeable_window``), so it needs at most
    the blocks of its window plus one step's tokens (``max_chunk``: the most prompt tokens
    a step computes, the whole prompt without chunked prefill), not its whole length.
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
    held, needed = peak_kv(num_prompt_tokens + max_tokens, num_prompt_tokens, block_size,
                           sliding_window, max_chunk)
    if needed > num_blocks:
        raise PromptTooLongError(
            f"the request needs up to {held} tokens "
            f"({needed} KV blocks) but the whole KV cache holds {num_blocks * block_size} "
            f"tokens ({num_blocks} blocks); lower max_tokens or give the cache more memory",
            param="max_tokens")
    return max_tokens


@dataclass(frozen=True)
class SwapPolicy:
    """How preemption treats a request's KV blocks (``--preemption-mode``)."""

    mode: str  # recompute | swap | auto
    num_host_blocks: int
    recompute_s_per_token: float = 0.0  # estimated cost of computing a token again
    swap_s_per_block: float = 0.0  # estimated cost of moving one block one way

    def __post_init__(self) -> None:
        check_preemption_mode(self.mode)


class _Step:
    """What one schedule() call has decided so far."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_scheduled: dict[str, int] = {}
        self.new_block_ids: dict[str, list[int]] = {}
        self.computed_before: dict[str, int] = {}
        self.order: list[Request] = []
        self.preempted: list[Request] = []
        self.samples: set[str] = set()  # requests whose chunk ends in a sample
        self.swap_out: list[tuple[int, int]] = []  # (device block, host block)
        self.swap_in: list[tuple[int, int]] = []  # (host block, device block)
        self.drafts: dict[str, list[int]] = {}  # draft tokens verified this step

    def take(self, req: Request, n: int, ids: list[int], drafts: list[int] = ()) -> None:
        """``n`` counts the request's ``drafts`` too (they are its last tokens)."""
        rid = req.request_id
        self.num_scheduled[rid] = n
        self.new_block_ids[rid] = ids
        self.computed_before[rid] = req.num_computed_tokens
        req.num_computed_tokens += n
        req.spec_token_ids = []  # used now, or stale after this step
        if drafts:
            self.drafts[rid] = list(drafts)
            req.num_drafts_in_flight = len(drafts)
        if req.num_computed_tokens - len(drafts) == req.num_tokens_scheduled_for \
                and req.pooling is None:  # a pooling request is pooled, never sampled
            req.num_placeholders += 1  # this step samples its next token(s)
            self.samples.add(rid)
        self.budget -= n
        self.order.append(req)

    def undo(self, req: Request) -> None:
        """Forget ``req``'s share of this step (it is being preempted)."""
        rid = req.request_id
        if rid not in self.num_scheduled:
            return
        self.budget += self.num_scheduled.pop(rid)
        if rid in self.samples:
            self.samples.discard(rid)
            req.num_placeholders -= 1
        req.num_computed_tokens = self.computed_before.pop(rid)
        if self.drafts.pop(rid, None):
            req.num_drafts_in_flight = 0
        del self.new_block_ids[rid]
        self.order.remove(req)


class Scheduler:
    """Decides, step by step, which requests run and with which KV blocks."""

    def __init__(self, config: SchedulerConfig, block_size: int, num_blocks: int,
                 enable_prefix_caching: bool = False, swap: SwapPolicy | None = None,
                 latency: LatencyTarget | None = None, contiguous_kv: bool = False,
                 sliding_window: int | None = None, max_loras: int = 0,
                 cache_outputs: bool = True) -> None:
        self.config = config
        # --kv-layout contiguous (ablation): reserve max_model_len of KV per request at
        # admission, as an engine without paging must.
        self.contiguous_kv = contiguous_kv
        self.latency = latency  # --target-tpot-ms: caps each step's budget and seats
        # --enable-lora: the most distinct adapters the running requests may hold (the
        # worker's device slots); a request for another one waits until one frees up.
        self.max_loras = max_loras
        self.lora_draining: int | None = None  # core/adapter_seats.py
        self.block_size = block_size
        # sliding_window: blocks behind every layer's window are freed (freeable_window)
        # cache_outputs False (a batch-invariant engine): prompt blocks alone are cached.
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, sliding_window,
                                 cache_outputs)
        self.swap = swap
        self.host_pool = BlockPool(swap.num_host_blocks) if swap and swap.num_host_blocks \
            else None
        self.num_swaps = 0
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key
        self.running: list[Request] = []
        # n > 1: samples that wait for their first sibling to compute the shared prompt.
        self.pending_forks: dict[str, list[Request]] = {}
        # Parent id -> samples not yet admitted that still point at it (fork_parent set).
        self.fork_children: dict[str, dict[str, Request]] = {}
        self.finished_req_ids: set[str] = set()  # the worker must drop their state
        self._in_worker: set[str] = set()  # requests whose full data the worker holds
        # Requests the worker has state for (the per-request extras it keeps across a
        # preemption): told to the worker when they end, even if preempted at the time.
        self._worker_knows: set[str] = set()
        self.num_preemptions = 0
        # Requests whose block table rejected drafts cut back since the worker last heard:
        # req_id -> blocks kept.
        self._kept_blocks: dict[str, int] = {}
        self.spec_stats = SpecDecodingStats()
        self.max_seqs_per_request = config.max_seqs_per_request \
            or default_max_seqs_per_request(config.max_num_seqs)

    # --- admission ----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raises a kvflow error if it can never run."""
        if request.request_id in self.requests:
            raise InvalidParameterError(f"request id {request.request_id!r} is already in use",
                                        param="request_id")
        if request.pooling is not None:  # owed its prompt only
            check_pooling_fits(request.num_prompt_tokens, self.config.max_model_len,
                               self.block_size, self.kv.num_blocks)
            request.max_tokens = 0
        else:
            request.max_tokens = check_request_fits(
                request.num_prompt_tokens, request.sampling_params.max_tokens,
                self.config.max_model_len, self.block_size, self.kv.num_blocks,
                self.kv.sliding_window, self.config.max_prompt_chunk)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        parent = request.fork_parent
        if parent is not None and parent.request_id not in self.requests:
            request.fork_parent = parent = None  # the parent has ended: nothing to share
        if parent is not None:
            self.fork_children.setdefault(parent.request_id, {})[request.request_id] = request
        if parent is not None and parent.num_computed_tokens < parent.num_prompt_tokens:
            self.pending_forks.setdefault(parent.request_id, []).append(request)
        else:
            self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def _unlink_fork(self, req: Request) -> None:
        """``req`` no longer waits on its parent (admitted, or ended)."""
        parent = req.fork_parent
        if parent is not None:
            children = self.fork_children.get(parent.request_id, {})
            children.pop(req.request_id, None)
            if not children:
                self.fork_children.pop(parent.request_id, None)
            req.fork_parent = None

    def _release_forks(self, parent_id: str) -> None:
        for child in self.pending_forks.pop(parent_id, []):
            self._enqueue(child)

    # --- one step -------------------------------------------------------------
    def schedule(self, busy: Collection[str] = (), max_reqs: int | None = None
                 ) -> SchedulerOutput:
        """The next step.

        Pipeline parallelism keeps several steps (batches) in flight at once: ``busy``
        holds the requests of the batches still in flight, which this one leaves out (a
        request is in one batch at a time, and its next token is unknown until its batch
        returns), and ``max_reqs`` caps the requests of this batch so that the batches
        in flight share the running requests instead of the first one taking all.
        """
        budget, seats = self.config.max_num_batched_tokens, self.config.max_num_seqs
        extra_running = extra_head = 0  # --target-ttft-ms: budget to save a first token
        if self.latency is not None:
            full, max_seqs = budget, seats
            budget, seats = self.latency.caps(len(self.running), budget, seats)
            if self.latency.target_ttft_s is not None:
                extra_running, extra_head, seats = self._ttft_extra(budget, full, seats,
                                                                    max_seqs)
        step = _Step(budget + extra_running)
        cap = max_reqs if max_reqs is not None else len(self.running) + len(self.waiting)
        shares = StepShares(self.running, self.waiting, self.max_seqs_per_request)

        # 1. Running requests first: the decodes, then the prompts (oldest first), so
        # that a prompt chunk never takes the budget a running stream's token needs.
        prompts = sorted((r for r in self.running if owes_prompt(r)), key=Request.sort_key)
        order = [r for r in self.running if not owes_prompt(r)] + prompts
        for req in order:
            if step.budget <= 0 or len(step.order) >= cap:
                break
            if req.status != RequestStatus.RUNNING or req.num_drafts_in_flight \
                    or req.request_id in busy:
                # Preempted earlier in this step; drafts: its token count is unknown
                # until the verifying step returns; busy: it runs in another batch.
                continue
            drafts = self._drafts_to_verify(req, step.budget)
            limit = shares.prompt_limit(req, step.budget) if owes_prompt(req) \
                and self.config.enable_chunked_prefill else step.budget
            n = min(req.num_tokens_scheduled_for - req.num_computed_tokens + len(drafts),
                    limit)
            if n <= 0 or self._will_finish(req):
                continue
            ids = self.kv.allocate_slots(req, n)
            while ids is None:
                victim = max(self.running, key=Request.sort_key)
                self._evict(victim, step)
                if victim is req:
                    break
                ids = self.kv.allocate_slots(req, n)
            if ids is None:
                continue  # req itself was preempted
            step.take(req, n, ids, drafts)
            if n - len(drafts) > 1:
                shares.took_prompt(req, n)

        step.budget += extra_head  # after the running requests: it is the head's
        # 2. Waiting requests, in order of service, while budget, seats and blocks last.
        # Not after a preemption: what was just freed goes to the running requests.
        # Static batching (ablation): a batch forms only once the last one has finished.
        # A request whose samples hold all the seats their group may have is passed over
        # (its later samples follow as earlier ones finish); anything else that cannot
        # start now stops admission, so later requests never overtake it.
        admit = not (self.config.batching == "static" and self.running)
        adapters = AdapterSeats(self.running, self.max_loras, self.lora_draining) \
            if self.max_loras and self.waiting else None
        i = 0
        while (admit and not step.preempted and i < len(self.waiting) and step.budget > 0
               and len(step.order) < cap):
            req = self.waiting[i]
            if req.num_placeholders or req.request_id in busy:
                break  # preempted while its last token (or batch) was in flight: wait
            if not shares.seat_free(req):
                i += 1
                continue
            if adapters is not None and not adapters.may_start(req):
                if adapters.stop:
                    break
                i += 1  # its adapter has no slot now (core/adapter_seats.py)
                continue
            if len(self.running) >= seats and not self._make_room(req, step):
                break
            limit = shares.prompt_limit(req, step.budget) \
                if self.config.enable_chunked_prefill else step.budget
            if limit <= 0 or not self._admit(req, step, limit):
                break
            shares.took_seat(req)
            if adapters is not None:
                adapters.started(req)
            n = step.num_scheduled[req.request_id]
            if n > 1:
                shares.took_prompt(req, n)
        if adapters is not None:
            self.lora_draining = adapters.draining
        out = self._build_output(step)
        if self.latency is not None:
            self.latency.on_schedule(out.total_num_scheduled_tokens,
                                     len(out.num_scheduled_tokens),
                                     frozenset(out.num_scheduled_tokens),
                                     self.requests.__contains__)
        return out

    def _ttft_extra(self, budget: int, full: int, seats: int, max_seqs: int
                    ) -> tuple[int, int, int]:
        """(extra budget for the running requests, extra budget for the head of the
        queue, seats) that let the oldest request still before its first token meet the
        TTFT target: a running one mid-prefill (it is usually last in the running order,
        so the extra reaches it after the decodes' one token each), else the head of the
        queue, which may also take a seat beyond the TPOT caps."""
        n = len(self.running)
        for req in self.running:
            if req.num_output_tokens == 0 and not req.num_placeholders \
                    and req.num_computed_tokens < req.num_prompt_tokens:
                need = self.latency.ttft_budget(
                    req.arrival_time, req.num_prompt_tokens - req.num_computed_tokens,
                    n - 1, budget, full)
                if need is not None:
                    return need - budget, 0, seats
        head = self.waiting[0] if self.waiting else None
        if head is not None and head.num_output_tokens == 0 and not head.num_placeholders:
            need = self.latency.ttft_budget(
                head.arrival_time, head.num_tokens - head.num_computed_tokens, n, budget,
                full)
            if need is not None:
                return 0, need - budget, max(seats, min(max_seqs, n + 1))
        return 0, 0, seats

    def _drafts_to_verify(self, req: Request, budget: int) -> list[int]:
        """The proposed drafts this step can verify: only right after a sampled token
        whose value is known (a token still in flight would shift their positions), and
        no more than the budget, max_tokens and max_model_len leave room for (a step
        yields at most one token past its drafts)."""
        if not req.spec_token_ids or req.num_placeholders \
                or req.num_computed_tokens != req.num_tokens - 1:
            return []
        room = min(budget - 1, req.max_tokens - req.num_output_tokens - 1,
                   self.config.max_model_len - req.num_tokens - 1)
        return req.spec_token_ids[:max(room, 0)]

    def _admit(self, req: Request, step: "_Step", limit: int) -> bool:
        """Give a waiting request its blocks and at most ``limit`` tokens (its share of
        the budget)."""
        parent = req.fork_parent
        if not req.block_ids and not req.swapped_blocks:
            if parent is not None:
                # K/V the parent computes in this very step are not in the cache yet.
                self.kv.fork(parent, req, step.computed_before.get(
                    parent.request_id, parent.num_computed_tokens))
            # Mean/CLS pooling needs every prompt token's hidden state: no cache hits.
            if not req.block_ids and not (req.pooling and req.pooling.needs_all_tokens):
                self.kv.get_computed_blocks(req)
        restored = req.num_swapped_tokens
        n = req.num_tokens - max(req.num_computed_tokens, restored)
        if n > limit:
            if not self.config.enable_chunked_prefill:
                return False
            n = limit
        want = restored + n
        if self.contiguous_kv:
            want = max(want, self.config.max_model_len - req.num_computed_tokens)
        ids = self.kv.allocate_slots(req, want)
        while ids is None and self._make_room(req, step):
            ids = self.kv.allocate_slots(req, want)
        if ids is None:
            if not req.swapped_blocks:
                self.kv.free(req)  # give back forked or cached blocks; retry next step
                req.num_computed_tokens = req.num_cached_tokens = 0
            return False
        if req.swapped_blocks:  # resume a swapped-out request where it stopped
            step.swap_in.extend(zip(req.swapped_blocks, req.block_ids))
            self.host_pool.release([self.host_pool.blocks[h] for h in req.swapped_blocks])
            req.swapped_blocks = []
            req.num_computed_tokens, req.num_swapped_tokens = restored, 0
        self.waiting.remove(req)
        self._unlink_fork(req)
        req.status = RequestStatus.RUNNING
        if req.num_preemptions == 0:
            self.kv.num_query_tokens += req.num_tokens
            self.kv.num_hit_tokens += req.num_cached_tokens
        self.running.append(req)
        step.take(req, n, ids)
        return True

    def _make_room(self, req: Request, step: "_Step") -> bool:
        """Priority scheduling: preempt the running request served last if ``req`` comes
        strictly before it (lower priority value). Returns whether one was preempted."""
        if not self.running:
            return False
        victim = max(self.running, key=Request.sort_key)
        if victim.priority <= req.priority:
            return False
        self._evict(victim, step)
        return True

    def _evict(self, victim: Request, step: "_Step") -> None:
        """Preempt a running request, undoing its share of this step if it had one."""
        self.running.remove(victim)
        step.undo(victim)
        self._preempt(victim, step)
        step.preempted.append(victim)

    def _will_finish(self, req: Request) -> bool:
        """True when the tokens in flight already reach max_tokens or max_model_len."""
        if not req.num_placeholders:
            return False
        return (req.num_output_tokens + req.num_placeholders >= req.max_tokens
                or req.num_tokens_scheduled_for >= self.config.max_model_len)

    def _preempt(self, req: Request, step: "_Step") -> None:
        if self._should_swap(req):
            nblocks = cdiv(req.num_computed_tokens, self.block_size)
            host = self.host_pool.allocate(nblocks)
            req.swapped_blocks = [b.block_id for b in host]
            req.num_swapped_tokens = req.num_computed_tokens
            step.swap_out.extend(zip(req.block_ids[:nblocks], req.swapped_blocks))
            self.num_swaps += 1
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        req.spec_token_ids = []
        self._kept_blocks.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._in_worker.discard(req.request_id)
        self._enqueue(req)

    def _should_swap(self, req: Request) -> bool:
        """Swap (copy the blocks to host memory) or recompute later, per request."""
        policy = self.swap
        if policy is None or self.host_pool is None or policy.mode == "recompute":
            return False
        nblocks = cdiv(req.num_computed_tokens, self.block_size)
        if nblocks == 0 or nblocks > self.host_pool.num_free_blocks:
            return False
        if policy.mode == "swap":
            return True
        # auto: moving the blocks out and back in against computing the tokens again.
        swap_s = 2 * nblocks * policy.swap_s_per_block
        return swap_s < req.num_computed_tokens * policy.recompute_s_per_token

    def _build_output(self, step: "_Step") -> SchedulerOutput:
        new_reqs, cached_reqs = [], []
        for req in step.order:
            rid = req.request_id
            if rid in self._in_worker:
                cached_reqs.append(CachedRequestData(rid, step.new_block_ids[rid],
                                                     step.computed_before[rid],
                                                     self._kept_blocks.pop(rid, None)))
            else:
                self._in_worker.add(rid)
                self._worker_knows.add(rid)
                new_reqs.append(NewRequestData(
                    req_id=rid, token_ids=list(req.all_token_ids),
                    num_prompt_tokens=req.num_prompt_tokens,
                    sampling_params=req.sampling_params, block_ids=list(req.block_ids),
                    num_computed_tokens=step.computed_before[rid],
                    eos_token_ids=sorted(req.eos_token_ids), pooling=req.pooling,
                    lora_request=req.lora_request))
        out = SchedulerOutput(
            new_reqs=new_reqs, cached_reqs=cached_reqs,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=sum(step.num_scheduled.values()),
            preempted_req_ids={r.request_id for r in step.preempted},
            finished_req_ids=self.finished_req_ids,
            blocks_to_copy=self.kv.take_pending_copies(),
            blocks_to_swap_out=step.swap_out, blocks_to_swap_in=step.swap_in,
            scheduled_spec_decode_tokens=step.drafts)
        self.finished_req_ids = set()
        return out

    # --- results ---------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, free what finished."""
        row = {rid: i for i, rid in enumerate(runner_out.req_ids)}
        outputs: list[EngineCoreOutput] = []
        self.spec_stats.observe_times(runner_out.spec_draft_time_s,
                                      runner_out.spec_verify_time_s)
        for rid in sched_out.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue  # finished or aborted while the step ran
            i = row.get(rid)
            sampled = runner_out.sampled_token_ids[i] if i is not None else []
            num_drafts = len(sched_out.scheduled_spec_decode_tokens.get(rid, ()))
            if num_drafts:
                self._roll_back_rejected(req, num_drafts, max(len(sampled) - 1, 0))
            if sampled:
                req.num_placeholders -= 1
            new_tokens: list[int] = []
            for token in sampled:
                req.append_output_token(token)
                new_tokens.append(token)
                if self._check_stop(req, token):
                    break
            if (runner_out.spec_token_ids is not None and i is not None and new_tokens
                    and req.status == RequestStatus.RUNNING):
                req.spec_token_ids = list(runner_out.spec_token_ids[i])
            logprobs = None
            if runner_out.logprobs is not None and i is not None and runner_out.logprobs[i]:
                logprobs = runner_out.logprobs[i][: len(new_tokens)]
            prompt_lp = runner_out.prompt_logprobs.get(rid)
            pooled = runner_out.pooled.get(rid) if req.pooling is not None else None
            if pooled is not None:  # its prompt is computed and pooled: done
                req.status = RequestStatus.FINISHED_STOPPED
            if req.num_computed_tokens >= req.num_prompt_tokens and rid in self.pending_forks:
                self._release_forks(rid)
            if new_tokens or prompt_lp or req.is_finished():
                outputs.append(EngineCoreOutput(
                    req_id=rid, new_token_ids=new_tokens, new_logprobs=logprobs,
                    new_prompt_logprobs=prompt_lp, finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason, num_cached_tokens=req.num_cached_tokens,
                    pooled=pooled))
            if req.is_finished():
                # A request preempted while this step ran waits instead of running.
                (self.running if req in self.running else self.waiting).remove(req)
                self._drop(req)
        return outputs

    def _roll_back_rejected(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """After verification: the K/V written for rejected drafts is garbage. Step
        ``num_computed_tokens`` back past them and free the blocks that held only them
        (no hash was registered for those: hashes cover known tokens only)."""
        req.num_drafts_in_flight = 0
        self.spec_stats.observe(num_drafts, num_accepted)
        if req.status != RequestStatus.RUNNING:
            return  # preempted while the step ran: its blocks are already gone
        req.num_computed_tokens -= num_drafts - num_accepted
        if self.kv.trim(req):
            self._kept_blocks[req.request_id] = len(req.block_ids)

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
            guard = sp.repetition_guard
            if guard and not sp.ignore_eos and should_check(req.num_output_tokens) \
                    and loop_period(req.all_token_ids, req.num_prompt_tokens, guard):
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = "repetition"
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
            self._unlink_fork(req)
            req.status = status
            req.stop_reason = stop_reason
            self._drop(req)
            ended.append(req)
        return ended

    def _drop(self, req: Request) -> None:
        self.kv.free(req)
        self._kept_blocks.pop(req.request_id, None)
        if req.swapped_blocks:
            self.host_pool.release([self.host_pool.blocks[h] for h in req.swapped_blocks])
            req.swapped_blocks = []
        del self.requests[req.request_id]
        self._in_worker.discard(req.request_id)
        if req.request_id in self._worker_knows:
            self._worker_knows.discard(req.request_id)
            self.finished_req_ids.add(req.request_id)
        # Samples still waiting for this one's prompt now compute it themselves.
        self._release_forks(req.request_id)
        for child in self.fork_children.pop(req.request_id, {}).values():
            child.fork_parent = None

    # --- recovery after a failed step ---------------------------------------------
    def reset_after_failed_step(self, failed: set[str]) -> list[str]:
        """A step that scheduled the requests in ``failed`` raised, so what it should have
        written (KV, sampled tokens) is unknown. Put every running request back in the
        waiting queue to be recomputed from its known tokens, as a recompute preemption
        does, and forget every token still in flight. Returns the ids the worker must drop.

        The failed step's requests register no further prefix-cache blocks: their KV for
        that step may never have been written.
        """
        reset = []
        for req in self.running:
            if req.request_id in failed:
                req.num_computed_tokens = 0  # keeps blocks of the failed step uncached
            self.kv.free(req)
            req.num_computed_tokens = req.num_cached_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self._in_worker.discard(req.request_id)
            reset.append(req)
        self.running = []
        for req in self.requests.values():
            req.num_placeholders = 0  # nothing is in flight any more
            if req.swapped_blocks and req.request_id in failed:
                # Its swap-out may not have happened: recompute instead.
                self.host_pool.release([self.host_pool.blocks[h] for h in req.swapped_blocks])
                req.swapped_blocks, req.num_swapped_tokens = [], 0
        for req in reset:
            self._enqueue(req)
        return [r.request_id for r in reset]

    # --- state ------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def kv_slot_usage(self) -> tuple[int, int]:
        """(slots of the blocks running requests hold, tokens stored in them): the gap
        is allocated memory that holds nothing (a block shared by several requests counts
        once per holder on both sides)."""
        slots = filled = 0
        for r in self.running:
            slots += len(r.block_ids) * self.block_size
            filled += min(r.num_computed_tokens, len(r.block_ids) * self.block_size)
        return slots, filled

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(v) for v in self.pending_forks.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_drafts(self) -> bool:
        """Whether a running request has proposed drafts waiting to be verified."""
        return any(req.spec_token_ids for req in self.running)
