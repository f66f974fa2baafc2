"""Smooth steps (--target-step-ms) and fair sharing between client requests: the
scheduler driven by a fake clock whose steps cost a known linear function of their
tokens and sequences (no model, no timing of real work)."""

from __future__ import annotations

import pytest

from kvflow.config import SchedulerConfig
from kvflow.core import ModelRunnerOutput, Request, Scheduler
from kvflow.core.fairness import MIN_SHARE, default_max_seqs_per_request
from kvflow.core.latency import (HEADROOM, MIN_PROMPT_CHUNK, LatencyTarget, StepTimeModel,
                                 StepTimePrior)
from kvflow.engine.args import EngineArgs
from kvflow.errors import InvalidParameterError
from kvflow.sampling_params import SamplingParams

EOS = 2


class Machine:
    """The fake hardware: ``fixed + per_token * tokens + per_seq * seqs`` seconds a step,
    on a clock the scheduler reads."""

    def __init__(self, fixed: float = 0.012, per_token: float = 0.002,
                 per_seq: float = 0.001) -> None:
        self.coef = (fixed, per_token, per_seq)
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def cost(self, tokens: int, seqs: int) -> float:
        a, b, c = self.coef
        return a + b * tokens + c * seqs


def make(machine: Machine, step_ms: float | None = 100.0, budget: int = 2048,
         max_seqs: int = 128, per_request: int | None = None, prior=None,
         num_blocks: int = 4096) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          max_model_len=4096, target_step_ms=step_ms,
                          max_seqs_per_request=per_request)
    latency = None
    if step_ms is not None:
        # A prior off by 2x: the fit must correct it from the steps it sees.
        prior = prior or StepTimePrior(*(c / 2 for c in machine.coef))
        latency = LatencyTarget(step_ms / 1e3, StepTimeModel(prior), machine,
                                cap_seats=False, min_chunk=MIN_PROMPT_CHUNK)
    return Scheduler(cfg, block_size=16, num_blocks=num_blocks, latency=latency)


def request(rid: str, prompt: int, out: int, t: float, parent: Request | None = None,
            ) -> Request:
    base = 1000 * (hash(rid.split("_")[-1]) % 30)  # distinct prompts: no cache hits
    return Request(rid, [10 + base + i % 900 for i in range(prompt)],
                   SamplingParams(max_tokens=out, ignore_eos=True), eos_token_ids={EOS},
                   arrival_time=t, fork_parent=parent)


class Trace:
    """Per step: its cost, what each request computed, and the running decodes left out."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self.costs: list[float] = []
        self.decodes_left_out = 0
        self.first_token_step: dict[str, int] = {}


def step(s: Scheduler, m: Machine, trace: Trace) -> None:
    decoding = [r.request_id for r in s.running if r.num_output_tokens > 0
                and r.num_computed_tokens == r.num_tokens - 1]
    so = s.schedule()
    trace.decodes_left_out += sum(rid not in so.num_scheduled_tokens for rid in decoding)
    trace.steps.append(dict(so.num_scheduled_tokens))
    if so.total_num_scheduled_tokens:
        c = m.cost(so.total_num_scheduled_tokens, len(so.num_scheduled_tokens))
        trace.costs.append(c)
        m.now += c
    ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        r = s.requests[rid]
        ids.append(rid)
        done = r.num_computed_tokens == r.num_tokens
        sampled.append([7] if done else [])
        if done:
            trace.first_token_step.setdefault(rid, len(trace.steps))
    s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))


def burst(s: Scheduler, m: Machine, n: int = 16, prompt: int = 128, out: int = 32,
          every_s: float = 0.25) -> Trace:
    """Issue 29's burst: n prompts arriving every ``every_s`` seconds of fake time."""
    trace, added, start = Trace(), 0, m.now
    for _ in range(20000):
        while added < n and m.now >= start + added * every_s:
            s.add_request(request(f"b{added}", prompt, out, m.now))
            added += 1
        if not s.has_unfinished_requests():
            if added == n:
                return trace
            m.now = start + added * every_s  # idle until the next arrival
            continue
        step(s, m, trace)
    raise AssertionError("the burst never finished")


