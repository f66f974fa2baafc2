"""Latency-target batching (--target-tpot-ms): the step-time model and the scheduler's
caps, driven by a fake clock whose steps cost what a known linear cost function says."""

from __future__ import annotations

import random

import pytest

from kvflow.config import SchedulerConfig
from kvflow.core import ModelRunnerOutput, Request, Scheduler
from kvflow.core.latency import HEADROOM, LatencyTarget, StepTimeModel, StepTimePrior
from kvflow.engine.args import EngineArgs
from kvflow.errors import InvalidParameterError
from kvflow.sampling_params import SamplingParams

EOS = 2
# The "hardware": 10 ms per step, 1 ms per token, 2 ms per sequence.
TRUE = (0.010, 0.001, 0.002)


def cost(tokens: int, seqs: int) -> float:
    return TRUE[0] + TRUE[1] * tokens + TRUE[2] * seqs


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_model_learns_from_varied_steps():
    m = StepTimeModel(StepTimePrior(0.05, 0.0002, 0.0))  # a wrong prior
    rng = random.Random(0)
    for _ in range(200):
        seqs = rng.randint(1, 32)
        tokens = seqs + rng.choice([0, 0, rng.randint(1, 200)])
        m.observe(tokens, seqs, cost(tokens, seqs) * rng.uniform(0.97, 1.03))
    for tokens, seqs in ((1, 1), (16, 16), (200, 4)):
        assert m.predict(tokens, seqs) == pytest.approx(cost(tokens, seqs), rel=0.08)


def test_model_on_decode_only_steps_stays_sane():
    # tokens == seqs always: b and c cannot be told apart, but their sum can.
    m = StepTimeModel(StepTimePrior(0.02, 0.002, 0.0))
    for i in range(300):
        n = 1 + i % 24
        m.observe(n, n, cost(n, n))
    assert all(t >= 0 for t in m.theta)
    for n in (1, 8, 24):
        assert m.predict(n, n) == pytest.approx(cost(n, n), rel=0.05)
    assert m.max_seqs(0.040) == pytest.approx((0.040 - TRUE[0]) / (TRUE[1] + TRUE[2]), abs=1)


def make(target_ms: float | None, clock: FakeClock, max_seqs: int = 64,
         budget: int = 512) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          max_model_len=256, target_tpot_ms=target_ms)
    latency = None
    if target_ms is not None:
        # A prior half of the truth: the fit must correct it from measured steps.
        prior = StepTimePrior(TRUE[0] / 2, TRUE[1] / 2, TRUE[2] / 2)
        latency = LatencyTarget(target_ms / 1e3, StepTimeModel(prior), clock)
    return Scheduler(cfg, block_size=16, num_blocks=1024, latency=latency)


def drive(s: Scheduler, clock: FakeClock, n_requests: int = 48, prompt: int = 24,
          out: int = 24, arrive_every: int = 1):
    """Requests arrive one per step; each step advances the clock by its true cost.
    Returns (step costs, running counts, steps where a running decode was left out)."""
    costs, running, starved = [], [], 0
    added = 0
    for step in range(5000):
        if added < n_requests and step % arrive_every == 0:
            s.add_request(Request(str(added), list(range(10, 10 + prompt)),
                                  SamplingParams(max_tokens=out), eos_token_ids={EOS},
                                  arrival_time=clock.now))
            added += 1
        decoding = [r.request_id for r in s.running
                    if r.num_computed_tokens >= r.num_prompt_tokens]
        so = s.schedule()
        starved += any(rid not in so.num_scheduled_tokens for rid in decoding)
        if so.total_num_scheduled_tokens:
            c = cost(so.total_num_scheduled_tokens, len(so.num_scheduled_tokens))
            costs.append(c)
            running.append(len(so.num_scheduled_tokens))
            clock.now += c
        ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            r = s.requests[rid]
            ids.append(rid)
            sampled.append([7] if r.num_computed_tokens == r.num_tokens else [])
        s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
        if added == n_requests and not s.has_unfinished_requests():
            return costs, running, starved
    raise AssertionError("the requests never finished")


