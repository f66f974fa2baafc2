"""What the CPU linear micro-benchmarks (cpu_int8_gemm.py, cpu_quant_linears.py) share:
SmolLM2-135M's linear shapes and a best-of-repeats timer (the machine is shared, so the
minimum is the least disturbed run)."""

from __future__ import annotations

import time
from collections.abc import Callable

# (name, N, K): qkv, o, gate_up and down of SmolLM2-135M, and its tied lm_head.
SMOLLM2_LINEARS = [("qkv_proj", 960, 576), ("o_proj", 576, 576), ("gate_up_proj", 3072, 576),
                   ("down_proj", 576, 1536), ("lm_head", 49152, 576)]


def best_us(fn: Callable[[], object], reps: int, inner: int) -> float:
    """Microseconds per call: the best of ``reps`` timings of ``inner`` calls each."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best * 1e6
