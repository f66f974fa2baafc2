"""Draft tokens in the scheduler (no torch): they are tokens a request is owed, get KV
slots ahead, and after verification num_computed_tokens and the block table roll back
past the rejected ones. Exact block ids, as in test_scheduler.py."""

from __future__ import annotations

from kvflow.config import SchedulerConfig
from kvflow.core import ModelRunnerOutput, Request, RequestStatus, Scheduler
from kvflow.core.kv_cache_manager import hash_block
from kvflow.sampling_params import SamplingParams

EOS = 2


def make(num_blocks=16, block_size=4, budget=64, caching=False, max_len=64) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=max_len,
                          enable_chunked_prefill=True)
    return Scheduler(cfg, block_size, num_blocks, enable_prefix_caching=caching)


def req(rid: str, prompt: list[int], max_tokens: int = 16, **sp) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sp), eos_token_ids={EOS})


def step(s: Scheduler, emit: dict[str, list[int]], propose: dict[str, list[int]] | None = None,
         logprobs: bool = False):
    """Schedule, then return ``emit[rid]`` (accepted drafts + one sampled token) for every
    request whose chunk samples, and ``propose[rid]`` as its next drafts."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [emit.get(rid, []) for rid in ids]
    lps = [[([t], [-0.5], 1) for t in toks] for toks in sampled] if logprobs else None
    outs = s.update_from_output(so, ModelRunnerOutput(
        req_ids=ids, sampled_token_ids=sampled, logprobs=lps,
        spec_token_ids=[(propose or {}).get(rid, []) for rid in ids]))
    return so, {o.req_id: o for o in outs}


def test_drafts_get_slots_and_rejected_blocks_are_freed():
    s = make()
    s.add_request(req("a", list(range(10, 16))))  # 6 prompt tokens: blocks 0, 1
    so, _ = step(s, {"a": [7]}, {"a": [20, 21, 22, 23]})
    assert so.new_reqs[0].block_ids == [0, 1]
    r = s.requests["a"]
    assert r.spec_token_ids == [20, 21, 22, 23]
    # Verify 4 drafts: positions 6..10 -> a third block, allocated ahead.
    so, outs = step(s, {"a": [20, 30]})  # keeps draft 20, rejects 21..23, samples 30
    assert so.num_scheduled_tokens == {"a": 5}
    assert so.scheduled_spec_decode_tokens == {"a": [20, 21, 22, 23]}
    assert so.cached_reqs[0].new_block_ids == [2]
    assert outs["a"].new_token_ids == [20, 30]
    # Known: 6 + 7, 20, 30 = 9 tokens; computed: 8 (30's K/V comes next step). Block 2
    # held only rejected drafts (positions 8..10): freed.
    assert r.num_computed_tokens == 8 and r.num_tokens == 9
    assert r.block_ids == [0, 1]
    assert s.kv.ref_counts()[2] == 0
    assert s.spec_stats.num_draft_tokens == 4 and s.spec_stats.num_accepted_tokens == 1
    assert s.spec_stats.accepted_per_position == [1, 0, 0, 0]
    # The worker hears about the cut with the next step; block 2 (it held nothing worth
    # caching) went to the head of the free queue, so the request gets it back and its
    # blocks stay in order.
    so, _ = step(s, {"a": [31]})
    assert so.scheduled_spec_decode_tokens == {}
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.cached_reqs[0].num_kept_blocks == 2
    assert so.cached_reqs[0].new_block_ids == [2]
    assert so.cached_reqs[0].num_computed_tokens == 8


def test_all_accepted_keeps_blocks_and_yields_k_plus_one():
    s = make()
    s.add_request(req("a", list(range(10, 17))))  # 7 tokens
    step(s, {"a": [7]}, {"a": [20, 21]})
    so, outs = step(s, {"a": [20, 21, 22]}, {"a": [23]})
    assert so.cached_reqs[0].new_block_ids == [2]  # positions 7..9
    r = s.requests["a"]
    assert outs["a"].new_token_ids == [20, 21, 22]
    assert r.num_computed_tokens == 10 and r.num_tokens == 11 and r.block_ids == [0, 1, 2]
    so, _ = step(s, {"a": [40]})
    assert so.cached_reqs[0].num_kept_blocks is None
    assert s.spec_stats.mean_accepted_length == 2.0  # (2 + 1) + (0 + 1) over 2 steps


def test_prefix_cache_hashes_only_accepted_tokens():
    s = make(caching=True)
    s.add_request(req("a", [10, 11, 12]))
    step(s, {"a": [7]}, {"a": [8, 9, 10, 11]})
    step(s, {"a": [40]})  # every draft rejected: known tokens 10 11 12 7 40
    r = s.requests["a"]
    assert r.num_computed_tokens == 4 and r.block_ids == [0]
    step(s, {"a": [41]})  # allocation registers block 0 (full, computed)
    assert set(s.kv.pool.cached) == {hash_block(None, [10, 11, 12, 7])}
    # A prompt made of the rejected drafts finds only the first block.
    s.add_request(req("b", [10, 11, 12, 7, 8, 9, 10, 11, 5]))
    so, _ = step(s, {"a": [42], "b": [7]})
    assert s.requests["b"].num_cached_tokens == 4


def test_max_tokens_and_stop_inside_an_accepted_run():
    s = make()
    s.add_request(req("a", [10, 11, 12], max_tokens=3))
    step(s, {"a": [7]}, {"a": [20, 21, 22, 23]})
    so, outs = step(s, {"a": [20, 30]})
    # One token generated, three allowed: room for one draft plus the token after it.
    assert so.scheduled_spec_decode_tokens == {"a": [20]}
    assert outs["a"].new_token_ids == [20, 30] and outs["a"].finish_reason == "length"
    assert not s.requests and s.kv.num_free_blocks == 16

    s.add_request(req("b", [10, 11, 12], logprobs=0))
    step(s, {"b": [7]}, {"b": [20, EOS, 22]})
    so, outs = step(s, {"b": [20, EOS, 22, 30]}, logprobs=True)
    assert outs["b"].new_token_ids == [20, EOS] and outs["b"].finish_reason == "stop"
    assert [e[0] for e in outs["b"].new_logprobs] == [[20], [EOS]]
    assert not s.requests and all(c == 0 for c in s.kv.ref_counts())


def test_budget_and_context_limit_the_drafts():
    s = make(budget=3)
    s.add_request(req("a", [10, 11]))
    step(s, {"a": [7]}, {"a": [20, 21, 22, 23]})
    so, _ = step(s, {"a": [20, 21, 5]})
    assert so.scheduled_spec_decode_tokens == {"a": [20, 21]}  # budget 3 = 1 + 2 drafts
    s = make(max_len=8)
    s.add_request(req("a", [10, 11, 12, 13, 14], max_tokens=None))
    step(s, {"a": [7]}, {"a": [20, 21, 22, 23]})
    so, outs = step(s, {"a": [20, 5]})
    assert so.scheduled_spec_decode_tokens == {"a": [20]}  # 6 known: room for 2 more tokens
    assert outs["a"].finish_reason == "length"


def test_no_drafts_during_prefill_or_after_preemption():
    s = make(num_blocks=5, budget=64)
    s.add_request(req("a", list(range(10, 16)), max_tokens=10))
    step(s, {"a": [7]}, {"a": [20, 21, 22]})
    # b's prompt (8 tokens) is prefilled beside a's drafts (positions 6..9: block 2).
    s.add_request(req("b", list(range(30, 38)), max_tokens=4))
    so, _ = step(s, {"a": [20, 21, 22, 23], "b": [7]}, {"a": [1, 2, 3], "b": [1, 2]})
    assert so.scheduled_spec_decode_tokens == {"a": [20, 21, 22]}
    assert so.new_reqs[0].req_id == "b" and so.new_reqs[0].block_ids == [3, 4]
    a = s.requests["a"]
    assert a.block_ids == [0, 1, 2] and a.num_computed_tokens == 10
    # a's next drafts need a fourth block; none is free, so b (later) is preempted and
    # its proposed drafts are dropped.
    so, _ = step(s, {"a": [8]})
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert so.cached_reqs[0].new_block_ids == [4]  # b's blocks were freed tail first
    assert a.block_ids == [0, 1, 2]  # all three drafts rejected: block 4 is free again
    b = s.requests["b"]
    assert so.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    assert b.spec_token_ids == [] and b.block_ids == []


def test_request_with_drafts_in_flight_waits_for_their_verdict():
    """Overlapped scheduling: while a verification step runs, the request's token count is
    unknown, so the next step leaves it out; a plain decode in flight gets no drafts."""
    s = make()
    s.add_request(req("a", [10, 11, 12]))
    step(s, {"a": [7]}, {"a": [20, 21]})
    so1 = s.schedule()
    assert so1.scheduled_spec_decode_tokens == {"a": [20, 21]}
    so2 = s.schedule()
    assert so2.is_empty
    s.update_from_output(so1, ModelRunnerOutput(["a"], [[20, 9]], spec_token_ids=[[1]]))
    so3 = s.schedule()  # drafts proposed after the verdict are fresh: verified now
    assert so3.scheduled_spec_decode_tokens == {"a": [1]}
    s.update_from_output(so3, ModelRunnerOutput(["a"], [[5]], spec_token_ids=[[]]))
    so4 = s.schedule()
    so5 = s.schedule()  # a's plain decode is in flight: scheduled again, without drafts
    assert so4.num_scheduled_tokens == so5.num_scheduled_tokens == {"a": 1}
    s.update_from_output(so4, ModelRunnerOutput(["a"], [[6]], spec_token_ids=[[3, 4]]))
    so6 = s.schedule()
    assert so6.scheduled_spec_decode_tokens == {}  # proposed before so5's token: stale
    assert s.requests["a"].num_drafts_in_flight == 0


def test_abort_with_drafts_in_flight_frees_everything():
    s = make()
    s.add_request(req("a", [10, 11, 12]))
    step(s, {"a": [7]}, {"a": [20, 21, 22, 23, 24, 25]})
    so = s.schedule()
    assert s.requests["a"].block_ids == [0, 1, 2]
    s.finish_requests(["a"])
    assert s.update_from_output(so, ModelRunnerOutput(["a"], [[20, 1]])) == []
    assert s.kv.num_free_blocks == 16
