"""The LoRA shrink/expand kernels at Llama-3.1-8B shapes (rank 16, 4 slots, rows spread
round-robin over the slots), per launch configuration, against their memory floor
(shrink: read x once and A per tile; expand: read and write y, read B per tile) at the
card's HBM rate. Decode-like steps (128 and 256 rows, 16-row tiles) and a prefill-like
step (8192 rows, 64-row tiles).

    python benchmarks/gpu/bench_lora_kernels.py --out lora-kernels.json
"""

from __future__ import annotations

import argparse

import torch
import triton

from kvflow.bench.machine import save_result
from kvflow.kernels.lora import (BLOCK_M_LARGE, BLOCK_M_SMALL, lora_expand_add, lora_shrink,
                                 lora_shrink_dense, lora_tiles)

HBM = 3.35e12  # H100 SXM bytes/s
# (name, in, [slice outputs]) per decoder layer
SHAPES = [("qkv", 4096, [4096, 1024, 1024]), ("o", 4096, [4096]),
          ("gate_up", 4096, [14336, 14336]), ("down", 14336, [4096])]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="lora-kernels.json")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--quick", action="store_true",
                   help="the defaults and the dense shrink only, no launch-config sweep")
    ns = p.parse_args()
    # Under a CUDA graph, as the engine replays decode steps (do_bench's per-call launch
    # and L2 flush made the small launches read +-50% between runs).
    bench = (lambda f: triton.testing.do_bench_cudagraph(f, rep=40))
    dev, dt, r, s = torch.device("cuda"), torch.bfloat16, ns.rank, ns.slots
    rows = []
    for t, bm in ((128, BLOCK_M_SMALL), (256, BLOCK_M_SMALL), (8192, BLOCK_M_LARGE)):
        token_slot = (torch.arange(t) % s).to(torch.int32)
        tiles = lora_tiles(token_slot.to(dev), torch.full((s,), r, dtype=torch.int32), s, bm)
        n_tiles = int((tiles.tile_slot >= 0).sum())
        for name, k, outs in SHAPES:
            n = len(outs) * r
            out = sum(outs)
            x = torch.randn(t, k, device=dev, dtype=dt)
            a = torch.randn(s, n, k, device=dev, dtype=dt) * 0.02
            b = torch.randn(s, out, r, device=dev, dtype=dt) * 0.02
            y = torch.randn(t, out, device=dev, dtype=dt)
            offsets = [sum(outs[:i]) for i in range(len(outs))]
            xa = lora_shrink(x, a, tiles)
            floor_shrink = (t * k * 2 + n_tiles * n * k * 2) / HBM * 1e6
            floor_expand = (2 * t * out * 2 + n_tiles * out * r * 2) / HBM * 1e6
            res = {"rows": t, "block_m": bm, "layer": name,
                   "shrink_floor_us": round(floor_shrink, 1),
                   "expand_floor_us": round(floor_expand, 1), "shrink": {}, "expand": {}}
            for bn in () if ns.quick else (16, 32, 64):
                for bk in (64, 128):
                    for w in (4, 8):
                        if bn < min(16, n) or (bn > 16 and bn // 2 >= n):
                            continue
                        key = f"bn{bn}_bk{bk}_w{w}"
                        try:
                            us = 1e3 * bench(
                                lambda: lora_shrink(x, a, tiles, block_n=bn, block_k=bk,
                                                    num_warps=w))
                        except Exception as e:  # noqa: BLE001 (a config that does not compile)
                            res["shrink"][key] = str(e)[:80]
                            continue
                        res["shrink"][key] = round(us, 1)
            res["shrink"]["default"] = round(1e3 * bench(lambda: lora_shrink(x, a, tiles)), 1)
            res["shrink"]["dense"] = round(1e3 * bench(lambda: lora_shrink_dense(x, a)), 1)
            xd = lora_shrink_dense(x, a)
            res["expand"]["default"] = round(1e3 * bench(
                lambda: lora_expand_add(y, xa, b, offsets, r, tiles)), 1)
            res["expand"]["dense"] = round(1e3 * bench(
                lambda: lora_expand_add(y, xd, b, offsets, r, tiles, dense=True)), 1)
            for bn in () if ns.quick else (64, 128, 256):
                for w in (4, 8):
                    key = f"bn{bn}_w{w}"
                    try:
                        us = 1e3 * bench(
                            lambda: lora_expand_add(y, xa, b, offsets, r, tiles, block_n=bn,
                                                    num_warps=w))
                    except Exception as e:  # noqa: BLE001
                        res["expand"][key] = str(e)[:80]
                        continue
                    res["expand"][key] = round(us, 1)
            best_s = min((v, k) for k, v in res["shrink"].items() if isinstance(v, float))
            best_e = min((v, k) for k, v in res["expand"].items() if isinstance(v, float))
            print(f"T={t:5d} {name:8s} shrink default {res['shrink']['default']:7.1f} us, "
                  f"dense {res['shrink']['dense']:7.1f}, best {best_s[0]:7.1f} ({best_s[1]}), "
                  f"floor {floor_shrink:6.1f} | expand default {res['expand']['default']}, "
                  f"dense {res['expand']['dense']}, best {best_e[0]:7.1f} ({best_e[1]}), "
                  f"floor {floor_expand:6.1f}")
            rows.append(res)
    save_result(ns.out, {"benchmark": "lora-kernels", "rank": r, "slots": s,
                         "timing": "triton.testing.do_bench_cudagraph", "results": rows})


if __name__ == "__main__":
    main()
