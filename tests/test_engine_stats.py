"""Serving statistics (API side): sequence latencies, token counts, the periodic log line."""

from __future__ import annotations

from kvflow.core.sched_output import EngineCoreOutput, EngineCoreRequest
from kvflow.engine.messages import CoreStats
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine.processor import ProcessedRequest, child_request_id
from kvflow.engine.stats import LoggingStatsListener, SequenceTracker
from kvflow.sampling_params import SamplingParams


def _add(op: OutputProcessor, rid: str, n: int, prompt_len: int, arrival: float):
    params = SamplingParams(n=n, max_tokens=4, detokenize=False)
    prompt = list(range(3, 3 + prompt_len))
    core = [EngineCoreRequest(child_request_id(rid, i, n), prompt, params, [2], arrival)
            for i in range(n)]
    op.add_request(ProcessedRequest(rid, None, prompt, params, core), arrival)


def _step(op, tracker, outputs, now):
    entries = [e if e is not None and e[1].finish_reason is None else None
               for e in (op.child_to_parent.get(o.req_id) for o in outputs)]
    op.process_outputs(outputs)
    return tracker.on_outputs(outputs, entries, now)


def test_sequence_latencies_and_counts():
    op, tracker = OutputProcessor(None), SequenceTracker()
    _add(op, "a", n=2, prompt_len=5, arrival=10.0)
    it = _step(op, tracker, [EngineCoreOutput("0_a", [7]), EngineCoreOutput("1_a", [8],
                                                                            num_cached_tokens=4)],
               now=10.5)
    assert it.ttfts_s == [0.5, 0.5] and it.itls_s == []
    assert it.num_prompt_tokens == 5  # once per request, not per sample
    assert (it.prefix_cache_queries, it.prefix_cache_hits) == (10, 4)
    assert it.num_generation_tokens == 2
    it = _step(op, tracker, [EngineCoreOutput("0_a", [7]), EngineCoreOutput("1_a", [8])],
               now=10.7)
    assert [round(x, 6) for x in it.itls_s] == [0.2, 0.2] and not it.finished
    it = _step(op, tracker, [EngineCoreOutput("0_a", [7], finish_reason="length")], now=11.1)
    (done,) = it.finished
    assert done.finish_reason == "length" and done.num_generation_tokens == 3
    assert abs(done.e2e_s - 1.1) < 1e-9 and abs(done.ttft_s - 0.5) < 1e-9
    assert abs(done.tpot_s - 0.3) < 1e-9  # (11.1 - 10.5) / (3 - 1)
    # A finished sample's late tokens are not counted again.
    it = _step(op, tracker, [EngineCoreOutput("0_a", [9])], now=11.2)
    assert it.num_generation_tokens == 0 and not it.finished
    state = op.requests["a"]
    aborted = tracker.on_abort(state, op.abort_request("a"), now=12.0)
    (ab,) = aborted.finished
    assert ab.finish_reason == "abort" and ab.num_generation_tokens == 2


def test_log_line_only_while_busy():
    log = LoggingStatsListener(5.0)
    assert log.log(0.0) is None  # the first call starts the interval
    log.record(CoreStats(0, 0, 10, 0, 0.0, 0, 0), None)
    assert log.log(5.0) is None  # idle: nothing to say
    op, tracker = OutputProcessor(None), SequenceTracker()
    _add(op, "b", n=1, prompt_len=100, arrival=5.0)
    it = _step(op, tracker, [EngineCoreOutput("b", [7])], now=6.0)
    it.step_s, it.api_s = 0.02, 0.001
    log.record(CoreStats(1, 2, 10, 4, 0.4, 3, 1), it)
    line = log.log(10.0)
    assert "prompt throughput: 20.0 tokens/s" in line
    assert "generation throughput: 0.2 tokens/s" in line
    assert "running: 1 reqs, waiting: 2 reqs, KV cache usage: 40.0%" in line
    assert "preemptions: 3 (total 3)" in line and "engine step: 20.0 ms" in line
