"""Speculation with overlapped (async) steps: the per-step choice (SpecOverlap) and, end to
end on CPU, greedy output equal to plain greedy with every kind of step mixed: verifying
steps collected first, steps without drafts overlapped, speculation switched off by batch
size while the batch is large."""

from __future__ import annotations

import pytest

from kvflow import SamplingParams
from kvflow.engine.spec_overlap import SpecOverlap
from tests.test_spec_draft_model import COPY, prompts, tiny, tokens


def test_gate_collects_first_while_drafting_and_backs_off_when_not():
    g = SpecOverlap(disable_by_batch_size=8, max_interval=4)
    assert g.collect_first(True, 1)  # a verification step in flight: always
    g.observe(True)
    assert g.collect_first(False, 1)  # drafts came: the next step waits too
    g.observe(False)  # nothing proposed: interval 2
    decisions = []
    for _ in range(12):
        d = g.collect_first(False, 1)
        decisions.append(d)
        g.observe(False)
    # probes every 2, then 4 steps (capped): overlapped steps in between
    assert decisions == [False, True, False, False, False, True, False, False, False,
                         True, False, False]
    assert g.collect_first(False, 1) is False
    g.collect_first(False, 1)  # a probe ...
    g.observe(True)  # ... that found drafts: back to collecting first every step
    assert g.collect_first(False, 1)
    # Above the batch limit nothing is proposed: always overlap, the interval untouched.
    assert not any(g.collect_first(False, 9) for _ in range(10))
    assert SpecOverlap(None).collect_first(False, 500)


@pytest.mark.parametrize("spec, overrides", [
    (COPY, {}),
    (COPY, dict(num_gpu_blocks_override=24, max_model_len=96)),  # preemption
    ({**COPY, "disable_by_batch_size": 2}, {}),  # off while more than 2 run
], ids=["copy", "preempt", "off-by-batch"])
def test_greedy_spec_with_overlapped_steps_equals_plain(spec, overrides):
    ps = prompts()
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True,
                             min_tokens=i) for i in range(len(ps))]
    want = tokens(tiny(**overrides), ps, params)
    llm = tiny(speculative_config=spec, async_scheduling=True, **overrides)
    assert llm.engine.core.config.scheduler.async_scheduling
    assert tokens(llm, ps, params) == want
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # the draft is the target
