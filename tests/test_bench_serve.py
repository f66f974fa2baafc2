"""``kvflow bench serve``: the figures it derives, and a short run against a real server."""

from __future__ import annotations

import asyncio
import json
import math
import time

import numpy as np

from kvflow.bench.serve import (RequestResult, _arrivals, format_result, prefix_cache_counters,
                                summarize)
from kvflow.cli import main


def test_summary_figures():
    ok = RequestResult(prompt_len=10, success=True, output_tokens=5, ttft_s=0.1,
                       latency_s=0.5, itl_s=[0.1] * 4)
    ok2 = RequestResult(prompt_len=20, success=True, output_tokens=1, ttft_s=0.3,
                        latency_s=0.3)
    bad = RequestResult(prompt_len=30, error="HTTP 429: busy")
    s = summarize([ok, ok2, bad], duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 6
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0
    assert s["total_token_throughput"] == 18.0
    assert math.isclose(s["tpot_ms"]["mean"], 100.0)  # (0.5 - 0.1) / 4; ok2 has one token
    assert math.isclose(s["ttft_ms"]["median"], 200.0)
    assert math.isclose(s["e2el_ms"]["p99"], 498.0)  # 300 + 0.99 * (500 - 300)
    text = format_result(s, math.inf, None)
    assert "Serving Benchmark Result" in text and "Failed requests:" in text
    assert "HTTP 429: busy" in text


def test_poisson_arrivals_have_the_asked_rate():
    async def run():
        start = time.perf_counter()
        n = 0
        async for _ in _arrivals(list(range(201)), 2000.0, 1.0, np.random.default_rng(0)):
            n += 1
        return n, time.perf_counter() - start
    n, elapsed = asyncio.run(run())
    assert n == 201
    assert 0.07 < elapsed < 0.6  # 200 gaps of 0.5 ms on average, plus sleep overheads


def test_bench_serve_against_the_server(server, tmp_path):
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "6",
               "--input-len", "16", "--output-len", "4", "--request-rate", "inf",
               "--metadata", "server=test", "--save-result", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["total_input_tokens"] == 96 and r["total_output_tokens"] == 24
    assert r["ttft_ms"]["mean"] > 0 and r["tpot_ms"]["mean"] > 0 and r["itl_ms"]["p99"] > 0
    assert r["server"]["model"] == "smollm2-135m" and r["metadata"] == {"server": "test"}
    assert r["command"].startswith("kvflow ") and "commit" in r and "machine" in r


def test_prefix_cache_counters_from_prometheus_text():
    page = """# HELP kvflow:prefix_cache_queries_total Prompt tokens looked up
# TYPE kvflow:prefix_cache_queries_total counter
kvflow:prefix_cache_queries_total{model_name="m"} 300.0
kvflow:prefix_cache_hits_total{model_name="m"} 120.0
kvflow:prompt_tokens_total{model_name="m"} 999.0
"""
    assert prefix_cache_counters(page) == (300.0, 120.0)
    assert prefix_cache_counters("vllm:prefix_cache_queries_total 10\n"
                                 "vllm:prefix_cache_hits_total 4\n") == (10.0, 4.0)
    assert prefix_cache_counters("other_metric 1\n") is None


def test_a_repeated_dataset_shows_as_a_warm_prefix_cache(server, tmp_path):
    """The same seed twice sends the same prompts: the second result must say so."""
    rates = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        assert main(["bench", "serve", "--base-url", server.url, "--num-prompts", "4",
                     "--input-len", "64", "--output-len", "2", "--seed", "4321",
                     "--num-warmups", "0", "--save-result", str(out)]) == 0
        rates.append(json.loads(out.read_text())["server_prefix_cache_hit_rate"])
    assert rates[0] < 0.2 and rates[1] > 0.7, rates
