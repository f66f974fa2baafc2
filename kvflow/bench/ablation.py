"""``kvflow bench ablation``: one workload, each of kvflow's optimizations switched off in
turn, and a report of what each is worth on this machine and model.

Every configuration runs in its own process (so memory, compiled kernels and CUDA graphs
never carry over from one to the next) through the offline engine: all requests arrive at
once, TTFT counts from that moment (queueing included), TPOT is the mean gap between a
request's later tokens, and "peak KV" is the most KV memory held by requests at any step.
The report is a markdown table, PNG plots and a JSON file with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from kvflow.bench.datasets import BenchRequest, length_range, random_requests
from kvflow.bench.machine import save_result

MiB = 1 << 20


@dataclass(frozen=True)
class Ablation:
    """One configuration: what is switched off, and the engine options that do it."""

    name: str
    off: str
    engine_args: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    gpu_only: bool = False


def ablations(on_gpu: bool, async_default: bool, quantized: str | None = None
              ) -> list[Ablation]:
    """The baseline and one configuration per optimization (GPU-only ones on GPU).
    ``quantized`` names the baseline's weight method when its weights are low-bit (the
    embedded GGUF model by default); it adds a row with dense weights."""
    rows = [
        Ablation("baseline", "nothing (kvflow's defaults)"),
        Ablation("no-paged-kv", "paged KV: each request reserves max_model_len of KV in "
                 "one region (prefix caching off with it)",
                 {"kv_layout": "contiguous", "enable_prefix_caching": False}),
        Ablation("static-batching", "continuous batching: a batch forms when the last "
                 "has finished", {"batching": "static"}),
        Ablation("no-chunked-prefill", "chunked prefill: a prompt is computed in one step",
                 {"enable_chunked_prefill": False}),
        Ablation("no-prefix-caching", "prefix caching", {"enable_prefix_caching": False}),
        Ablation("no-overlap" if async_default else "overlap-on",
                 "overlapped scheduling" if async_default else
                 "(added) overlapped scheduling, off by default on CPU",
                 {"async_scheduling": not async_default}),
        Ablation("spec-ngram", "(added) speculative decoding by prompt lookup, off by "
                 "default", {"speculative_config": {"method": "ngram",
                                                    "num_speculative_tokens": 4}}),
        Ablation("no-cuda-graphs", "CUDA graphs", {"enforce_eager": True}, gpu_only=True),
        Ablation("no-triton", "Triton kernels (pure-torch references instead)",
                 env={"KVFLOW_DISABLE_TRITON": "1"}, gpu_only=True),
    ]
    if quantized:
        rows.insert(1, Ablation("no-quantization", f"low-bit weights ({quantized}): dense "
                                "weights in the model dtype instead",
                                {"quantization": "none"}))
    return [a for a in rows if on_gpu or not a.gpu_only]


def workload(ns: argparse.Namespace, vocab: int, special: set[int]) -> list[BenchRequest]:
    """Prompts of one shared prefix (a system prompt) plus a random part of varied length,
    varied output lengths: every optimization has something to act on."""
    [prefix] = random_requests(1, (ns.prefix_len, ns.prefix_len), (1, 1), vocab,
                               ns.seed + 7, special) if ns.prefix_len else [None]
    rows = random_requests(ns.num_prompts,
                           length_range(ns.input_len, ns.range_ratio, None, None),
                           length_range(ns.output_len, ns.range_ratio, None, None),
                           vocab, ns.seed, special)
    head = prefix.prompt_token_ids if prefix else []
    return [BenchRequest(head + r.prompt_token_ids, r.output_len) for r in rows]


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99))}


def run_one(engine_args: dict, requests: list[BenchRequest], temperature: float) -> dict:
    """Run the workload on one engine configuration (in this process)."""
    from kvflow.engine.args import EngineArgs
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.sampling_params import SamplingParams

    config = EngineArgs(**engine_args).create_engine_config()
    engine = LLMEngine(config)
    sched = engine.core.scheduler
    block_bytes = config.cache.block_size * config.model.arch.kv_bytes_per_token(
        config.model.dtype)

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature,
                              detokenize=False)

    warm = random_requests(2, (16, 32), (4, 4), config.model.arch.vocab_size, 999)
    for i, r in enumerate(warm):
        engine.add_request(f"warm-{i}", {"prompt_token_ids": r.prompt_token_ids},
                           params(r.output_len))
    while engine.has_unfinished_requests():
        engine.step()
    preempt0, steps, peak, used_sum = sched.num_preemptions, 0, 0, 0
    query0, hit0 = sched.kv.num_query_tokens, sched.kv.num_hit_tokens
    t0 = time.monotonic()
    for i, r in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids},
                           params(r.output_len), arrival_time=t0)
    ttft, tpot = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.metrics is not None:
                m, n = out.metrics, len(out.outputs[0].token_ids)
                ttft.append(m.first_token_time - t0)
                if n > 1:
                    tpot.append((m.last_token_time - m.first_token_time) / (n - 1))
        steps += 1
        used = sched.kv.num_blocks - sched.kv.num_free_blocks
        peak, used_sum = max(peak, used), used_sum + used
    elapsed = time.monotonic() - t0
    n_in = sum(len(r.prompt_token_ids) for r in requests)
    n_out = sum(r.output_len for r in requests)
    queries = sched.kv.num_query_tokens - query0
    return {"elapsed_s": elapsed, "requests_per_s": len(requests) / elapsed,
            "output_tokens_per_s": n_out / elapsed,
            "total_tokens_per_s": (n_in + n_out) / elapsed,
            "ttft_ms": _stats(ttft), "tpot_ms": _stats(tpot), "steps": steps,
            "preemptions": sched.num_preemptions - preempt0,
            "prefix_cache_hit_rate": (sched.kv.num_hit_tokens - hit0) / queries
            if queries else 0.0,
            "kv_peak_mib": peak * block_bytes / MiB,
            "kv_mean_mib": used_sum / max(steps, 1) * block_bytes / MiB,
            "kv_cache_mib": sched.kv.num_blocks * block_bytes / MiB,
            "device": config.device.device}


def _child(ablation: Ablation, base_args: dict, requests: list[BenchRequest],
           temperature: float, timeout: float) -> dict:
    job = {"engine_args": {**base_args, **ablation.engine_args}, "temperature": temperature,
           "requests": [[r.prompt_token_ids, r.output_len] for r in requests]}
    env = {**os.environ, **ablation.env, "KVFLOW_NO_PROGRESS": "1"}
    proc = subprocess.run([sys.executable, "-m", "kvflow.bench.ablation"],
                          input=json.dumps(job), capture_output=True, text=True, env=env,
                          timeout=timeout)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("@@result ")]
    if proc.returncode != 0 or not marker:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(marker[-1][len("@@result "):])


def _weight_method(config) -> str | None:
    """The baseline's low-bit weight method, or None for dense weights."""
    from kvflow.models.loader import quantization_config

    quant = quantization_config(config.model, config.device.device)
    return None if quant is None else quant.method


