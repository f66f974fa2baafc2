"""Where LoRA's cost goes on the GPU: the same requests on one LoRA-enabled engine for
the base model and for a mix of 4 adapters (rank 16 on every linear, Llama-3.1-8B shape,
dummy weights), each under the torch profiler. Prints and saves the wall time, the
summed kernel time, the GPU's idle share, and the kernels grouped by name with the
difference between the two runs.

    python benchmarks/gpu/profile_lora.py --out profile-lora.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kvflow import LLM, LoRARequest, SamplingParams
from kvflow.bench.lora import write_random_adapter
from kvflow.bench.machine import save_result


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernels(prof) -> dict[str, float]:
    """Kernel name -> total ms."""
    out: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:90]] += e.device_time_total / 1e3 if hasattr(e, "device_time_total") \
                else e.cuda_time_total / 1e3
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="profile-lora.json")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ns = p.parse_args()
    llm = LLM(ns.model, load_format="dummy", max_model_len=4096, enable_lora=True,
              max_loras=ns.adapters, max_lora_rank=ns.rank, enforce_eager=ns.eager,
              enable_prefix_caching=False)
    arch = llm.engine.config.model.arch
    tmp = tempfile.mkdtemp()
    loras = []
    for i in range(ns.adapters):
        write_random_adapter(os.path.join(tmp, f"a{i}"), arch, ns.rank, i)
        loras.append(LoRARequest(f"a{i}", i + 1, os.path.join(tmp, f"a{i}")))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, min(30000, arch.vocab_size), (ns.input_len,), generator=g).tolist()
               for _ in range(ns.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True,
                            detokenize=False)
    mixes = {"base": None, "lora": [loras[i % len(loras)] for i in range(len(prompts))]}
    result = {}
    for name, mix in mixes.items():
        llm.generate(prompts, params, use_tqdm=False, lora_request=mix)  # warm
        sync()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, lora_request=mix)
        sync()
        plain = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if torch.cuda.is_available()
                     else [ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=mix)
            sync()
            wall = time.perf_counter() - t0
        k = kernels(prof)
        cpu = {e.key[:70]: round(e.self_cpu_time_total / 1e3, 1)
               for e in prof.key_averages() if e.self_cpu_time_total > 0}
        busy = sum(k.values()) / 1e3
        result[name] = {"wall_s": round(plain, 3), "profiled_wall_s": round(wall, 3),
                        "kernel_s": round(busy, 3), "kernels_ms": k,
                        "cpu_self_ms": dict(sorted(cpu.items(), key=lambda kv: -kv[1])[:25])}
        print(f"{name}: {plain:.3f} s ({wall:.3f} s profiled), kernels {busy:.3f} s")
    # the two phases apart: prompts alone (1 output token), decode alone (short prompts)
    phases = {"prefill": ([p[:ns.input_len] for p in prompts], 1),
              "decode": ([p[:16] for p in prompts], 2 * ns.output_len)}
    for phase, (ps, out_len) in phases.items():
        pp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True,
                            detokenize=False)
        for name, mix in mixes.items():
            best = float("inf")
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                llm.generate(ps, pp, use_tqdm=False, lora_request=mix)
                sync()
                best = min(best, time.perf_counter() - t0)
            result.setdefault("phases", {})[f"{phase}_{name}_s"] = round(best, 4)
    print("phases (best of 3):", result["phases"])
    for name in mixes:
        print(f"{name}: host ops by self CPU ms:", list(result[name]["cpu_self_ms"].items())[:12])
    base, lora = result["base"]["kernels_ms"], result["lora"]["kernels_ms"]
    diff = {n: lora.get(n, 0.0) - base.get(n, 0.0) for n in set(base) | set(lora)}
    print("kernel ms: base / lora / lora - base (largest differences)")
    for n in sorted(diff, key=lambda n: -abs(diff[n]))[:25]:
        print(f"  {base.get(n, 0):9.1f} {lora.get(n, 0):9.1f} {diff[n]:+9.1f}  {n}")
    for key, r in result.items():
        if key == "phases":
            continue
        r["kernels_ms"] = {n: round(v, 2) for n, v in
                           sorted(r["kernels_ms"].items(), key=lambda kv: -kv[1])[:40]}
    save_result(ns.out, {"benchmark": "profile-lora", "workload": vars(ns), **result,
                         "diff_ms": {n: round(diff[n], 2) for n in
                                     sorted(diff, key=lambda n: -abs(diff[n]))[:40]}})


if __name__ == "__main__":
    main()