def test_burst_steps_stay_near_the_target_and_every_stream_decodes():
    m = Machine()
    s = make(m, step_ms=100.0)
    trace = burst(s, m)
    warm = trace.costs[10:]  # the first steps run on the prior
    # Over the target only where the floor (every decode + the minimum chunk) binds.
    for tokens, c in zip(trace.steps[10:], warm):
        floor = m.cost(len(tokens) + MIN_PROMPT_CHUNK, len(tokens))
        assert c <= max(0.100 * 1.03, floor), (tokens, c)
    assert max(warm) < 0.35
    assert trace.decodes_left_out == 0
    # Without the target the same burst has prefill steps of a whole second or more.
    m2 = Machine()
    plain = burst(make(m2, step_ms=None), m2)
    assert max(plain.costs) > 3 * max(warm)


def test_prefill_progresses_when_the_model_says_every_step_is_over_the_target():
    # A loaded machine: the fixed cost alone is twice the target, and the prior knows it.
    m = Machine(fixed=0.200, per_token=0.004, per_seq=0.002)
    s = make(m, step_ms=100.0, prior=StepTimePrior(0.200, 0.004, 0.002))
    s.add_request(request("long", 1000, 4, m.now))
    trace = Trace()
    for _ in range(5):
        step(s, m, trace)
    # The floor: every running request's token and the minimum chunk beside them.
    assert [t["long"] for t in trace.steps] == [MIN_PROMPT_CHUNK] + [MIN_PROMPT_CHUNK + 1] * 4
    # Streams running beside it do not stop the prompt either.
    for i in range(8):
        s.add_request(request(f"r{i}", 8, 200, m.now))
    for _ in range(40):
        step(s, m, trace)
    assert all(t.get("long", 0) >= MIN_PROMPT_CHUNK or "long" not in s.requests
               for t in trace.steps[-30:] if t)
    assert trace.decodes_left_out == 0


def test_smooth_steps_do_not_cap_the_running_batch():
    m = Machine()
    s = make(m, step_ms=50.0, max_seqs=64)
    for i in range(48):
        s.add_request(request(f"r{i}", 4, 200, m.now))
    trace = Trace()
    for _ in range(20):
        step(s, m, trace)
    # A TPOT target of 50 ms would seat (0.9 * 50 - 12) / 3 = 11 sequences here.
    seats_tpot = int((0.050 * HEADROOM - m.coef[0]) / (m.coef[1] + m.coef[2]))
    assert s.num_running == 48 > seats_tpot
    assert trace.decodes_left_out == 0


def fan_out(rid: str, n: int, prompt: int, out: int, t: float) -> list[Request]:
    """A client request with n samples, as the engine core queues them."""
    parent = request(f"0_{rid}", prompt, out, t)
    return [parent] + [request(f"{i}_{rid}", prompt, out, t, parent=parent)
                       for i in range(1, n)]


def run_n127_then_small(per_request: int | None, steps: int = 400) -> tuple[Scheduler, Trace]:
    m = Machine()
    s = make(m, step_ms=None, per_request=per_request)
    for r in fan_out("big", 127, 4, 1000, m.now):
        s.add_request(r)
    trace = Trace()
    for _ in range(3):
        step(s, m, trace)
    for i in range(4):  # small requests queue behind it
        s.add_request(request(f"small{i}", 12, 32, m.now))
    for _ in range(steps):
        step(s, m, trace)
        if all(f"small{i}" in trace.first_token_step for i in range(4)):
            break
    return s, trace


def test_n127_does_not_hold_the_engine():
    s, trace = run_n127_then_small(None)
    cap = default_max_seqs_per_request(128)
    assert cap == 16
    big_seats = [sum(rid.endswith("_big") for rid in t) for t in trace.steps]
    assert max(big_seats) <= cap
    # Each small request has its first token within 2 steps of arriving (step 3).
    for i in range(4):
        assert trace.first_token_step[f"small{i}"] <= 3 + 2
    # Without the per-request seat limit, 127 samples take 127 of 128 seats and the rest
    # take turns through the one seat left (or queue until the samples have generated
    # their 1000 tokens each).
    _, unfair = run_n127_then_small(128, steps=60)
    assert sum(f"small{i}" in unfair.first_token_step for i in range(4)) <= 2


