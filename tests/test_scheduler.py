"""Scheduler unit tests: hand-built runner outputs, exact block ids (no torch needed)."""

from __future__ import annotations

import pytest

from kvflow.config import SchedulerConfig
from kvflow.core import ModelRunnerOutput, Request, RequestStatus, Scheduler
from kvflow.errors import InvalidParameterError, PromptTooLongError
from kvflow.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=16, block_size=4, budget=64, max_seqs=8, max_len=64,
                   chunked=True) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          max_model_len=max_len, enable_chunked_prefill=chunked)
    return Scheduler(cfg, block_size, num_blocks)


def req(rid: str, n_prompt: int, max_tokens: int = 8, t: float = 0.0, **sp) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sp)
    return Request(rid, list(range(10, 10 + n_prompt)), params, eos_token_ids={EOS},
                   arrival_time=t)


def run_step(s: Scheduler, tokens: dict[str, int] | None = None, default: int = 7):
    """One step; every request whose chunk reaches its last token samples a token."""
    so = s.schedule()
    ids, sampled = [], []
    for rid, n in so.num_scheduled_tokens.items():
        r = s.requests[rid]
        ids.append(rid)
        done = r.num_computed_tokens == r.num_tokens  # counted at schedule time
        sampled.append([(tokens or {}).get(rid, default)] if done else [])
    outs = s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
    return so, {o.req_id: o for o in outs}


def test_single_request_prefill_then_decode():
    s = make_scheduler()
    s.add_request(req("a", 10))
    so, outs = run_step(s)
    assert so.num_scheduled_tokens == {"a": 10}
    assert [n.block_ids for n in so.new_reqs] == [[0, 1, 2]]
    assert so.new_reqs[0].num_computed_tokens == 0
    assert outs["a"].new_token_ids == [7]
    so, _ = run_step(s)  # token 11 of 12 slots in 3 blocks: no new block
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.cached_reqs[0].new_block_ids == [] and so.cached_reqs[0].num_computed_tokens == 10
    run_step(s)
    so, _ = run_step(s)  # position 12 needs a 4th block
    assert so.cached_reqs[0].new_block_ids == [3]


def test_chunked_prefill_mixes_with_decode():
    s = make_scheduler(budget=8)
    s.add_request(req("a", 3, t=0))
    run_step(s)
    s.add_request(req("b", 12, t=1))
    so, outs = run_step(s)
    # a decodes one token; b gets the remaining 7 of the budget.
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    assert so.new_reqs[0].block_ids == [1, 2]
    assert "b" not in outs  # mid-prompt: nothing sampled
    so, outs = run_step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 5}
    # a's position 4 opens block 3; b's positions 7..11 need a third block: 4.
    assert [(c.req_id, c.new_block_ids) for c in so.cached_reqs] == [("a", [3]), ("b", [4])]
    assert outs["b"].new_token_ids == [7]


def test_no_chunking_waits_for_budget():
    s = make_scheduler(num_blocks=32, budget=64, chunked=False, max_len=64)
    s.add_request(req("a", 40, t=0))
    s.add_request(req("b", 30, t=1))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 40}  # b does not fit in the rest of the budget
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 30}


def test_preemption_takes_latest_arrival_and_resumes_first():
    s = make_scheduler(num_blocks=4, block_size=4)
    s.add_request(req("a", 4, max_tokens=8, t=0))
    s.add_request(req("b", 4, max_tokens=8, t=1))
    so, _ = run_step(s)
    assert [n.block_ids for n in so.new_reqs] == [[0], [1]]
    run_step(s)  # both need a second block: 2, 3
    for _ in range(4):
        so, _ = run_step(s)
    # Position 8 needs a fifth block: b (later arrival) is preempted, its blocks freed.
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    assert s.requests["b"].status == RequestStatus.PREEMPTED and s.waiting[0].request_id == "b"
    assert s.requests["a"].block_ids == [0, 2, 3]  # b's freed blocks, tail first
    assert s.requests["b"].num_preemptions == 1
    while "a" in s.requests:
        run_step(s)
    so, _ = run_step(s)
    # b resumes with its whole sequence (prompt and the 5 tokens generated) recomputed.
    assert so.new_reqs[0].req_id == "b" and len(so.new_reqs[0].token_ids) == 9
    assert so.new_reqs[0].num_computed_tokens == 0 and so.num_scheduled_tokens == {"b": 9}


