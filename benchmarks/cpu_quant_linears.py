"""Per-linear CPU timing of the quantized fast paths against float32 F.linear on
SmolLM2-135M's real shapes, at M=1 (decode) and M=64 (a batch of decodes / prefill chunk).

    flock /tmp/kvflow-bench.lock python benchmarks/cpu_quant_linears.py \
        --save-result benchmarks/results/cpu-quant-linears.json

Best of several repeats (the machine is shared; the minimum is the least disturbed run).
Also times the packed ops' float32 inputs, to show why the fast path runs in bfloat16.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from kvflow.bench.machine import save_result
from kvflow.layers.quantization.packed import (Int4Groups, PackedInt4, int4_mm, int8_mm,
                                               quantize_int4, quantize_int8)

from cpu_timing import SMOLLM2_LINEARS, best_us  # noqa: E402  (this folder)

SHAPES = SMOLLM2_LINEARS


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--save-result", default=None)
    ap.add_argument("--reps", type=int, default=7)
    ns = ap.parse_args()
    rows = []
    for m in (1, 64):
        for name, n, k in SHAPES:
            g = torch.Generator().manual_seed(n + k)
            w, x = torch.randn(n, k, generator=g) * 0.02, torch.randn(m, k, generator=g)
            inner = 3 if n > 10000 else 20
            q4 = PackedInt4(quantize_int4(w, 32, False))
            q8, s8 = quantize_int8(w)
            s8 = s8.bfloat16()
            qq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            p8 = PackedInt4(Int4Groups.from_int8_blocks(qq, torch.rand(n, k // 32) + 0.1))
            row = {"linear": name, "M": m, "N": n, "K": k,
                   "f32_linear_us": best_us(lambda: F.linear(x, w), ns.reps, inner),
                   "int4_g32_us": best_us(lambda: int4_mm(x, q4.packed, q4.scale_zero, 32,
                                                          False), ns.reps, inner),
                   "int8_channel_us": best_us(lambda: int8_mm(x, q8, s8), ns.reps, inner),
                   "q8_0_as_nibbles_us": best_us(lambda: int4_mm(x, p8.packed, p8.scale_zero,
                                                                 32, True), ns.reps, inner)}
            if m == 1 and n < 10000:  # the ops' own float32 path, for the record
                row["int4_fp32_input_us"] = best_us(
                    lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                        x, q4.packed, 32, q4.scale_zero.float()), 3, 3)
            for key in [k2 for k2 in row if k2.endswith("_us") and k2 != "f32_linear_us"]:
                row[key.replace("_us", "_speedup")] = row["f32_linear_us"] / row[key]
            rows.append(row)
            print({k2: round(v, 2) if isinstance(v, float) else v for k2, v in row.items()},
                  flush=True)
    save_result(ns.save_result, {"threads": torch.get_num_threads(), "rows": rows,
                                 "loadavg": list(os.getloadavg())})


if __name__ == "__main__":
    main()
