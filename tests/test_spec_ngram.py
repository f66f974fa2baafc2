"""Prompt-lookup proposer and --speculative-config validation."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.config import SpeculativeConfig
from kvflow.engine.args import EngineArgs, parse_speculative_config
from kvflow.errors import InvalidParameterError
from kvflow.spec_decode import make_proposer
from kvflow.spec_decode.ngram import NgramProposer


def test_longest_then_latest_match():
    p = NgramProposer(3, 1, 3)
    #                 0  1  2  3  4  5  6  7  8  9 10
    toks = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    # Suffix 3-gram (3, 6, 7) never occurred; 2-gram (6, 7) at 1 and 6: latest is 6 -> 2, 3, 6.
    assert p.propose_one(toks, 3) == [2, 3, 6]
    assert p.propose_one(toks, 1) == [2]
    toks = np.array([1, 2, 3, 4, 9, 9, 2, 3, 4])  # 3-gram (2, 3, 4) at 1 -> 9, 9, 2
    assert p.propose_one(toks, 3) == [9, 9, 2]
    # The continuation may run into the suffix itself, and stops at the end.
    assert p.propose_one(np.array([4, 4, 4]), 3) == [4]


def test_no_match_and_limits():
    p = NgramProposer(4, 2, 3)
    assert p.propose_one(np.array([1, 2, 3, 4, 5]), 4) == []  # nothing recurs
    assert p.propose_one(np.array([1, 2, 1, 2]), 0) == []
    assert p.propose_one(np.array([7]), 4) == []
    assert p.propose([np.array([1, 2, 3, 1, 2]), np.array([9])], [4, 4]) == [[3, 1, 2], []]
    assert p.propose([np.array([1, 2, 3, 1, 2])], [1]) == [[3]]


def test_make_proposer_from_config():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, '
                                   '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    p = make_proposer(cfg)  # ngram needs nothing but its options
    assert (p.num_speculative_tokens, p.min_n, p.max_n) == (2, 2, 5)


@pytest.mark.parametrize("value, match", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', r"in \[1, 16\]"),
    ('{"method": "ngram"}', "needs 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}',
     "unknown option.*lookahead"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "prompt_lookup_max must be"),
    ("{method: ngram}", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_speculative_config(value, match):
    with pytest.raises(InvalidParameterError, match=match) as e:
        parse_speculative_config(value)
    assert e.value.param.startswith("speculative_config")


def test_engine_args_keep_async_scheduling():
    # Speculation no longer turns overlapped steps off (engine/spec_overlap.py decides
    # per step); on CPU the default stays off, and asking for it is allowed.
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    cfg = EngineArgs(load_format="dummy", device="cpu", speculative_config=spec,
                     max_model_len=256).create_engine_config()
    assert cfg.speculative == SpeculativeConfig("ngram", 3)
    assert not cfg.scheduler.async_scheduling
    cfg = EngineArgs(load_format="dummy", device="cpu", speculative_config=spec,
                     max_model_len=256, async_scheduling=True).create_engine_config()
    assert cfg.scheduler.async_scheduling


def test_cli_generate_with_ngram_and_bad_config():
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVFLOW_NO_PROGRESS": "1"}
    cmd = [sys.executable, "-m", "kvflow.cli", "generate"]
    p = subprocess.run(cmd + ["tiny-llama", "--load-format", "dummy", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 0}'],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "num_speculative_tokens must be" in p.stderr
    p = subprocess.run(cmd + ["--max-model-len", "512", "--kv-cache-memory", "128MiB",
                              "--max-tokens", "12", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3}', "--prompt",
                              "Repeat exactly: one two three four five six seven eight"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "one two three" in p.stdout


def test_spec_counters_in_log_line_and_metrics():
    from kvflow.engine.messages import CoreStats
    from kvflow.engine.stats import LoggingStatsListener
    from kvflow.entrypoints.openai.metrics import PrometheusMetrics

    def core(drafts, tokens, accepted, per_pos, proposals=0, draft_s=0.0, verifies=0,
             verify_s=0.0):
        return CoreStats(num_running=1, num_waiting=0, num_blocks=10, num_used_blocks=2,
                         kv_cache_usage=0.2, num_preemptions=0, num_steps=5,
                         spec_num_drafts=drafts, spec_num_draft_tokens=tokens,
                         spec_num_accepted_tokens=accepted, spec_accepted_per_pos=per_pos,
                         spec_num_proposals=proposals, spec_draft_time_s=draft_s,
                         spec_num_verify_steps=verifies, spec_verify_time_s=verify_s)

    log = LoggingStatsListener(5.0)
    log.log(0.0)
    log.record(core(10, 40, 20, (9, 6, 3, 2), 11, 0.011, 10, 0.25), None)
    line = log.log(5.0)
    assert "acceptance 50.0%" in line and "mean accepted length 3.00" in line
    assert "accepted per position [0.90, 0.60, 0.30, 0.20]" in line
    assert "draft 1.00 ms" in line and "verify step 25.0 ms" in line
    # The next interval's times are its own: 4 more runs in 0.008 s, 2 steps in 0.03 s.
    log.record(core(12, 48, 21, (10, 6, 3, 2), 15, 0.019, 12, 0.28), None)
    line = log.log(10.0)
    assert "draft 2.00 ms" in line and "verify step 15.0 ms" in line
    m = PrometheusMetrics("m")
    m.record(core(10, 40, 20, (9, 6, 3, 2), 11, 0.011, 10, 0.25), None)
    m.record(core(12, 48, 21, (10, 6, 3, 2), 15, 0.019, 12, 0.28), None)
    text = m.render().decode()
    assert 'kvflow:spec_decode_num_proposals_total{model_name="m"} 15.0' in text
    assert 'kvflow:spec_decode_draft_time_seconds_total{model_name="m"} 0.019' in text
    assert 'kvflow:spec_decode_num_verify_steps_total{model_name="m"} 12.0' in text
    assert 'kvflow:spec_decode_verify_time_seconds_total{model_name="m"} 0.28' in text
    assert 'kvflow:spec_decode_num_drafts_total{model_name="m"} 12.0' in text
    assert 'kvflow:spec_decode_num_draft_tokens_total{model_name="m"} 48.0' in text
    assert 'kvflow:spec_decode_num_accepted_tokens_total{model_name="m"} 21.0' in text
    assert ('kvflow:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}'
            ' 10.0') in text


def test_spec_stats_times_and_deltas():
    from kvflow.core.spec_stats import SpecDecodingStats

    s = SpecDecodingStats()
    s.observe(3, 2)
    s.observe_times(0.002, 0.010)  # a verification step, then a proposer run
    s.observe_times(0.004, None)  # a proposer run after a step without drafts
    s.observe_times(None, None)  # the proposer did not run (batch over the limit)
    assert (s.num_proposals, s.num_verify_steps) == (2, 1)
    assert s.mean_draft_ms == pytest.approx(3.0) and s.mean_verify_ms == pytest.approx(10.0)
    before = s.copy()
    s.observe(4, 4)
    s.observe_times(0.001, 0.020)
    d = s.since(before)
    assert (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens) == (1, 4, 4)
    assert d.accepted_per_position == [1, 1, 1, 1] == d.drafted_per_position
    assert (d.num_proposals, d.num_verify_steps) == (1, 1)
    assert d.mean_draft_ms == pytest.approx(1.0) and d.mean_verify_ms == pytest.approx(20.0)
    assert SpecDecodingStats().mean_verify_ms == 0.0