def test_preempting_itself_when_alone_is_impossible():
    # A lone request always fits: admission refuses what needs more blocks than exist.
    s = make_scheduler(num_blocks=2, block_size=4, max_len=64)
    with pytest.raises(PromptTooLongError, match="KV blocks"):
        s.add_request(req("a", 4, max_tokens=5))
    s.add_request(req("b", 4, max_tokens=4))
    while s.has_unfinished_requests():
        so, _ = run_step(s)
        assert not so.preempted_req_ids


@pytest.mark.parametrize("n_prompt,max_tokens,match", [
    (0, 4, "empty"), (64, 4, "maximum context length"), (60, 10, "max_tokens")])
def test_refused_requests(n_prompt, max_tokens, match):
    s = make_scheduler(max_len=64)
    with pytest.raises(InvalidParameterError, match=match):
        s.add_request(req("x", n_prompt, max_tokens=max_tokens))
    assert not s.requests and not s.waiting


def test_max_tokens_none_fills_context():
    s = make_scheduler(max_len=16, num_blocks=16)
    r = req("a", 10, max_tokens=None)
    s.add_request(r)
    assert r.max_tokens == 6
    n = 0
    while s.has_unfinished_requests():
        run_step(s)
        n += 1
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 16


def test_stop_rules():
    s = make_scheduler()
    s.add_request(req("eos", 3, t=0))
    s.add_request(req("ign", 3, t=1, ignore_eos=True, max_tokens=2))
    s.add_request(req("minp", 3, t=2, min_tokens=2))
    s.add_request(req("stopid", 3, t=3, stop_token_ids=[9]))
    _, outs = run_step(s, {"eos": EOS, "ign": EOS, "minp": EOS, "stopid": 9})
    assert outs["eos"].finish_reason == "stop" and outs["eos"].stop_reason is None
    assert outs["stopid"].finish_reason == "stop" and outs["stopid"].stop_reason == 9
    assert outs["ign"].finish_reason is None and outs["minp"].finish_reason is None
    _, outs = run_step(s, {"ign": EOS, "minp": EOS})
    assert outs["ign"].finish_reason == "length" and outs["minp"].finish_reason == "stop"
    assert not s.has_unfinished_requests()
    assert all(r == 0 for r in s.kv.ref_counts())


def test_abort_frees_and_tells_worker():
    s = make_scheduler()
    s.add_request(req("a", 9))
    run_step(s)
    assert s.kv.num_free_blocks == 13
    s.finish_requests(["a"])
    assert s.kv.num_free_blocks == 16 and not s.requests
    so = s.schedule()
    assert so.finished_req_ids == {"a"} and so.is_empty
    s.finish_requests(["a", "unknown"])  # idempotent


def test_abort_waiting_request():
    s = make_scheduler(max_seqs=1)
    s.add_request(req("a", 4, t=0))
    s.add_request(req("b", 4, t=1))
    run_step(s)
    s.finish_requests(["b"])
    assert not s.waiting and "b" not in s.requests
    assert s.schedule().finished_req_ids == set()  # the worker never saw b


def test_max_num_seqs():
    s = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 4, t=i))
    so, _ = run_step(s)
    assert set(so.num_scheduled_tokens) == {"0", "1"}


def test_fork_shares_prompt_blocks_with_copy_on_write():
    s = make_scheduler(block_size=4)
    parent = req("0_r", 10, t=0)
    child = Request("1_r", list(parent.prompt_token_ids), parent.sampling_params,
                    eos_token_ids={EOS}, arrival_time=0, fork_parent=parent)
    s.add_request(parent)
    s.add_request(child)
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"0_r": 10}  # the child waits for the prompt
    so, _ = run_step(s)
    # The child shares all three prompt blocks and computes only position 9 itself. That
    # write lands in shared block 2, so the child gets a copy first (block 3).
    assert so.num_scheduled_tokens == {"0_r": 1, "1_r": 1}
    child_new = [n for n in so.new_reqs if n.req_id == "1_r"][0]
    assert child_new.block_ids == [0, 1, 3] and child_new.num_computed_tokens == 9
    assert so.blocks_to_copy == [(2, 3)]
    assert s.kv.ref_counts()[:4] == [2, 2, 1, 1]
    s.finish_requests(["0_r"])
    assert s.kv.ref_counts()[:4] == [1, 1, 0, 1]
    s.finish_requests(["1_r"])
    assert all(r == 0 for r in s.kv.ref_counts())