def test_target_keeps_steps_under_it_and_requests_wait():
    target_ms = 50.0
    clock = FakeClock()
    s = make(target_ms, clock)
    costs, running, starved = drive(s, clock)
    warm = costs[8:]  # the first steps run on the (wrong) prior
    assert max(warm) <= target_ms / 1e3 * 1.02
    assert sorted(warm)[int(0.99 * len(warm))] <= target_ms / 1e3
    # The seats the target allows: (0.9 * 50 ms - 10 ms) / 3 ms per decoding sequence.
    seats = int((target_ms / 1e3 * HEADROOM - TRUE[0]) / (TRUE[1] + TRUE[2]))
    assert max(running[8:]) <= seats + 1
    assert starved == 0  # a running request is never left out of a step
    assert s.latency.num_capped_steps > 0


def test_without_target_steps_grow_past_it():
    clock = FakeClock()
    costs, running, _ = drive(make(None, clock), clock)
    assert max(costs) > 0.050 * 1.5 and max(running) > 20


def test_target_costs_throughput_but_finishes_everything():
    c1, c2 = FakeClock(), FakeClock()
    drive(make(None, c1), c1)
    drive(make(50.0, c2), c2)
    # Smaller batches take longer overall, not forever.
    assert c1.now < c2.now < c1.now + 10 * (c1.now - 100.0)


def test_prefill_is_chunked_to_fit_the_target():
    clock = FakeClock()
    s = make(30.0, clock)
    costs, _, _ = drive(s, clock, n_requests=4, prompt=200, out=4, arrive_every=3)
    assert max(costs[4:]) <= 0.030 * 1.02


def test_idle_gaps_are_not_step_times():
    clock = FakeClock()
    s = make(50.0, clock)
    drive(s, clock, n_requests=2)
    before = list(s.latency.model.theta)
    clock.now += 1000.0  # the engine sat idle, then a request came
    drive(s, clock, n_requests=1)
    assert s.latency.model.predict(1, 1) < 0.1, (before, s.latency.model.theta)


def test_target_option_validation():
    with pytest.raises(InvalidParameterError, match="target_tpot_ms"):
        EngineArgs(target_tpot_ms=-1).create_engine_config()
    cfg = EngineArgs(target_tpot_ms=80).create_engine_config()
    assert cfg.scheduler.target_tpot_ms == 80
    from kvflow.engine.core import latency_target

    lt = latency_target(cfg)
    assert lt.target_s == pytest.approx(0.080) and lt.model.prior.source.startswith("host")


def test_bench_goodput_counts_requests_meeting_every_objective():
    from kvflow.bench.serve import RequestResult, format_result, parse_goodput, summarize

    fast = RequestResult(prompt_len=10, success=True, output_tokens=5, ttft_s=0.1,
                         latency_s=0.5)  # TPOT 100 ms
    slow = RequestResult(prompt_len=10, success=True, output_tokens=5, ttft_s=0.1,
                         latency_s=0.9)  # TPOT 200 ms
    late = RequestResult(prompt_len=10, success=True, output_tokens=5, ttft_s=3.0,
                         latency_s=3.4)
    failed = RequestResult(prompt_len=10, error="HTTP 503")
    slos = parse_goodput(["ttft:2000", "tpot:150"])
    assert slos == {"ttft": 2.0, "tpot": 0.15}
    s = summarize([fast, slow, late, failed], duration=2.0, slos=slos)
    assert s["goodput"]["requests_meeting"] == 1 and s["goodput"]["request_goodput"] == 0.5
    assert "Request goodput (req/s):" in format_result(s, 1.0, None)
    for bad in (["ttft"], ["tpot:-1"], ["speed:3"]):
        with pytest.raises(SystemExit, match="--goodput"):
            parse_goodput(bad)


