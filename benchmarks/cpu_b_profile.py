"""Where CPU-B's time goes, per KV cache dtype: the CPU-B workload (64 requests, prompts
16..512, outputs 16..256, seed 0, the embedded GGUF SmolLM2, default engine settings)
run once per ``--kv-cache-dtypes`` entry, with the engine's parts timed.

    flock /tmp/kvflow-bench.lock python benchmarks/cpu_b_profile.py \
        --kv-cache-dtypes auto,int8 --save-result benchmarks/results/cpu-b-kv-profile.json

Phases (seconds over the run; wall time, so a busy machine inflates all of them):

- ``eager_forward``: steps the C++ decode step does not take (prefill chunks longer than
  its 64-token limit), the whole model forward;
- ``cpp_step``: the C++ decode step's calls, split into ``cpp_linear_callbacks`` (its
  quantized linears called back in Python: GGUF's int4 GEMM for more than 4 rows) and
  ``cpp_rest`` (norms, rotary, the KV cache write and attention, the 4-bit GEMV of small
  steps: what a KV cache dtype changes);
- ``logits``: the lm_head; ``other``: scheduler, step inputs, sampler, outputs.

The timing wraps those methods on the live engine (a few microseconds per call).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kvflow import LLM, SamplingParams
from kvflow.bench.datasets import random_requests
from kvflow.bench.machine import save_result


class Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.in_cpp = False

    def wrap(self, name: str, fn, *, cpp: bool = False):
        def timed(*args, **kw):
            key = name
            if name == "linear" and self.in_cpp:
                key = "cpp_linear_callbacks"
            if cpp:
                self.in_cpp = True
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
                self.calls[key] = self.calls.get(key, 0) + 1
                if cpp:
                    self.in_cpp = False
        return timed


def profile(kv: str, seed: int) -> dict:
    from kvflow.layers.quantization import gguf

    timer = Timer()
    apply = gguf.GGUFLinearMethod.apply
    gguf.GGUFLinearMethod.apply = timer.wrap("linear", apply)  # before the step binds it
    try:
        llm = LLM("smollm2-135m", kv_cache_dtype=kv, max_model_len=8192,
                  max_num_batched_tokens=2048, max_num_seqs=128)
    finally:
        gguf.GGUFLinearMethod.apply = apply
    engine = llm.engine
    runner = engine.core.executor.runner
    step = runner.graphs
    if step is None or not hasattr(step, "run_eager"):
        raise SystemExit(f"kv {kv}: the C++ decode step is off (see the log)")
    step.run = timer.wrap("cpp_step", step.run, cpp=True)
    step.run_eager = timer.wrap("eager_forward", step.run_eager)
    runner.model.compute_logits = timer.wrap("logits", runner.model.compute_logits)
    requests = random_requests(64, (16, 512), (16, 256), runner.config.model.arch.vocab_size,
                               seed, {0, 1, 2})
    for i, r in enumerate(requests):
        engine.add_request(f"p{i}", {"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(temperature=0.0, max_tokens=r.output_len,
                                          ignore_eos=True))
    steps = 0
    load_start = os.getloadavg()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    total = time.perf_counter() - start
    s = timer.seconds
    phases = {
        "total": total,
        "eager_forward": s.get("eager_forward", 0.0),
        "cpp_step": s.get("cpp_step", 0.0),
        "cpp_linear_callbacks": s.get("cpp_linear_callbacks", 0.0),
        "cpp_rest": s.get("cpp_step", 0.0) - s.get("cpp_linear_callbacks", 0.0),
        "logits": s.get("logits", 0.0),
    }
    phases["other"] = total - phases["eager_forward"] - phases["cpp_step"] - phases["logits"]
    out = sum(r.output_len for r in requests)
    print(f"[kv {kv}] {total:.1f} s, {steps} steps, {out / total:.1f} output tokens/s; "
          + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items() if k != "total"))
    return {"kv_cache_dtype": kv, "steps": steps, "output_tokens": out,
            "output_tokens_per_s": out / total, "seconds": phases,
            "calls": {"cpp_step": timer.calls.get("cpp_step", 0),
                      "eager_forward": timer.calls.get("eager_forward", 0)},
            "loadavg_start": load_start, "loadavg_end": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-dtypes", default="auto,int8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-result", default=None)
    ns = ap.parse_args()
    runs = {kv: profile(kv, ns.seed) for kv in ns.kv_cache_dtypes.split(",")}
    result = {"workload": "CPU-B: 64 requests, prompts 16..512, outputs 16..256, seed 0",
              "runs": runs}
    kinds = list(runs)
    base = runs[kinds[0]]["seconds"]
    for kv in kinds[1:]:
        ratio = runs[kv]["output_tokens_per_s"] / runs[kinds[0]]["output_tokens_per_s"]
        saved = {k: base[k] - v for k, v in runs[kv]["seconds"].items()}
        result[f"{kv}/{kinds[0]}"] = {"output_tokens_per_s": ratio, "seconds_saved": saved}
        print(f"{kv}/{kinds[0]}: {ratio:.2f}x; seconds saved: "
              + ", ".join(f"{k} {v:+.2f}" for k, v in saved.items()))
    result = save_result(None, result)  # stamps commit, machine, date, load average
    result["command"] = "python " + " ".join(sys.argv)  # a script, not the kvflow CLI
    if ns.save_result:
        with open(ns.save_result, "w") as f:
            json.dump(result, f, indent=2)
        print(f"saved {ns.save_result}")


if __name__ == "__main__":
    main()