def test_parent_copies_a_block_it_shares_before_writing():
    s = make_scheduler(block_size=4, budget=64)
    parent = req("0_r", 6, t=0)
    s.add_request(parent)
    run_step(s)  # prompt: blocks 0, 1 (positions 4, 5 of 8 used)
    child = Request("1_r", list(parent.prompt_token_ids), parent.sampling_params,
                    eos_token_ids={EOS}, arrival_time=0, fork_parent=parent)
    s.add_request(child)
    so, _ = run_step(s)
    # The parent writes position 6 into block 1 before the child shares it; the child
    # then copies block 1 (into 2) to write position 5.
    assert so.num_scheduled_tokens == {"0_r": 1, "1_r": 1}
    assert so.blocks_to_copy == [(1, 2)]
    so, _ = run_step(s)
    assert so.blocks_to_copy == []  # each now owns the block it writes
    assert s.requests["0_r"].block_ids == [0, 1] and s.requests["1_r"].block_ids == [0, 2]


def test_fork_parent_finishing_early_releases_children():
    s = make_scheduler(block_size=4, budget=4)
    parent = req("0_r", 10, t=0)
    child = Request("1_r", list(parent.prompt_token_ids), parent.sampling_params,
                    eos_token_ids={EOS}, arrival_time=0, fork_parent=parent)
    s.add_request(parent)
    s.add_request(child)
    run_step(s)  # parent computes 4 of 10 prompt tokens
    s.finish_requests(["0_r"])
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"1_r": 4}  # computes its own prompt from scratch


def test_duplicate_request_id():
    s = make_scheduler()
    s.add_request(req("a", 4))
    with pytest.raises(InvalidParameterError, match="already in use"):
        s.add_request(req("a", 4))


def swap_scheduler(mode="swap", host_blocks=8, **kw):
    from kvflow.core.scheduler import SwapPolicy

    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    return Scheduler(cfg, 4, kw.get("num_blocks", 4),
                     swap=SwapPolicy(mode, host_blocks, recompute_s_per_token=1e-3,
                                     swap_s_per_block=1e-3))


def test_swap_preemption_resumes_without_recompute():
    s = swap_scheduler()
    s.add_request(req("a", 4, max_tokens=8, t=0))
    s.add_request(req("b", 4, max_tokens=8, t=1))
    for _ in range(6):
        so, _ = run_step(s)
    # As in the recompute test, a needs a fifth block at position 8; b is swapped out.
    assert so.preempted_req_ids == {"b"}
    assert so.blocks_to_swap_out == [(1, 0), (3, 1)]  # b's device blocks -> host 0, 1
    b = s.requests["b"]
    assert b.swapped_blocks == [0, 1] and b.num_swapped_tokens == 8 and not b.block_ids
    assert s.host_pool.num_free_blocks == 6
    while "a" in s.requests:
        run_step(s)
    so, _ = run_step(s)
    # b comes back with its KV copied in: only its pending token is computed.
    assert so.num_scheduled_tokens == {"b": 1}
    assert so.new_reqs[0].num_computed_tokens == 8
    assert so.blocks_to_swap_in == list(zip([0, 1], so.new_reqs[0].block_ids[:2]))
    assert s.host_pool.num_free_blocks == 8 and s.num_swaps == 1


def test_swap_falls_back_to_recompute_without_host_room():
    s = swap_scheduler(host_blocks=1)
    s.add_request(req("a", 4, max_tokens=8, t=0))
    s.add_request(req("b", 4, max_tokens=8, t=1))
    for _ in range(6):
        so, _ = run_step(s)
    assert so.preempted_req_ids == {"b"} and not so.blocks_to_swap_out
    assert s.requests["b"].num_swapped_tokens == 0


def test_auto_mode_swaps_only_when_cheaper():
    from kvflow.core.scheduler import SwapPolicy

    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    for per_block, swapped in ((1.0, False), (1e-6, True)):
        s = Scheduler(cfg, 4, 4, swap=SwapPolicy("auto", 8, recompute_s_per_token=1e-3,
                                                  swap_s_per_block=per_block))
        s.add_request(req("a", 4, max_tokens=8, t=0))
        s.add_request(req("b", 4, max_tokens=8, t=1))
        for _ in range(6):
            so, _ = run_step(s)
        assert bool(so.blocks_to_swap_out) == swapped


