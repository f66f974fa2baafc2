"""Automatic prefix caching: exact block ids, LRU eviction order, salts, statistics, and
engine outputs identical with caching on and off."""

from __future__ import annotations

import torch

from kvflow import LLM, SamplingParams
from kvflow.config import SchedulerConfig
from kvflow.core import ModelRunnerOutput, Request, Scheduler
from kvflow.core.kv_cache_manager import hash_block

EOS = 2


def make(num_blocks=16, block_size=4) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    return Scheduler(cfg, block_size, num_blocks, enable_prefix_caching=True)


def req(rid, tokens, max_tokens=1, salt=None, t=0.0) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids={EOS}, arrival_time=t, cache_salt=salt)


def run(s: Scheduler):
    so = s.schedule()
    ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        r = s.requests[rid]
        ids.append(rid)
        sampled.append([7] if r.num_computed_tokens == r.num_tokens else [])
    s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
    return so


def test_hashes_chain_and_salt():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], "tenant-a") != a


def test_second_request_reuses_full_blocks():
    s = make()
    s.add_request(req("a", range(10, 20)))
    so = run(s)
    assert so.new_reqs[0].block_ids == [0, 1, 2]
    assert not s.requests  # finished: blocks freed (tail first) but still cached
    s.add_request(req("b", range(10, 20)))
    so = run(s)
    # Blocks 0 and 1 hold tokens 0..7; b computes tokens 8 and 9 in a fresh block.
    assert so.new_reqs[0].block_ids == [0, 1, 3]
    assert so.new_reqs[0].num_computed_tokens == 8 and so.num_scheduled_tokens == {"b": 2}
    assert s.kv.num_hit_tokens == 8 and s.kv.num_query_tokens == 20
    assert abs(s.kv.hit_rate - 0.4) < 1e-9


def test_whole_prompt_cached_still_computes_last_token():
    s = make()
    s.add_request(req("a", range(10, 18), max_tokens=2))
    run(s)
    run(s)
    s.add_request(req("b", range(10, 18)))
    so = run(s)
    assert so.num_scheduled_tokens == {"b": 1}  # token 7 of 8: its logits are needed
    assert so.new_reqs[0].block_ids == [0, 1]  # a's blocks, both; a is gone: no copy
    assert so.blocks_to_copy == []


def test_fully_cached_prompt_copies_a_shared_last_block():
    s = make()
    s.add_request(req("a", range(10, 18), max_tokens=5))
    run(s)
    s.add_request(req("b", range(10, 18)))
    so = run(s)
    # a still holds block 1 and is about to write position 8 into block 2; b writes
    # position 7 into its own copy of block 1.
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    new_b = [r for r in so.new_reqs if r.req_id == "b"][0]
    assert so.blocks_to_copy == [(1, 3)] and new_b.block_ids == [0, 3]


def test_lru_eviction_order():
    s = make(num_blocks=4)
    s.add_request(req("a", range(100, 108)))  # blocks 0, 1
    run(s)
    # Free queue now: 2, 3, then a's blocks tail first: 1, 0.
    s.add_request(req("b", range(200, 212)))  # needs 3 blocks: takes 2, 3 and evicts 1
    so = run(s)
    assert so.new_reqs[0].block_ids == [2, 3, 1]
    s.add_request(req("c", range(100, 108)))
    so = run(s)
    # Block 0 (a's first block) survived; c recomputes tokens 4..7.
    assert so.new_reqs[0].num_computed_tokens == 4 and so.new_reqs[0].block_ids[0] == 0


def test_salt_isolates():
    s = make()
    s.add_request(req("a", range(10, 20), salt="x"))
    run(s)
    s.add_request(req("b", range(10, 20), salt="y"))
    so = run(s)
    assert so.new_reqs[0].num_computed_tokens == 0
    s.add_request(req("c", range(10, 20), salt="x"))
    so = run(s)
    assert so.new_reqs[0].num_computed_tokens == 8


def test_shared_blocks_are_referenced_not_copied():
    s = make()
    s.add_request(req("a", range(10, 30), max_tokens=5))
    run(s)
    s.add_request(req("b", range(10, 30), max_tokens=5))
    so = run(s)
    a, b = s.requests["a"], s.requests["b"]
    # 20 tokens = 5 full blocks, all cached: b shares 4 and copies the 5th, where it
    # computes its last prompt token.
    assert a.block_ids[:4] == b.block_ids[:4]
    assert [s.kv.pool.blocks[i].ref_cnt for i in a.block_ids[:4]] == [2, 2, 2, 2]
    assert so.blocks_to_copy == [(a.block_ids[4], b.block_ids[4])]


def test_engine_outputs_identical_with_and_without_caching():
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 500, (40,), generator=g).tolist()
    prompts = [system + torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 9, 17)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    kw = dict(load_format="dummy", max_model_len=128, num_gpu_blocks_override=64,
              block_size=8, device="cpu")
    off = LLM("tiny-llama", enable_prefix_caching=False, **kw)
    on = LLM("tiny-llama", enable_prefix_caching=True, **kw)
    ref = [off.generate([p], params, use_tqdm=False)[0] for p in prompts]
    got = [on.generate([p], params, use_tqdm=False)[0] for p in prompts]
    for r, o in zip(ref, got):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for x, y in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob) < 1e-4
    assert [o.num_cached_tokens for o in got] == [0, 40, 40]
    assert on.engine.core.scheduler.kv.hit_rate > 0
