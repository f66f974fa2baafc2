"""Per-kernel breakdown (torch profiler) of one engine step, against its own ceiling.

Steps: a decode step at batch 1 and at batch 256 (context ~1k), and one 8k-token prefill
step, on Llama-3.1-8B shape with dummy bf16 weights. Kernels are grouped by name; the
step's floor is max(bytes moved / HBM bandwidth, FLOPs / matmul rate). Eager mode is
profiled so each kernel is visible (a CUDA graph replays the same kernels); the graph
step time is measured separately with CUDA events.

    python benchmarks/gpu/profile_steps.py --out profile.json
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kvflow.bench.machine import save_result
from kvflow.engine.args import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.2e12
MATMUL_FLOPS = 790e12


def step_floor(arch, num_tokens: int, num_seqs: int, context: int,
               weight_bytes: int | None = None) -> dict:
    """Bytes and FLOPs a step must move/do at least (weights once, KV of each sequence).
    ``weight_bytes``: the loaded weights' size (low-bit storage), default bf16."""
    weight_bytes = weight_bytes or arch.num_params * 2
    kv_read = num_seqs * context * arch.kv_bytes_per_token("bfloat16")
    matmul_flops = 2 * (arch.num_params - arch.vocab_size * arch.hidden_size) * num_tokens \
        + 2 * arch.vocab_size * arch.hidden_size * num_seqs
    q_heads = arch.num_attention_heads * arch.head_dim
    if num_tokens == num_seqs:  # decode: each token attends to its context
        attn_flops = 4 * q_heads * context * num_tokens * arch.num_hidden_layers
    else:  # one causal prefill of num_tokens
        attn_flops = 2 * q_heads * num_tokens * num_tokens * arch.num_hidden_layers
    t_bytes = (weight_bytes + kv_read) / HBM_BYTES_PER_S
    t_flops = (matmul_flops + attn_flops) / MATMUL_FLOPS
    return {"bytes": weight_bytes + kv_read, "flops": matmul_flops + attn_flops,
            "floor_ms": 1e3 * max(t_bytes, t_flops),
            "bound": "memory" if t_bytes >= t_flops else "compute"}


def run_to_state(engine, batch: int, prompt_len: int, decode_steps: int, tag: str) -> None:
    params = SamplingParams(max_tokens=decode_steps + 50, ignore_eos=True, temperature=0,
                            detokenize=False)
    for i in range(batch):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": [(7 * i + j) % 30000 + 100
                                                              for j in range(prompt_len)]},
                           params)
    while engine.core.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.scheduler.running):
        engine.step()
    for _ in range(decode_steps):
        engine.step()


