"""Pipeline parallelism with several batches in flight (one per stage, like vLLM's virtual
engines), on CPU with gloo: the batches hold disjoint requests, and the tokens, logprobs
and prompt logprobs equal TP 1's through preemption and aborts."""

from __future__ import annotations

import pytest

from kvflow import LLM
from kvflow.errors import InvalidParameterError
from kvflow.sampling_params import SamplingParams

PROMPTS = [[1, 5, 7, 9, 11, 13], [3, 4, 5], list(range(20, 60)), [8, 9], [100, 101, 102]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2,
                        ignore_eos=True)


def tiny(**kw) -> LLM:
    kw.setdefault("num_gpu_blocks_override", 64)
    kw.setdefault("max_model_len", 256)
    return LLM("tiny-qwen3", load_format="dummy", device="cpu",
               skip_tokenizer_init=True, seed=3, distributed_timeout=30, **kw)


class BatchLog:
    """Wraps the engine core's executor: records, at each launch, the requests of the
    batches still in flight, so a test can check that no request is in two at once."""

    def __init__(self, llm: LLM) -> None:
        core = llm.engine.core
        self.core = core
        self.executor = core.executor
        self.max_in_flight = 0
        self.overlaps: list[set[str]] = []
        core.executor = self

    def execute_model_async(self, so):
        in_flight = [set(s.num_scheduled_tokens) for s, _ in self.core._pipeline]
        self.max_in_flight = max(self.max_in_flight, len(in_flight) + (not so.is_empty))
        mine = set(so.num_scheduled_tokens)
        for other in in_flight:
            if mine & other:
                self.overlaps.append(mine & other)
        return self.executor.execute_model_async(so)

    def __getattr__(self, name):
        return getattr(self.executor, name)


def outputs(llm: LLM, params: SamplingParams = GREEDY, prompts=PROMPTS):
    return [o for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_same(ref, got) -> None:
    for r, g in zip(ref, got):
        ro, go = r.outputs[0], g.outputs[0]
        assert go.token_ids == ro.token_ids
        if ro.logprobs is not None:
            for lr, lg in zip(ro.logprobs, go.logprobs):
                assert list(lr) == list(lg)  # same top ids in the same order
                for tok in lr:
                    assert lg[tok].logprob == pytest.approx(lr[tok].logprob, abs=1e-4)
        if r.prompt_logprobs is not None:
            assert len(g.prompt_logprobs) == len(r.prompt_logprobs)
            for lr, lg in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
                assert list(lr) == list(lg)
                for tok in lr:
                    assert lg[tok].logprob == pytest.approx(lr[tok].logprob, abs=1e-4)


@pytest.fixture(scope="module")
def reference():
    seeded = SamplingParams(temperature=1.0, top_k=40, seed=11, max_tokens=10,
                            ignore_eos=True)
    with tiny() as one:
        return outputs(one), outputs(one, seeded), seeded


def test_pp2_two_batches_in_flight_equal_tp1(reference):
    greedy_ref, seeded_ref, seeded = reference
    with tiny(pipeline_parallel_size=2) as llm:
        assert llm.engine.core._depth == 2
        log = BatchLog(llm)
        assert_same(greedy_ref, outputs(llm))
        # Seeded sampling on the last stage: the same tokens as one rank.
        assert [o.outputs[0].token_ids for o in outputs(llm, seeded)] == \
            [o.outputs[0].token_ids for o in seeded_ref]
        assert log.max_in_flight == 2  # the stages did work on two batches at once
        assert log.overlaps == []  # and no request was in both
        assert not llm.engine.core.has_unfinished_requests()


def test_pp2_one_batch_in_flight_equals_tp1(reference):
    with tiny(pipeline_parallel_size=2, pipeline_in_flight=1) as llm:
        assert llm.engine.core._depth == 1
        assert_same(reference[0], outputs(llm))


def test_pp2_in_flight_with_preemption_equals_tp1():
    """Few KV blocks: requests are preempted (some while their batch is in flight) and
    recomputed; greedy tokens do not change."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    with tiny(num_gpu_blocks_override=12, max_model_len=128) as one:
        ref = outputs(one, params, prompts)
        assert one.engine.core.scheduler.num_preemptions > 0
    with tiny(num_gpu_blocks_override=12, max_model_len=128,
                  pipeline_parallel_size=2) as llm:
        log = BatchLog(llm)
        assert_same(ref, outputs(llm, params, prompts))
        assert llm.engine.core.scheduler.num_preemptions > 0
        assert log.overlaps == [] and log.max_in_flight == 2


def test_pp2_in_flight_abort(reference):
    """A request aborted while its batch is in flight ends there; the others go on."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with tiny(pipeline_parallel_size=2) as llm:
        engine = llm.engine
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        engine.step()
        engine.step()
        in_flight = {rid for so, _ in engine.core._pipeline for rid in so.num_scheduled_tokens}
        assert in_flight
        victim = sorted(in_flight)[0]
        engine.abort_request(victim)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id != victim
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert not engine.core.has_unfinished_requests()
        assert victim not in done
        for i, r in enumerate(reference[0]):
            if str(i) != victim:
                assert done[str(i)] == r.outputs[0].token_ids


def test_async_scheduling_needs_one_batch_in_flight():
    with pytest.raises(InvalidParameterError, match="pipeline-in-flight 1"):
        tiny(pipeline_parallel_size=2, async_scheduling=True)