def test_n_samples_all_finish_in_turns():
    m = Machine()
    s = make(m, step_ms=100.0, per_request=4)
    for r in fan_out("g", 10, 20, 5, m.now):
        s.add_request(r)
    trace = Trace()
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        step(s, m, trace)
    assert not s.has_unfinished_requests()
    assert max(sum(rid.endswith("_g") for rid in t) for t in trace.steps) <= 4
    assert len(trace.first_token_step) == 10


def test_huge_prompt_shares_the_prompt_budget_with_a_small_one():
    m = Machine()
    s = make(m, step_ms=None, budget=256)
    s.add_request(request("huge", 3000, 4, m.now))
    trace = Trace()
    step(s, m, trace)
    assert trace.steps[0] == {"huge": 256}
    s.add_request(request("small", 200, 4, m.now))
    for _ in range(4):
        step(s, m, trace)
    # Each takes half of the step while the other has prompt tokens left: the small one
    # has its first token after ceil(200 / 128) = 2 steps instead of after the ~12 steps
    # the huge prompt needs; then the huge one has the whole budget again.
    assert trace.steps[1] == {"huge": 128, "small": 128}
    assert trace.steps[2] == {"huge": 256 - 72, "small": 72}  # the rest of small's prompt
    assert trace.first_token_step["small"] == 3
    assert trace.steps[3] == {"small": 1, "huge": 255}


def test_prompts_that_fit_together_are_not_split():
    m = Machine()
    s = make(m, step_ms=None, budget=512)
    s.add_request(request("long", 300, 4, m.now))
    s.add_request(request("short", 7, 4, m.now + 1))
    trace = Trace()
    step(s, m, trace)
    assert trace.steps[0] == {"long": 300, "short": 7}


def test_min_share_keeps_chunks_worth_a_step():
    m = Machine()
    s = make(m, step_ms=None, budget=20)
    s.add_request(request("a", 100, 4, m.now))
    s.add_request(request("b", 100, 4, m.now + 1))
    trace = Trace()
    step(s, m, trace)
    # Half of 20 is below MIN_SHARE: the oldest takes MIN_SHARE, the next what is left.
    assert trace.steps[0] == {"a": MIN_SHARE, "b": 20 - MIN_SHARE}


def test_options():
    with pytest.raises(InvalidParameterError, match="target_step_ms"):
        EngineArgs(target_step_ms=-5).create_engine_config()
    with pytest.raises(InvalidParameterError, match="max_seqs_per_request"):
        EngineArgs(max_seqs_per_request=0).create_engine_config()
    assert EngineArgs(target_step_ms=0).create_engine_config().scheduler.target_step_ms \
        is None
    from kvflow.engine.core import latency_target

    # Off in the engine (offline use keeps the whole budget); on for kvflow serve on CPU.
    assert latency_target(EngineArgs(device="cpu").create_engine_config()) is None
    from kvflow.engine.smooth_steps import CPU_SERVER_STEP_MS, smooth_on_cpu

    assert smooth_on_cpu(EngineArgs(device="cpu")).target_step_ms == CPU_SERVER_STEP_MS
    assert smooth_on_cpu(EngineArgs(device="cpu", target_step_ms=0)).target_step_ms == 0
    assert smooth_on_cpu(EngineArgs(device="cpu", target_tpot_ms=80)).target_step_ms is None
    lt = latency_target(EngineArgs(device="cpu", target_step_ms=100).create_engine_config())
    assert lt.target_s == pytest.approx(0.100)
    assert not lt.cap_seats and lt.min_chunk == MIN_PROMPT_CHUNK
    # A TPOT target takes precedence: it bounds steps itself and caps the seats.
    both = EngineArgs(device="cpu", target_step_ms=100, target_tpot_ms=80)
    lt = latency_target(both.create_engine_config())
    assert lt.cap_seats and lt.min_chunk == 0 and lt.target_s == pytest.approx(0.080)