def profile_step(engine, label: str, floor: dict, prepare=lambda: None) -> dict:
    prepare()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        engine.step()
        torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            kernels[e.key][0] += e.device_time_total / 1e3
            kernels[e.key][1] += e.count
    total_gpu = sum(v[0] for v in kernels.values())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    prepare()
    torch.cuda.synchronize()
    start.record()
    engine.step()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    print(f"\n== {label}: GPU kernel time {total_gpu:.3f} ms, step (events) {wall:.3f} ms, "
          f"floor {floor['floor_ms']:.3f} ms ({floor['bound']}-bound) ==")
    for name, (ms, count) in top:
        print(f"  {ms:8.3f} ms  {100 * ms / total_gpu:5.1f}%  x{count:<4d} {name[:90]}")
    host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                  key=lambda e: -e.self_cpu_time_total)[:12]  # where the host time went
    for e in host[:6]:
        print(f"  host {e.self_cpu_time_total / 1e3:8.3f} ms  x{e.count:<5d} {e.key[:80]}")
    return {"label": label, "gpu_kernel_ms": total_gpu, "step_ms_events": wall, **floor,
            "kernels": [{"name": n, "ms": ms, "count": c} for n, (ms, c) in top],
            "host_self_ms": [{"name": e.key, "ms": e.self_cpu_time_total / 1e3,
                              "count": e.count} for e in host]}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--cases", default="decode1,decode256,prefill",
                    help="comma-separated subset of decode1, decode256, prefill, decode1-graph, "
                    "mixed (GPU-B's steady state: 224 decodes at ~1k context beside two "
                    "fresh 1024-token prompts; a short prompt's prefill: prefill_probe.py)")
    ap.add_argument("--quantization", default="none",
                    help="weight storage (none, int4, int8, fp8, ...): the low-bit kernels' "
                    "share of the step; int4 uses groups of 128 as GPU-A's int4 runs do")
    ap.add_argument("--lm-head-quantization", default="auto", choices=["auto", "none", "int8"])
    ns = ap.parse_args()
    cases = dict(zip(("decode1", "decode256", "prefill", "decode1-graph", "mixed"), range(5)))
    wanted = {cases[c] for c in ns.cases.split(",")}
    results = []
    for i, (label, batch, prompt, eager, extra) in enumerate([
        ("decode batch 1 (ctx ~1k, eager)", 1, 1024, True, {}),
        ("decode batch 256 (ctx ~1k, eager)", 256, 1024, True, {}),
        ("prefill 8192 tokens", 1, 8192, True, {"max_num_batched_tokens": 8192}),
        # the decode graph GPU-A replays (its split-KV count is the graph's, 16 at batch
        # 1, not the eager step's 4); the profiler lists the kernels of the replay
        ("decode batch 1 (ctx ~256, CUDA graph)", 1, 256, False,
         {"max_num_seqs": 1, "max_model_len": 4096}),
        # GPU-B's typical step (1000 x 1024 in / 128 out, 256 running, 8192-token budget:
        # 546 steps of about 2110 tokens, 1.8 new prompts each): the engine's own mode,
        # graphs captured, the step mixed and so eager
        ("mixed: 224 decodes (ctx ~1k) + 2 x 1024-token prefills", 224, 1024, False,
         {"max_num_batched_tokens": 8192, "max_model_len": 4096}),
    ]):
        if i not in wanted:
            continue
        extra = {"max_model_len": 16384, "max_num_seqs": 256, **extra}
        if ns.quantization != "none":
            extra["quantization"] = ns.quantization
            if ns.quantization == "int4":
                extra["quantization_group_size"] = 128
            label = f"{label}, {ns.quantization} weights"
            if ns.lm_head_quantization != "auto":
                extra["lm_head_quantization"] = ns.lm_head_quantization
                label = f"{label}, lm_head {ns.lm_head_quantization}"
        args = EngineArgs(model=ns.model, load_format="dummy", enforce_eager=eager, **extra)
        engine = LLMEngine.from_engine_args(args)
        arch = engine.config.model.arch
        if label.startswith("mixed"):
            run_to_state(engine, batch, prompt, 3, "r")
            params = SamplingParams(max_tokens=128, ignore_eos=True, detokenize=False)
            counter = iter(range(100))

            def prepare(engine=engine, params=params, counter=counter):
                for _ in range(2):
                    n = next(counter)
                    engine.add_request(f"m{n}", {"prompt_token_ids": [
                        (j * 17 + n) % 30000 + 100 for j in range(prompt)]}, params)
            decode = step_floor(arch, batch, batch, prompt + 4,
                                engine.core.executor.runner.weight_bytes)
            pre = step_floor(arch, 2 * prompt, 1, prompt)  # FLOPs of the prefill tokens
            # + one more lm_head row (each prompt's last token), and two causal 1024s, not
            # one 2048
            flops = decode["flops"] + pre["flops"] + 2 * arch.vocab_size * arch.hidden_size \
                - 2 * arch.num_attention_heads * arch.head_dim * (2 * prompt) ** 2 \
                * arch.num_hidden_layers // 2
            t_flops = flops / MATMUL_FLOPS
            t_bytes = decode["bytes"] / HBM_BYTES_PER_S
            floor = {"bytes": decode["bytes"], "flops": flops,
                     "floor_ms": 1e3 * max(t_flops, t_bytes),
                     "floor_sum_ms": 1e3 * (t_flops + t_bytes),
                     "bound": "compute" if t_flops >= t_bytes else "memory"}
        elif label.startswith("prefill"):
            params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
            counter = iter(range(100))

            def prepare(engine=engine, params=params, counter=counter):
                while engine.has_unfinished_requests():
                    engine.step()
                engine.add_request(f"p{next(counter)}", {"prompt_token_ids": [
                    (j * 13) % 30000 + 100 for j in range(prompt)]}, params)
            prepare()
            engine.step()  # warm-up: compile the prefill kernels
            floor = step_floor(arch, prompt, 1, prompt)
        else:
            def prepare():
                pass
            run_to_state(engine, batch, prompt, 3, "r")
            floor = step_floor(arch, batch, batch, prompt + 4,
                               engine.core.executor.runner.weight_bytes)
        results.append(profile_step(engine, label, floor, prepare))
        engine = None  # free the model before the next configuration
        torch.cuda.empty_cache()
    save_result(ns.out, {"script": "benchmarks/gpu/profile_steps.py",
                         "quantization": ns.quantization, "cases": results})


if __name__ == "__main__":
    main()
