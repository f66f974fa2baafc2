"""CPU timing of the W8A8 int8 GEMM (``torch._int_mm``) against float32 ``F.linear`` on
SmolLM2-135M's real shapes, at M = 1 (one decode), 64 (a CPU-B decode batch) and 512
(a prefill chunk), with the layouts of the int8 weight that ``torch._int_mm`` accepts:

* ``wt_view``: B = ``wq.t()`` of the row-major [N, K] weight (column-major B, no copy;
  what ``prepare_weight`` keeps);
* ``wt_contig``: B = ``wq.t().contiguous()`` (row-major [K, N]);
* ``w8a8_total``: the whole W8A8 linear of kvflow (per-token quantize + GEMM + scale);
  ``w8a8_total_torch_quant`` the same with the activations quantized by the torch ops
  (``quantize_int8_rows_ref``) instead of the one C call that takes up to 16 float32
  rows (``cpu/kernels/quant_rows.cpp``); ``quantize_act`` / ``quantize_act_torch`` that
  step alone.

    flock /tmp/kvflow-bench.lock python benchmarks/cpu_int8_gemm.py \
        --save-result benchmarks/results/cpu-int8-gemm.json

Best of several repeats (the machine is shared; the minimum is the least disturbed run).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from kvflow.bench.machine import save_result
from kvflow.layers.quantization.int8_gemm import (int8_mm, prepare_weight, quantize_int8_rows,
                                                  quantize_int8_rows_ref, w8a8_apply)

from cpu_timing import SMOLLM2_LINEARS, best_us  # noqa: E402  (this folder)

SHAPES = SMOLLM2_LINEARS[:4]


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--save-result", default=None)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--m", default="1,64,512")
    ns = ap.parse_args()
    rows = []
    for m in [int(v) for v in ns.m.split(",")]:
        for name, n, k in SHAPES:
            g = torch.Generator().manual_seed(n + k)
            w, x = torch.randn(n, k, generator=g) * 0.02, torch.randn(m, k, generator=g)
            inner = 20 if m < 256 else 5
            wq, sw = quantize_int8_rows(w)
            xq, _ = quantize_int8_rows(x)
            pw = prepare_weight(wq, sw, name)
            wt_contig = wq.t().contiguous()
            row = {"linear": name, "M": m, "N": n, "K": k,
                   "f32_linear_us": best_us(lambda: F.linear(x, w), ns.reps, inner),
                   "int_mm_wt_view_us": best_us(lambda: torch._int_mm(xq, pw.wt), ns.reps,
                                                inner),
                   "int_mm_wt_contig_us": best_us(lambda: torch._int_mm(xq, wt_contig),
                                                  ns.reps, inner),
                   "quantize_act_us": best_us(lambda: quantize_int8_rows(x), ns.reps, inner),
                   "quantize_act_torch_us": best_us(lambda: quantize_int8_rows_ref(x),
                                                    ns.reps, inner),
                   "w8a8_total_us": best_us(lambda: w8a8_apply(x, pw, torch.float32),
                                            ns.reps, inner),
                   "w8a8_total_torch_quant_us": best_us(
                       lambda: int8_mm(*quantize_int8_rows_ref(x), pw, torch.float32),
                       ns.reps, inner)}
            for key in [k2 for k2 in row if k2.endswith("_us") and k2 != "f32_linear_us"]:
                row[key.replace("_us", "_speedup")] = row["f32_linear_us"] / row[key]
            rows.append(row)
            print({k2: round(v, 2) if isinstance(v, float) else v for k2, v in row.items()},
                  flush=True)
    save_result(ns.save_result, {"threads": torch.get_num_threads(), "rows": rows,
                                 "loadavg": list(os.getloadavg())})


if __name__ == "__main__":
    main()
