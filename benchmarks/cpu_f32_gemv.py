"""The C++ step's float32 GEMV (`linear_f32`, cpu/step.cpp's ``linear_rows_f32``) against
``F.linear`` (at::linear: what the step ran above 4 rows, and what a dense lm_head ran)
at SmolLM2-135M's dense shapes, for m rows of input.

  layers_ms  the 30 decoder layers' four linears (qkv 960x576, o 576x576, gate_up
             3072x576, down 576x1536: 424 MB of float32 weights, streamed from memory
             as in a step), best of --reps;
  head_ms    the tied lm_head (49152x576, 113 MB).
Random weights: the arithmetic and the bytes are what count.
Usage: PYTHONPATH=. python benchmarks/cpu_f32_gemv.py --rows 1,2,4,5,9,16 --output X.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F


def best_ms(fn, reps: int, n: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1000


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--rows", default="1,2,3,4,5,8,9,16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--output", default=None)
    ns = p.parse_args()

    from kvflow.bench.machine import save_result
    from kvflow.cpu.step import load_extension

    module, _ = load_extension()
    empty = torch.empty(0)
    gen = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    layers = [[torch.randn(n, k, generator=gen) for n, k in shapes] for _ in range(30)]
    head = torch.randn(49152, 576, generator=gen)
    rows = []
    for m in (int(r) for r in ns.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}

        def ours():
            for layer in layers:
                for w in layer:
                    module.linear_f32(xs[w.shape[1]], w, empty)

        def aten():
            for layer in layers:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)
        row = {"rows": m,
               "layers_ms": {"linear_f32": best_ms(ours, ns.reps),
                             "at_linear": best_ms(aten, ns.reps)},
               "head_ms": {"linear_f32": best_ms(lambda: module.linear_f32(xs[576], head, empty),
                                                 ns.reps),
                           "at_linear": best_ms(lambda: F.linear(xs[576], head), ns.reps)}}
        rows.append(row)
        print(f"{m:2d} rows: layers {row['layers_ms']['linear_f32']:6.1f} ms (at::linear "
              f"{row['layers_ms']['at_linear']:6.1f}), head {row['head_ms']['linear_f32']:5.1f} "
              f"ms (at::linear {row['head_ms']['at_linear']:5.1f})", flush=True)
    save_result(ns.output, {"benchmark": "cpu_f32_gemv", "threads": torch.get_num_threads(),
                            "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