def run_ablation(ns: argparse.Namespace) -> int:
    from kvflow.bench.ablation_report import write_report
    from kvflow.engine.args import EngineArgs

    args = EngineArgs.from_cli_args(ns)
    config = args.create_engine_config()
    arch = config.model.arch
    special = set(arch.eos_token_ids) | ({arch.bos_token_id} if arch.bos_token_id
                                         is not None else set())
    requests = workload(ns, arch.vocab_size, special)
    base_args = {k: v for k, v in vars(args).items()}
    rows = ablations(config.device.is_cuda, config.scheduler.async_scheduling,
                     _weight_method(config))
    if ns.only:
        rows = [a for a in rows if a.name in ns.only or a.name == "baseline"]
    results = []
    for a in rows:
        print(f"[ablation] {a.name}: off = {a.off}", flush=True)
        fig = _child(a, base_args, requests, ns.temperature, ns.timeout)
        results.append({"name": a.name, "off": a.off, "engine_args": a.engine_args,
                        "env": a.env, **fig})
        if "error" in fig:
            print(f"[ablation] {a.name} failed: {fig['error'][-500:]}", flush=True)
        else:
            print(f"[ablation] {a.name}: {fig['output_tokens_per_s']:.1f} output tokens/s, "
                  f"TTFT p50 {fig['ttft_ms']['median']:.0f} ms, TPOT p50 "
                  f"{fig['tpot_ms']['median']:.1f} ms, peak KV {fig['kv_peak_mib']:.1f} MiB",
                  flush=True)
    n_in = [len(r.prompt_token_ids) for r in requests]
    n_out = [r.output_len for r in requests]
    summary = {"workload": {"num_prompts": len(requests), "prefix_len": ns.prefix_len,
                            "input_len_range": [min(n_in), max(n_in)],
                            "output_len_range": [min(n_out), max(n_out)],
                            "seed": ns.seed, "temperature": ns.temperature},
               "engine_args": base_args, "configurations": results}
    os.makedirs(ns.out_dir, exist_ok=True)
    stamped = save_result(os.path.join(ns.out_dir, "ablation.json"), summary)
    report = write_report(stamped, ns.out_dir)
    print(f"report: {report}")
    return 0 if all("error" not in r for r in results) else 1


def add_ablation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--prefix-len", type=int, default=256,
                   help="tokens of a prefix every prompt shares (0: none)")
    p.add_argument("--input-len", type=int, default=128, help="tokens after the prefix")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="run only these configurations (and the baseline)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds one configuration may take")
    p.add_argument("--out-dir", default="ablation-report",
                   help="where report.md, ablation.json and the PNG plots go")


def _main() -> None:
    job = json.loads(sys.stdin.read())
    requests = [BenchRequest(ids, n) for ids, n in job["requests"]]
    result = run_one(job["engine_args"], requests, job["temperature"])
    print("@@result " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _main()