def ttft_of_late_arrival(ttft_ms: float | None, prompt: int) -> tuple[float, list[float], Scheduler]:
    """Long answers fill every seat a 50 ms TPOT target allows; then one request with a
    ``prompt``-token prompt arrives. Returns its TTFT and every step's cost."""
    clock = FakeClock()
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=1024,
                          target_tpot_ms=50.0, target_ttft_ms=ttft_ms)
    prior = StepTimePrior(*TRUE)
    latency = LatencyTarget(0.050, StepTimeModel(prior), clock,
                            None if ttft_ms is None else ttft_ms / 1e3)
    s = Scheduler(cfg, block_size=16, num_blocks=2048, latency=latency)
    for i in range(latency.model.max_seqs(0.050 * HEADROOM)):  # 11 seats
        s.add_request(Request(str(i), list(range(10, 34)), SamplingParams(max_tokens=300),
                              eos_token_ids={EOS}, arrival_time=clock.now))
    costs, first = [], None
    for step in range(3000):
        if step == 40:
            arrived = clock.now
            s.add_request(Request("late", list(range(10, 10 + prompt)),
                                  SamplingParams(max_tokens=4), eos_token_ids={EOS},
                                  arrival_time=clock.now))
        so = s.schedule()
        c = cost(so.total_num_scheduled_tokens, len(so.num_scheduled_tokens))
        costs.append(c)
        clock.now += c
        ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            r = s.requests[rid]
            ids.append(rid)
            done = r.num_computed_tokens == r.num_tokens
            sampled.append([7] if done else [])
            if rid == "late" and done and first is None:
                first = clock.now - arrived
        s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
        if first is not None:
            return first, costs, s
    raise AssertionError("the late request never got its first token")


@pytest.mark.parametrize("prompt", [24, 300])
def test_ttft_target_lets_a_request_in_before_its_deadline(prompt):
    # Without a TTFT target the late request waits for a seat (and, with a long prompt,
    # would then crawl through prefill on what the decodes leave of the budget).
    slow, _, _ = ttft_of_late_arrival(None, prompt)
    assert slow > 2.0
    fast, costs, s = ttft_of_late_arrival(1000.0, prompt)
    assert fast <= 1.0
    assert s.latency.num_ttft_steps >= 1
    # TPOT pays only for the steps that carried its prefill.
    over = [c for c in costs if c > 0.050 * 1.02]
    assert len(over) <= s.latency.num_ttft_steps


def test_ttft_target_does_not_chase_requests_already_late():
    clock = FakeClock()
    lt = LatencyTarget(0.050, StepTimeModel(StepTimePrior(*TRUE)), clock, 0.5)
    # Waited 0.6 s of a 0.5 s target: no override, it waits its turn.
    assert lt.ttft_budget(clock.now - 0.6, 24, 10, 12, 512) is None
    # On time even at the TPOT caps: no override either.
    assert lt.ttft_budget(clock.now, 4, 1, 40, 512) is None
    # More than the whole engine budget could compute in time: no override.
    assert lt.ttft_budget(clock.now - 0.3, 100_000, 10, 12, 512) is None
    assert lt.num_ttft_steps == 0
    assert lt.ttft_budget(clock.now - 0.1, 200, 10, 12, 512) > 12


def test_ttft_target_needs_a_tpot_target():
    with pytest.raises(InvalidParameterError, match="target_ttft_ms.*target-tpot-ms"):
        EngineArgs(target_ttft_ms=500).create_engine_config()
    with pytest.raises(InvalidParameterError, match="target_ttft_ms"):
        EngineArgs(target_tpot_ms=50, target_ttft_ms=-1).create_engine_config()
    cfg = EngineArgs(target_tpot_ms=50, target_ttft_ms=800).create_engine_config()
    from kvflow.engine.core import latency_target

    assert latency_target(cfg).target_ttft_s == pytest.approx(0.8)