def test_priority_order_of_service():
    s = make_scheduler(max_seqs=1)
    low = req("low", 4, t=0)
    low.priority = 5
    s.add_request(low)
    hi = req("high", 4, t=1)
    hi.priority = -1
    s.add_request(hi)
    so, _ = run_step(s)
    assert list(so.num_scheduled_tokens) == ["high"]  # lower value first, despite arriving later


def test_higher_priority_arrival_preempts_lower_priority():
    s = make_scheduler(max_seqs=1)
    low = req("low", 4, max_tokens=10, t=0)
    low.priority = 3
    s.add_request(low)
    run_step(s)
    run_step(s)
    urgent = req("urgent", 4, t=1)
    urgent.priority = 0
    s.add_request(urgent)
    so, _ = run_step(s)
    assert so.preempted_req_ids == {"low"}
    assert "urgent" in so.num_scheduled_tokens and "low" not in so.num_scheduled_tokens


def test_preemption_takes_lowest_priority_first():
    s = make_scheduler(num_blocks=6, block_size=4)
    for rid, prio, t in (("p0", 0, 0), ("p9", 9, 1), ("p1", 1, 2)):
        r = req(rid, 2, max_tokens=14, t=t)
        r.priority = prio
        s.add_request(r)
    preempted = []
    for _ in range(12):
        so, _ = run_step(s)
        preempted += sorted(so.preempted_req_ids)
    assert preempted[0] == "p9"  # the lowest priority goes first, not the latest arrival


def _lora_req(rid: str, adapter: int | None, max_tokens: int, t: float) -> Request:
    from kvflow.lora.request import LoRARequest

    r = req(rid, 4, max_tokens=max_tokens, t=t)
    r.lora_request = None if adapter is None else LoRARequest(f"a{adapter}", adapter, "/x")
    return r


def test_adapters_without_a_slot_are_passed_over_while_one_drains():
    """Two slots, requests round-robin over three adapters: the first request of the
    third adapter is passed over (later requests of running adapters and of the base
    start), one running adapter drains for it (its new requests wait too), and the freed
    slot goes to the blocked request as soon as the drained adapter's last one ends."""
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=64)
    s = Scheduler(cfg, 4, 64, max_loras=2)
    lengths = {"r0": 6, "r1": 3, "r2": 4, "r3": 4, "r4": 10, "r5": 4, "b": 4}
    adapters = {"r0": 1, "r1": 2, "r2": 3, "r3": 1, "r4": 2, "r5": 3, "b": None}
    for i, rid in enumerate(lengths):
        s.add_request(_lora_req(rid, adapters[rid], lengths[rid], t=i))
    so, _ = run_step(s)
    # r2 (adapter 3) has no slot: passed over. Adapters 1 and 2 hold one request each,
    # and the tie goes to the lowest id: adapter 1 drains, so r3 waits too; r4
    # (adapter 2) and the base request start.
    assert set(so.num_scheduled_tokens) == {"r0", "r1", "r4", "b"}
    assert s.lora_draining == 1
    assert [r.request_id for r in s.waiting] == ["r2", "r3", "r5"]

    def running_adapters():
        return {r.lora_request.lora_int_id for r in s.running if r.lora_request}

    steps = 0
    while "r2" not in {r.request_id for r in s.running}:
        assert running_adapters() <= {1, 2}
        run_step(s)
        steps += 1
    # r0's 6 tokens end in the 6th step; the 7th gives adapter 1's slot to r2
    assert steps == 6 and running_adapters() == {2, 3}
    assert [r.request_id for r in s.waiting] == ["r3"]  # r5 (adapter 3) started too


def test_a_request_blocked_on_its_adapter_is_not_starved():
    """A stream of new requests for the two running adapters cannot hold the third
    adapter's request back for longer than one adapter's requests take to finish."""
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32, max_model_len=64)
    s = Scheduler(cfg, 4, 256, max_loras=2)
    s.add_request(_lora_req("x1", 1, 5, t=0))
    s.add_request(_lora_req("x2", 2, 5, t=1))
    s.add_request(_lora_req("blocked", 3, 5, t=2))
    t = 3
    for step in range(40):
        for a in (1, 2):  # new requests for the running adapters every step
            s.add_request(_lora_req(f"n{t}", a, 5, t=t))
            t += 1
        run_step(s)
        if "blocked" in {r.request_id for r in s.running}:
            break
    assert step <= 6, step  # x1's 5 tokens (and adapter 1's newcomers held back)
