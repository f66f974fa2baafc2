"""GPU micro-benchmark of the fused MoE kernel (kvflow/kernels/fused_moe.py) against a
per-expert loop of cuBLAS GEMMs (the same routing; each active expert's rows gathered,
gate/up GEMM, SiLU-and-mul, down GEMM, weighted index_add), at M = 1..256 tokens.

Shapes: one Qwen3-30B-A3B MoE layer (E 128, top-8, hidden 2048, expert 768) and one
Mixtral-8x7B layer (E 8, top-2, hidden 4096, expert 14336), bf16, uniform random routing.
Each case: median time (``triton.testing.do_bench``), the bytes of the experts the step
touches (each active expert's w13 and w2 read once) and the GB/s that implies.
``--tune``: sweep launch configurations per M and write the fastest as a device table
in the format of kvflow/kernels/configs/fused_moe/*.json (``--table``).

    python benchmarks/gpu/bench_moe.py --out moe-kernel-bench.json --tune --table t.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from triton.testing import do_bench  # noqa: E402

from kvflow.bench.machine import machine_info, save_result  # noqa: E402
from kvflow.kernels.fused_moe import fused_moe, fused_moe_config, fused_moe_ref  # noqa: E402
from kvflow.layers.moe.methods import routed_experts  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SWEEP = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
         for bm, bn, bk, w, s in itertools.product((16, 32, 64), (32, 64, 128), (64, 128),
                                                   (4, 8), (3, 4))]


def make(e, k, h, inter, m, dev, dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(m)
    x = torch.randn(m, h, device=dev, dtype=dtype, generator=g)
    w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dtype, generator=g) * h ** -0.5
    w2 = torch.randn(e, h, inter, device=dev, dtype=dtype, generator=g) * inter ** -0.5
    logits = torch.randn(m, e, device=dev, generator=g)
    w, ids = torch.topk(logits.softmax(-1), k, dim=-1)
    return x, w13, w2, w / w.sum(-1, keepdim=True), ids


def _mlp(r, w13, w2):
    gate, up = F.linear(r, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def loop(x, w13, w2, w, ids):
    """The per-expert cuBLAS loop (kvflow's CPU path, run on the GPU)."""
    return routed_experts(x, w, ids, w13.shape[0], lambda e, r: _mlp(r, w13[e], w2[e]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--table", help="write the tuned device table here (with --tune)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows, tuned = [], {}
    for name in args.shapes.split(","):
        e, k, h, inter = SHAPES[name]
        for m in MS:
            x, w13, w2, w, ids = make(e, k, h, inter, m, dev)
            active = int(torch.unique(ids).numel())
            nbytes = active * 3 * h * inter * 2
            err = (fused_moe(x, w13, w2, w, ids).float()
                   - fused_moe_ref(x, w13, w2, w, ids).float()).abs().max().item()
            t_kernel = do_bench(lambda: fused_moe(x, w13, w2, w, ids)) * 1e-3
            t_loop = do_bench(lambda: loop(x, w13, w2, w, ids)) * 1e-3
            row = dict(shape=name, m=m, active_experts=active, bytes=nbytes,
                       kernel_us=t_kernel * 1e6, loop_us=t_loop * 1e6,
                       speedup=t_loop / t_kernel, kernel_gbs=nbytes / t_kernel / 1e9,
                       loop_gbs=nbytes / t_loop / 1e9, max_abs_err=err,
                       config=fused_moe_config(m, dev))
            if args.tune:
                best = (t_kernel, row["config"])
                for cfg in SWEEP:
                    if cfg["block_m"] > 16 and m <= 8:
                        continue  # decode: one row per expert block, bigger M only pads
                    try:
                        t = do_bench(lambda: fused_moe(x, w13, w2, w, ids, config=cfg),
                                     warmup=5, rep=20) * 1e-3
                    except Exception as exc:  # out of shared memory, etc.
                        print("skip", cfg, type(exc).__name__)
                        continue
                    if t < best[0]:
                        best = (t, cfg)
                row["tuned_us"], row["tuned_config"] = best[0] * 1e6, best[1]
                tuned.setdefault(m, []).append(best)
            rows.append(row)
            print(f"{name:14s} M={m:4d} experts={active:3d} kernel {row['kernel_us']:8.1f} us "
                  f"({row['kernel_gbs']:6.0f} GB/s)  loop {row['loop_us']:8.1f} us  "
                  f"x{row['speedup']:.2f}  err {err:.2e}"
                  + (f"  tuned {row['tuned_us']:.1f} us {row['tuned_config']}"
                     if args.tune else ""), flush=True)
    result = dict(command="python " + " ".join(sys.argv), machine=machine_info(),
                  device=torch.cuda.get_device_name(dev), rows=rows)
    save_result(args.out, result)
    if args.tune and args.table:
        # per M, the config that won for the first shape (Qwen3-30B-A3B: the target)
        configs = [dict(max_tokens=m, **best[0][1]) for m, best in sorted(tuned.items())]
        configs[-1]["max_tokens"] = 1_000_000_000
        with open(args.table, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev),
                           note="tuned by benchmarks/gpu/bench_moe.py --tune",
                           configs=configs), f, indent=1)


if __name__ == "__main__":
    main()
