"""Where a short prefill's time goes on the GPU: time-to-first-token of one prompt
(``max_tokens=1``) through the engine, repeated, then one such request under the torch
profiler: GPU kernels and host ops by self time over the whole request.

    python benchmarks/gpu/prefill_probe.py --quantization fp8 --out $OUT/prefill-probe.json

``--input-lens 32,128,512`` times several prompt lengths on the one engine (the profiles
are of the first). ``KVFLOW_PREFILL_GRAPHS=on`` in the environment measures the
one-request prefill graphs (captured at startup) instead of the eager prefill.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from kvflow.bench.machine import save_result  # noqa: E402
from kvflow.engine.args import EngineArgs  # noqa: E402
from kvflow.engine.llm_engine import LLMEngine  # noqa: E402
from kvflow.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--input-lens", default="",
                    help="comma-separated prompt lengths timed on the one engine (default: "
                    "--input-len); the profiles are of the first")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    extra = {} if ns.quantization == "none" else {"quantization": ns.quantization}
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=ns.model, load_format="dummy", max_num_seqs=1, max_model_len=4096,
        enable_prefix_caching=False, **extra))
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    lens = [int(v) for v in ns.input_lens.split(",") if v] or [ns.input_len]
    counter = iter(range(1 << 20))
    by_len = {}
    for n in lens[1:]:  # the other lengths: TTFT only
        prompt = [(j * 13 + n) % 30000 + 100 for j in range(n)]
        _ttft(engine, prompt, params, counter)
        _ttft(engine, prompt, params, counter)
        by_len[n] = [_ttft(engine, prompt, params, counter) * 1e3 for _ in range(ns.repeats)]
        print(f"TTFT {n}-token prompt: {[round(t, 1) for t in by_len[n]]} ms", flush=True)
    ns.input_len = lens[0]
    prompt = [(j * 13) % 30000 + 100 for j in range(ns.input_len)]

    def one() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.add_request(f"p{next(counter)}", {"prompt_token_ids": prompt}, params)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        one.steps = steps
        return time.perf_counter() - t0

    for _ in range(2):
        one()
    times = [one() for _ in range(ns.repeats)]
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    one()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
    python_top = buf.getvalue()
    print(python_top[-4000:])
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        one()
    kernels = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            kernels[e.key][0] += e.device_time_total / 1e3
            kernels[e.key][1] += e.count
    gpu = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                  key=lambda e: -e.self_cpu_time_total)[:20]
    print(f"TTFT {ns.input_len}-token prompt: {[round(t * 1e3, 1) for t in times]} ms, "
          f"{one.steps} engine steps; GPU kernels {sum(v[0] for v in kernels.values()):.2f} ms")
    for n, (ms, c) in gpu[:10]:
        print(f"  gpu {ms:8.3f} ms x{c:<5d} {n[:80]}")
    for e in host[:12]:
        print(f"  host {e.self_cpu_time_total / 1e3:8.3f} ms x{e.count:<5d} {e.key[:80]}")
    from kvflow.worker.cuda_graphs import prefill_graphs_on

    save_result(ns.out, {"input_len": ns.input_len, "ttft_ms": [t * 1e3 for t in times],
                         "steps": one.steps,
                         "prefill_graphs": prefill_graphs_on(torch.device("cuda")),
                         "ttft_ms_by_input_len": {str(k): v for k, v in by_len.items()},
                         "gpu_kernels": [{"name": n, "ms": ms, "count": c}
                                         for n, (ms, c) in gpu],
                         "host_self": [{"name": e.key, "ms": e.self_cpu_time_total / 1e3,
                                        "count": e.count} for e in host],
                         "python_tottime_top": python_top})


def _ttft(engine, prompt: list[int], params: SamplingParams, counter) -> float:
    """Seconds from adding one request until its one token is out, on an idle engine."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.add_request(f"q{next(counter)}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
