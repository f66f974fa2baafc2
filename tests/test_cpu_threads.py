"""The CPU step thread policy (kvflow/cpu/threads.py) on a fake clock, its use by
the engine, and the exact fast paths of the eager decode layer (rotary, RMSNorm)."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers.norm import rms_norm_ref
from kvflow.layers.rotary import apply_rotary, apply_rotary_ref, rotary_tables
from kvflow.cpu import threads as cpu_threads
from kvflow.cpu.threads import StepThreadPolicy


class FakeMachine:
    """A clock and a thread setting; a step costs what ``cost[threads]`` says."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.now = 0.0
        self.threads = 2
        self.cost = cost
        self.log: list[int] = []

    def clock(self) -> float:
        return self.now

    def set_threads(self, n: int) -> None:
        self.threads = n

    def step(self, policy: StepThreadPolicy, num_tokens: int) -> None:
        def work():
            self.log.append(self.threads)
            self.now += self.cost[self.threads]
        policy.run(num_tokens, work)


def _policy(machine: FakeMachine) -> StepThreadPolicy:
    return StepThreadPolicy(2, clock=machine.clock, set_threads=machine.set_threads)


def test_picks_the_faster_thread_count_and_restores_the_setting():
    m = FakeMachine({1: 0.008, 2: 0.150})  # a loaded machine: one thread wins
    policy = _policy(m)
    for _ in range(40):
        m.step(policy, 1)
    # One step each settles a clear case (the slow count is not tried again for a while).
    assert sorted(m.log[:2]) == [1, 2]
    assert m.log[2:] == [1] * 38  # 40 steps: < RETRY_SECONDS of the clock
    assert m.threads == 2  # the engine's setting outside the step

    m2 = FakeMachine({1: 0.051, 2: 0.032})  # a quiet machine, a bigger model
    policy = _policy(m2)
    for _ in range(30):
        m2.step(policy, 1)
    warm = 2 * cpu_threads.WARMUP_STEPS  # close figures: a few steps each first
    assert sorted(m2.log[:warm]) == [1] * (warm // 2) + [2] * (warm // 2)
    assert m2.log[warm:] == [2] * (30 - warm)


def test_follows_a_change_of_load():
    m = FakeMachine({1: 0.010, 2: 0.005})
    policy = _policy(m)
    for _ in range(20):
        m.step(policy, 1)
    assert m.log[-1] == 2
    m.cost[2] = 0.200  # other work arrives: two threads now wait on each other
    for _ in range(3000):
        m.step(policy, 1)
    recent = m.log[-1000:]
    assert recent.count(1) > 0.99 * len(recent)  # retries of 2 threads are rare
    # ... and each retry costs at most one slow step per RETRY_SECONDS
    assert recent.count(2) <= 1000 * 0.010 / cpu_threads.RETRY_SECONDS + 2


def test_size_classes_and_large_steps():
    assert [StepThreadPolicy.size_class(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == \
        [0, 1, 2, 2, 3, 3, 4, 4, 5, 6]
    assert StepThreadPolicy.size_class(100_000) == StepThreadPolicy.size_class(
        cpu_threads.TOP_CLASS_TOKENS) == 12
    m = FakeMachine({1: 1.0, 2: 4.0})  # a loaded machine, a prompt-heavy step
    policy = _policy(m)
    for _ in range(200):
        m.step(policy, 80)
    assert set(policy.describe()) == {"65-128 tokens"}
    assert sorted(m.log[:2]) == [1, 2] and m.log[2:].count(1) > 190
    # a retry of the 4-second count waits RETRY_COST of its step times: ~2% of the time
    slow = m.log[2:].count(2)
    assert slow * 4.0 <= m.now / cpu_threads.RETRY_COST + 4.0
    for _ in range(10):
        m.step(policy, 3)
    assert set(policy.describe()) == {"3-4 tokens", "65-128 tokens"}
    one = StepThreadPolicy(1, clock=m.clock, set_threads=m.set_threads)
    assert one.choose(1) == 1 and one.classes == {}


def test_a_failing_step_still_restores_the_thread_count():
    m = FakeMachine({1: 0.001, 2: 0.002})
    policy = _policy(m)

    def boom():
        raise RuntimeError("step failed")
    with pytest.raises(RuntimeError):
        policy.run(1, boom)  # the first step of a class measures one thread
    assert m.threads == 2


def test_engine_uses_the_policy_and_keeps_its_tokens():
    """Greedy tokens are the same with the policy on and off; small steps were timed."""
    args = dict(load_format="dummy", max_model_len=128, num_gpu_blocks_override=64,
                block_size=4, device="cpu", enforce_eager=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(**kw):
        llm = LLM("tiny-llama", **args, **kw)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                             use_tqdm=False)]
        return outs, llm.engine.core.executor.runner.thread_policy

    threads = torch.get_num_threads()
    on, policy = run()
    assert torch.get_num_threads() == threads
    if threads > 1:
        assert policy is not None and policy.classes
    off, policy_off = run(cpu_step_threads="all")
    assert policy_off is None and off == on


def test_bench_runs_all_threads_then_adaptive():
    from argparse import Namespace

    from kvflow.bench.offline import _backends, _kvflow_config
    from kvflow.engine.args import EngineArgs

    labels = _backends(Namespace(backend="threads-all-vs-adaptive"))
    assert labels == ["kvflow-allthreads", "kvflow"]
    args = EngineArgs(model="tiny-llama", load_format="dummy", device="cpu")
    assert _kvflow_config(args, labels[0]).device.cpu_step_threads == "all"
    assert _kvflow_config(args, labels[1]).device.cpu_step_threads == "adaptive"
    with pytest.raises(Exception, match="cpu_step_threads"):
        EngineArgs(model="tiny-llama", load_format="dummy",
                   cpu_step_threads="some").create_engine_config()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_match_the_reference(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=g).to(dtype)
    cos, sin = torch.rand(5, 8, generator=g), torch.rand(5, 8, generator=g)
    out = apply_rotary(x, rotary_tables(cos, sin))
    ref = apply_rotary_ref(x, cos, sin)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(out, ref)  # the same products and sums: bit for bit
    else:
        torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


def test_float32_rms_norm_is_the_hf_formula():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 64, generator=g), torch.randn(64, generator=g)
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(rms_norm_ref(x, w, 1e-5), w * xf)
