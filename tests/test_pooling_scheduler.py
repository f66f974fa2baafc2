"""Pooling requests in the scheduler (no torch): owed their prompt tokens only, chunked
under the token budget beside decodes, never sampled, finished by the worker's pooled
vector; prefix-cache hits only where the pooling reads the last token alone."""

from __future__ import annotations

import pytest

from kvflow.config import SchedulerConfig
from kvflow.core import ModelRunnerOutput, Request, RequestStatus, Scheduler
from kvflow.errors import InvalidParameterError, PromptTooLongError
from kvflow.pooling.params import PoolingParams
from kvflow.sampling_params import SamplingParams


def make_scheduler(budget: int = 8, caching: bool = False) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=32,
                          enable_chunked_prefill=True)
    return Scheduler(cfg, 4, 32, enable_prefix_caching=caching)


def pool_req(rid: str, n: int, kind: str = "last") -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=None),
                   pooling=PoolingParams(pooling_type=kind))


def step(s: Scheduler, pooled: set[str] = frozenset()):
    """One step: generation requests that reach their last token sample 7; the pooling
    requests in ``pooled`` return a vector."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = s.requests[rid]
        sampled.append([7] if r.pooling is None and r.num_computed_tokens == r.num_tokens
                       else [])
    out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled,
                            pooled={rid: [0.6, 0.8] for rid in pooled if rid in ids})
    return so, {o.req_id: o for o in s.update_from_output(so, out)}


def test_pooling_request_is_chunked_beside_a_decode_and_never_samples():
    s = make_scheduler(budget=8)
    s.add_request(Request("g", [1, 2, 3], SamplingParams(max_tokens=5)))
    step(s)
    s.add_request(pool_req("p", 20))  # the whole context would not fit a generation
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"g": 1, "p": 7}  # decode first, then a chunk
    assert "p" not in outs and s.requests["p"].num_placeholders == 0
    step(s)
    so, outs = step(s, pooled={"p"})  # the last 6 prompt tokens: pooled, done
    assert so.num_scheduled_tokens["p"] == 6
    assert outs["p"].pooled == [0.6, 0.8] and outs["p"].finish_reason == "stop"
    assert outs["p"].new_token_ids == []
    assert "p" not in s.requests and s.kv.num_free_blocks == s.kv.num_blocks - len(
        s.requests["g"].block_ids)


def test_pooling_fits_the_whole_context_not_more():
    s = make_scheduler()
    s.add_request(pool_req("full", 32))
    with pytest.raises(PromptTooLongError) as e:
        s.add_request(pool_req("over", 33))
    assert e.value.param == "input"
    with pytest.raises(InvalidParameterError):
        s.add_request(pool_req("empty", 0))


@pytest.mark.parametrize("kind,hits", [("last", True), ("mean", False), ("cls", False)])
def test_prefix_cache_only_for_last_token_pooling(kind, hits):
    s = make_scheduler(budget=32, caching=True)
    s.add_request(pool_req("a", 12, kind))
    step(s, pooled={"a"})
    s.add_request(pool_req("b", 12, kind))
    so, _ = step(s, pooled={"b"})
    assert (so.new_reqs[0].num_computed_tokens > 0) == hits
    assert so.new_reqs[0].pooling.pooling_type == kind


def test_pooling_request_waits_for_its_vector():
    """Its prompt is computed but the step's vector is not in yet (an overlapped step):
    it is owed nothing, stays running, and finishes when the vector arrives."""
    s = make_scheduler(budget=8)
    s.add_request(pool_req("p", 6))
    so = s.schedule()
    req = s.requests["p"]
    assert s.update_from_output(so, ModelRunnerOutput(req_ids=["p"],
                                                      sampled_token_ids=[[]])) == []
    assert s.schedule().is_empty and req.status == RequestStatus.RUNNING
    out = s.update_from_output(so, ModelRunnerOutput(req_ids=["p"], sampled_token_ids=[[]],
                                                     pooled={"p": [1.0]}))
    assert out[0].pooled == [1.0] and req.is_finished() and not s.running
