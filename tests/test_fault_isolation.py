"""Per-request fault isolation in the engine core: a request that makes the worker fail
ends with an error; the rest of the batch finishes and the engine keeps serving."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.sampling_params import OutputKind

POISON = 501  # the dummy prompts draw from [3, 500)


def tiny(**kw) -> LLM:
    args = dict(load_format="dummy", max_model_len=256, num_gpu_blocks_override=64,
                block_size=4, max_num_batched_tokens=64, device="cpu")
    args.update(kw)
    return LLM("tiny-llama", **args)


def prompts(n: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (length,), generator=g).tolist() for _ in range(n)]


def assert_idle(llm: LLM) -> None:
    core = llm.engine.core
    s = core.scheduler
    assert not s.requests and not s.running and not s.waiting and not s.pending_forks
    assert s.kv.num_free_blocks == core.num_blocks
    assert all(c == 0 for c in s.kv.ref_counts())
    core.step()  # hands the worker the ids of the last requests that ended
    runner = core.executor.runner
    worker = getattr(runner, "step_builder", runner)  # owns the persistent batch
    assert not worker.batch.req_ids and not worker.extras


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_failing_request_ends_alone(monkeypatch, async_scheduling):
    monkeypatch.setenv("KVFLOW_FAULT_TOKEN", str(POISON))
    llm = tiny(async_scheduling=async_scheduling)
    good = prompts(6)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(good, params)]
    bad = prompts(1, seed=1)[0]
    bad[5] = POISON
    # The poisoned request arrives in the middle of the batch, n=2 to fail both samples.
    mixed = good[:3] + [bad] + good[3:]
    ps = [params] * 3 + [params.clone(n=2, temperature=0.7, seed=3)] + [params] * 3
    outs = llm.generate(mixed, ps)
    failed = outs[3]
    assert failed.finished and "error" in failed.extra
    assert "injected fault" in failed.extra["error"]
    assert {c.finish_reason for c in failed.outputs} <= {"error", "abort"}
    assert "error" in {c.finish_reason for c in failed.outputs}
    others = [o for i, o in enumerate(outs) if i != 3]
    # Everyone else finished with the tokens they get without the fault.
    assert [o.outputs[0].token_ids for o in others] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in others)
    assert llm.engine.core.num_step_failures >= 2  # the batch, then the probe alone
    assert_idle(llm)
    # The engine keeps serving.
    again = llm.generate(good[:2], params)
    assert [o.outputs[0].token_ids for o in again] == expected[:2]
    assert_idle(llm)


def test_failure_mid_generation_and_streaming(monkeypatch):
    """A request that fails on arrival while the others are mid-decode (streaming
    deltas): they lose no token and end with exactly the tokens of a run without it."""
    monkeypatch.setenv("KVFLOW_FAULT_TOKEN", str(POISON))
    llm = tiny()
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                            output_kind=OutputKind.DELTA)
    good = prompts(3, seed=2)
    ref = [o.outputs[0].token_ids for o in llm.generate(good, params.clone(
        output_kind=OutputKind.CUMULATIVE))]
    for i, p in enumerate(good):
        engine.add_request(f"g{i}", p, params)
    got: dict[str, list[int]] = {f"g{i}": [] for i in range(3)}
    finished: dict[str, str] = {}
    for _ in range(5):
        for ro in engine.step():
            got[ro.request_id] += ro.outputs[0].token_ids if ro.outputs else []
    bad = prompts(1, seed=9)[0] + [POISON]
    engine.add_request("bad", bad, params)
    while engine.has_unfinished_requests():
        for ro in engine.step():
            if ro.request_id == "bad":
                finished["bad"] = ro.outputs[0].finish_reason
                continue
            for c in ro.outputs:
                got[ro.request_id] += c.token_ids
    assert finished == {"bad": "error"}
    assert [got[f"g{i}"] for i in range(3)] == ref
    assert_idle(llm)


def test_engine_gives_up_when_every_step_fails(monkeypatch):
    """Not one request's fault: when steps keep failing with nothing succeeding in
    between, the error propagates (the engine core exits, as before)."""
    from kvflow.engine import core as core_mod

    llm = tiny()
    calls = {"n": 0}
    real = llm.engine.core.executor.execute_model_async

    def broken(so):
        if so.total_num_scheduled_tokens:
            calls["n"] += 1
            raise RuntimeError("device lost")
        return real(so)

    monkeypatch.setattr(llm.engine.core.executor, "execute_model_async", broken)
    params = SamplingParams(max_tokens=4)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(prompts(12), params)
    assert calls["n"] == core_mod.MAX_CONSECUTIVE_STEP_FAILURES + 1


def test_out_of_range_values_are_bounded_in_the_core():
    """Defence in depth: values the API would refuse, sent straight to the engine core,
    are bounded or refused there instead of reaching the worker's tensors."""
    from kvflow.core.sched_output import EngineCoreRequest
    from kvflow.errors import InvalidParameterError

    llm = tiny()
    core = llm.engine.core
    vocab = core.config.model.arch.vocab_size
    # top_k at or beyond the vocabulary means no limit (huge values included).
    for top_k in (vocab, 100_000, 2**63 + 5):
        out = llm.generate([prompts(1)[0]], SamplingParams(top_k=top_k, max_tokens=3,
                                                           seed=1))
        assert len(out[0].outputs[0].token_ids) == 3
    def req(**kw):
        base = dict(request_id="x", prompt_token_ids=[5, 6, 7],
                    sampling_params=SamplingParams(max_tokens=2), eos_token_ids=[],
                    arrival_time=0.0)
        base.update(kw)
        return EngineCoreRequest(**base)
    with pytest.raises(InvalidParameterError, match="prompt"):
        core.add_request(req(prompt_token_ids=[5, vocab + 3]))
    with pytest.raises(InvalidParameterError, match="stop_token_ids"):
        core.add_request(req(sampling_params=SamplingParams(stop_token_ids=[vocab])))
    with pytest.raises(InvalidParameterError, match="min_tokens"):
        llm.generate([[5, 6]], SamplingParams(min_tokens=10**6, max_tokens=None))
    with pytest.raises(InvalidParameterError, match="priority"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), priority=[2**64])
    assert_idle(llm)


def test_isolation_with_a_full_kv_cache(monkeypatch):
    """Few blocks: preemptions happen, and a suspect may have to wait for blocks to run
    alone while the others make progress."""
    monkeypatch.setenv("KVFLOW_FAULT_TOKEN", str(POISON))
    llm = tiny(num_gpu_blocks_override=14, max_model_len=56)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    good = prompts(5, seed=4)
    expected = [o.outputs[0].token_ids for o in llm.generate(good, params)]
    bad = prompts(1, seed=5)[0] + [POISON]
    outs = llm.generate(good[:2] + [bad] + good[2:], params)
    assert outs[2].outputs[0].finish_reason == "error"
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 2] == expected
    assert_idle(llm)
