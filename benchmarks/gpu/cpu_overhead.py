"""Where the host time of an eager engine step goes (cProfile), on the GPU machine.

Decode steps at batch 32 without CUDA graphs and without overlap: the step time is then
host-bound, and the profile shows which Python calls cost it.

    python benchmarks/gpu/cpu_overhead.py
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from kvflow.engine.args import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.sampling_params import SamplingParams


def main() -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="llama-3.1-8b", load_format="dummy", enforce_eager=True, async_scheduling=False,
        max_model_len=4096, num_gpu_blocks_override=4096))
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0, detokenize=False)
    for i in range(32):
        engine.add_request(str(i), {"prompt_token_ids": [100 + i] * 256}, params)
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    print(f"eager decode step, batch 32: {(time.perf_counter() - start) / 20 * 1000:.2f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        engine.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
