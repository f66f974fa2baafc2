"""Timing for the GPU kernel micro-benchmarks (bench_gemv.py, bench_woq_gemv.py,
bench_decode_attn.py): the calls are captured into one CUDA graph and replayed, so launch
gaps are those of a decode step's graph, not of Python."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_ms(fns: list[Callable[[], object]], replays: int = 20) -> float:
    """Median ms per call of ``fns`` (launched back to back) replayed from one CUDA graph."""
    for f in fns:  # warm-up outside capture: compiles, allocates split-K counters
        f()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(fns))
    del g
    times.sort()
    return times[len(times) // 2]
