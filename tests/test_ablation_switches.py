"""The engine switches ``kvflow bench ablation`` turns off: static batching and the
contiguous (unpaged) KV layout, at the scheduler (exact blocks, no torch) and end to end."""

from __future__ import annotations

import pytest

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.core import ModelRunnerOutput, Request, Scheduler
from kvflow.engine.args import EngineArgs
from kvflow.errors import InvalidParameterError
from kvflow.sampling_params import SamplingParams

EOS = 2


def make(batching="continuous", contiguous=False, num_blocks=32, max_seqs=8):
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs,
                          max_model_len=32, batching=batching)
    return Scheduler(cfg, block_size=4, num_blocks=num_blocks, contiguous_kv=contiguous)


def add(s: Scheduler, rid: str, prompt: int = 6, out: int = 4) -> None:
    s.add_request(Request(rid, list(range(10, 10 + prompt)), SamplingParams(max_tokens=out),
                          eos_token_ids={EOS}))


def step(s: Scheduler):
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[7] if s.requests[r].num_computed_tokens == s.requests[r].num_tokens else []
               for r in ids]
    s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
    return so


def test_static_batching_waits_for_the_whole_batch():
    s = make("static")
    add(s, "a", out=2)
    add(s, "b", out=5)
    assert set(step(s).num_scheduled_tokens) == {"a", "b"}
    add(s, "c")
    seen = []
    while "c" not in seen:
        so = step(s)
        seen = list(so.num_scheduled_tokens)
        if "c" not in seen:
            assert set(seen) <= {"a", "b"}
    assert seen == ["c"]  # c started only once a and b had both finished
    # Continuous batching lets c join at once.
    s = make("continuous")
    add(s, "a", out=2)
    add(s, "b", out=5)
    step(s)
    add(s, "c")
    assert "c" in step(s).num_scheduled_tokens


def test_contiguous_kv_reserves_max_model_len_per_request():
    s = make(contiguous=True, num_blocks=20)
    for rid in "abc":
        add(s, rid)
    so = step(s)
    # 32 tokens of max_model_len = 8 blocks each: two requests fit in 20 blocks, not three.
    assert [len(n.block_ids) for n in so.new_reqs] == [8, 8]
    assert s.num_waiting == 1
    so = step(s)  # decodes never need a new block
    assert all(c.new_block_ids == [] for c in so.cached_reqs)
    paged = make(num_blocks=20)
    for rid in "abc":
        add(paged, rid)
    assert [len(n.block_ids) for n in step(paged).new_reqs] == [2, 2, 2]


def test_switches_are_engine_options_with_validation():
    cfg = EngineArgs(batching="static", kv_layout="contiguous",
                     enable_prefix_caching=False).create_engine_config()
    assert cfg.scheduler.batching == "static" and cfg.cache.kv_layout == "contiguous"
    with pytest.raises(InvalidParameterError, match="prefix"):
        CacheConfig(kv_layout="contiguous", enable_prefix_caching=True)
    with pytest.raises(InvalidParameterError, match="batching"):
        SchedulerConfig(batching="sometimes")
    with pytest.raises(InvalidParameterError, match="kv_layout"):
        CacheConfig(kv_layout="striped", enable_prefix_caching=False)


def test_switches_end_to_end_give_the_same_greedy_tokens():
    from kvflow import LLM

    prompts = [[5 + i, 17, 40 + i, 9, 11] * (i + 1) for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = []
    for extra in ({}, {"batching": "static"},
                  {"kv_layout": "contiguous", "enable_prefix_caching": False}):
        llm = LLM("tiny-llama", load_format="dummy", max_model_len=64,
                  num_gpu_blocks_override=40, max_num_seqs=2, device="cpu", **extra)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)])
    assert outs[0] == outs[1] == outs[2]


def test_bench_ablation_writes_report_plots_and_json(tmp_path):
    import json

    from kvflow.cli import main

    out = tmp_path / "report"
    code = main(["bench", "ablation", "--model", "tiny-llama", "--load-format", "dummy",
                 "--max-model-len", "128", "--num-prompts", "4", "--prefix-len", "16",
                 "--input-len", "8", "--output-len", "4", "--only", "no-paged-kv",
                 "--out-dir", str(out)])
    assert code == 0
    result = json.loads((out / "ablation.json").read_text())
    rows = {r["name"]: r for r in result["configurations"]}
    assert set(rows) == {"baseline", "no-paged-kv"} and "loadavg" in result
    # Reserving max_model_len per request holds more KV than paging ever does.
    assert rows["no-paged-kv"]["kv_peak_mib"] > rows["baseline"]["kv_peak_mib"]
    report = (out / "report.md").read_text()
    assert "| no-paged-kv |" in report and "ablation-bars.png" in report
    assert (out / "ablation-bars.png").stat().st_size > 1000
    assert (out / "ablation-throughput-latency.png").exists()
