"""Random workloads with random aborts (and random draft tokens with random acceptance):
every request ends, no block leaks, every reference count returns to zero, and the
scheduler's invariants hold at every step."""

from __future__ import annotations

import random
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.config import SchedulerConfig
from kvflow.core import ModelRunnerOutput, Request, RequestStatus, Scheduler
from kvflow.core.scheduler import SwapPolicy
from kvflow.errors import PromptTooLongError
from kvflow.sampling_params import SamplingParams
from kvflow.utils import cdiv

EOS = 2

request_st = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 24),  # max_tokens
    st.integers(0, 6),  # arrival step
    st.integers(1, 3),  # n samples (siblings fork the first one's prompt)
    st.one_of(st.none(), st.integers(0, 30)),  # abort at this step (None: never)
    st.integers(0, 2),  # priority
)


def check_invariants(s: Scheduler) -> None:
    pool = s.kv.pool
    refs = [0] * pool.num_blocks
    for r in s.requests.values():
        for b in r.block_ids:
            refs[b] += 1
        assert len(r.block_ids) * s.block_size >= r.num_computed_tokens
        if r.status == RequestStatus.RUNNING:
            assert r.num_computed_tokens <= r.num_tokens_scheduled_for + r.num_drafts_in_flight
            if not r.num_placeholders:  # no block held only by rejected drafts
                assert len(r.block_ids) <= -(-r.num_computed_tokens // s.block_size)
            # A hashed (cached) block holds K/V of known, computed tokens only.
            for i, b in enumerate(r.block_ids):
                if pool.blocks[b].block_hash is not None:
                    assert (i + 1) * s.block_size <= min(r.num_computed_tokens, r.num_tokens)
                    assert pool.blocks[b].block_hash == r.block_hashes[i]
    assert refs == s.kv.ref_counts()
    assert pool.num_free_blocks == sum(1 for x in refs if x == 0)
    if s.host_pool is not None:
        host = [0] * s.host_pool.num_blocks
        for r in s.requests.values():
            for b in r.swapped_blocks:
                host[b] += 1
        assert host == [b.ref_cnt for b in s.host_pool.blocks]
    for h, block in pool.cached.items():
        assert block.block_hash == h
    assert len(s.running) <= s.config.max_num_seqs
    running_ids = {r.request_id for r in s.running}
    waiting_ids = {r.request_id for r in s.waiting}
    assert not running_ids & waiting_ids


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request_st, min_size=1, max_size=12),
       num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 2, 4, 8]),
       budget=st.integers(4, 64), max_seqs=st.integers(1, 8),
       eos_every=st.integers(3, 50), chunked=st.booleans(), overlap=st.booleans(),
       caching=st.booleans(), mode=st.sampled_from(["recompute", "swap", "auto"]),
       host_blocks=st.integers(0, 24), shared=st.booleans(), spec=st.integers(0, 4),
       spec_seed=st.integers(0, 2**16))
def test_random_workloads(reqs, num_blocks, block_size, budget, max_seqs, eos_every, chunked,
                          overlap, caching, mode, host_blocks, shared, spec, spec_seed):
    """``overlap``: step N+1 is scheduled before step N's tokens are known, as the GPU
    engine does to keep the device busy. ``caching``: automatic prefix caching (prompts
    share prefixes when ``shared``). ``mode``: preemption by recompute, swap or auto.
    ``spec``: up to this many draft tokens proposed after each sampled token, each
    verification keeping a random number of them."""
    rng = random.Random(spec_seed)
    max_len = 64
    if not chunked:
        budget = max(budget, max_len)
    swap = SwapPolicy(mode, host_blocks, recompute_s_per_token=1e-3, swap_s_per_block=2e-3)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                  max_model_len=max_len, enable_chunked_prefill=chunked),
                  block_size, num_blocks, enable_prefix_caching=caching, swap=swap)
    pending = sorted(enumerate(reqs), key=lambda x: x[1][2])
    accepted: dict[str, int | None] = {}
    step = 0
    counter = 0
    inflight = None
    while pending or s.has_unfinished_requests() or inflight:
        while pending and pending[0][1][2] <= step:
            i, (plen, max_tokens, _, n, abort_at, prio) = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens)
            first = None
            for k in range(n):
                rid = f"{k}_{i}"
                tokens = [5] * plen if shared else [10 + i] * plen
                r = Request(rid, tokens, params, eos_token_ids={EOS}, arrival_time=step,
                            priority=prio, fork_parent=first)
                try:
                    s.add_request(r)
                except PromptTooLongError:
                    assert plen + max_tokens > max_len or \
                        cdiv(plen + max_tokens, block_size) > num_blocks
                    break
                accepted[rid] = abort_at
                first = first or r
        aborts = [rid for rid, at in accepted.items() if at == step and rid in s.requests]
        s.finish_requests(aborts)
        so = s.schedule()
        assert so.total_num_scheduled_tokens <= budget
        check_invariants(s)
        ids, sampled, proposals = [], [], []
        for rid, num in so.num_scheduled_tokens.items():
            r = s.requests[rid]
            assert num >= 1
            assert r.num_placeholders <= (2 if overlap else 1)
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            assert len(drafts) < num and r.num_drafts_in_flight == len(drafts)
            ids.append(rid)
            # A sampling chunk ends where the token it samples (a placeholder) begins.
            samples = (r.num_placeholders > 0 and
                       r.num_computed_tokens - len(drafts) == r.num_tokens_scheduled_for - 1)
            assert samples or not drafts
            out = []
            if samples:
                out = drafts[:rng.randint(0, len(drafts))]
                counter += 1
                out.append(EOS if counter % eos_every == 0 else 7)
            sampled.append(out)
            proposals.append([rng.choice([7, 8, EOS]) for _ in range(rng.randint(0, spec))]
                             if samples and spec else [])
        current = (so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled,
                                         spec_token_ids=proposals if spec else None))
        if so.is_empty:
            current = None  # nothing to launch (as in EngineCore.step)
        if overlap:
            current, inflight = inflight, current
        if current is not None:
            for o in s.update_from_output(*current):
                assert o.req_id in accepted
        check_invariants(s)
        step += 1
        assert step < 5000, "the scheduler stopped making progress"
    assert not s.running and not s.waiting and not s.pending_forks
    assert inflight is None
    assert all(r == 0 for r in s.kv.ref_counts())
    assert s.kv.num_free_blocks == num_blocks
    if s.host_pool is not None:
        assert s.host_pool.num_free_blocks == host_blocks


def test_core_imports_without_torch():
    code = ("import sys, kvflow.core, kvflow.config, kvflow.sampling_params; "
            "assert 'torch' not in sys.modules, 'kvflow.core imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
