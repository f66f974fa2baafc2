"""GPU micro-benchmark of the weight-only GEMMs (``kvflow/kernels/w4a16_gemm.py``,
``w8a16_gemm.py``) at Llama-3.1-8B's linear shapes against bf16 cuBLAS (``F.linear``).

    python benchmarks/gpu/bench_woq.py --out $OUT/woq-bench.json [--sweep]

Per shape (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096), per M
(1, 4, 16, 256) and per format (bf16; int4 group 128 and group 32 with offsets; int8 per
channel; int8 group 32 as GGUF Q8_0 becomes): the median time replayed from a CUDA graph
(what the engine's decode graphs see: no Python launch overhead), the eager median (``do_bench``, L2 flushed), the bytes the launch must move
(packed weight + scales + activations + output) over the graph time as GB/s and as a
fraction of the H200's 4.8 TB/s, the speed-up over bf16, and the largest error against
the kernel's reference. ``--sweep`` also times a grid of tile configurations for M <= 16
(int4-g128 at M = 1 and 16: the GEMV and the dot tiles).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from kvflow.bench.machine import save_result  # noqa: E402
from kvflow.kernels.int4_layout import pack_int4  # noqa: E402
from kvflow.kernels.w4a16_gemm import w4a16_gemm, w4a16_ref  # noqa: E402
from kvflow.kernels.w8a16_gemm import w8a16_gemm, w8a16_ref  # noqa: E402
from kvflow.kernels.woq_config import WoqConfig, choose_config  # noqa: E402

HBM = 4.8e12
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}  # (K, N)
MS = (1, 4, 16, 256)
DT = torch.bfloat16


def _weights(fmt: str, n: int, k: int) -> tuple:
    """(kernel args after x, bytes of the weight tensors)."""
    if fmt.startswith("int4"):
        group = int(fmt.split("-g")[1])
        qw = pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda"))
        s = (torch.rand(n, k // group, device="cuda") * 0.01 + 1e-3).to(DT)
        b = (torch.randn(n, k // group, device="cuda") * 0.01).to(DT)
        return (qw, s, b, group), qw.nbytes + s.nbytes + b.nbytes
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
    if fmt == "int8-channel":
        s = torch.rand(n, device="cuda") * 1e-3 + 1e-4
        return (q, s, None, None), q.nbytes + s.nbytes
    s = (torch.rand(n, k // 32, device="cuda") * 1e-3 + 1e-4).to(DT)
    return (q, s, None, 32), q.nbytes + s.nbytes


def _fns(fmt: str):
    return (w4a16_gemm, w4a16_ref) if fmt.startswith("int4") else (w8a16_gemm, w8a16_ref)


def _time(fn) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    graph_ms = float(do_bench_cudagraph(fn, rep=50, return_mode="median"))
    eager_ms = float(do_bench(fn, warmup=10, rep=50, return_mode="median"))
    return graph_ms, eager_ms


def bench(sweep: bool) -> dict:
    rows, sweeps = [], []
    for (name, (k, n)), m in itertools.product(SHAPES.items(), MS):
        x = torch.randn(m, k, dtype=DT, device="cuda")
        w = torch.randn(n, k, dtype=DT, device="cuda")
        io = x.nbytes + m * n * 2
        g, e = _time(lambda: F.linear(x, w))
        bf16_ms = g
        rows.append({"shape": name, "k": k, "n": n, "m": m, "format": "bf16-cublas",
                     "graph_ms": g, "eager_ms": e, "bytes": w.nbytes + io,
                     "gb_per_s": (w.nbytes + io) / g / 1e6,
                     "hbm_fraction": (w.nbytes + io) / g / 1e-3 / HBM})
        del w
        for fmt in ("int4-g128", "int4-g32", "int8-channel", "int8-g32"):
            args, wbytes = _weights(fmt, n, k)
            gemm, ref = _fns(fmt)
            cfg = choose_config(m, n, k, x.device, 4 if fmt.startswith("int4") else 8)
            try:
                err = float((gemm(x, *args).float() - ref(x, *args).float()).abs().max())
                g, e = _time(lambda: gemm(x, *args))
            except Exception as exc:  # one failing format must not hide the others
                rows.append({"shape": name, "m": m, "format": fmt, "error": repr(exc)[:300]})
                continue
            total = wbytes + io
            rows.append({"shape": name, "k": k, "n": n, "m": m, "format": fmt,
                         "config": cfg.__dict__, "graph_ms": g, "eager_ms": e, "bytes": total,
                         "gb_per_s": total / g / 1e6, "hbm_fraction": total / g / 1e-3 / HBM,
                         "speedup_vs_bf16": bf16_ms / g, "max_abs_err_vs_ref": err})
            print(f"{name:8s} M={m:<4d} {fmt:13s} {g * 1e3:8.1f} us  "
                  f"{total / g / 1e6:7.0f} GB/s  x{bf16_ms / g:.2f} vs bf16", flush=True)
            if sweep and m in (1, 16) and fmt == "int4-g128":  # int8 reached its bound
                sweeps += _sweep(name, m, n, k, x, fmt, args, wbytes + io, bf16_ms)
            del args
        torch.cuda.empty_cache()
    return {"rows": rows, "sweep": sweeps}


def _sweep(name, m, n, k, x, fmt, args, total, bf16_ms) -> list[dict]:
    """Tile configurations around the heuristic's for one case (opt-in: --sweep)."""
    gemm, _ = _fns(fmt)
    bits = 4 if fmt.startswith("int4") else 8
    base = choose_config(m, n, k, x.device, bits)
    splits = sorted({max(1, base.split_k // 2), base.split_k, base.split_k * 2})
    grid = [WoqConfig(16, bn, base.block_k, sk, True, w, st)
            for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3) for sk in splits]
    if m == 1 and bits == 4:  # the register GEMV (its prefetch is manual: stages unused)
        grid = [WoqConfig(1, bn, base.block_k, sk, False, w, 1)
                for bn in (32, 64, 128) for w in (2, 4, 8) for sk in splits]
    elif m == 1:  # int8's tl.sum path beside its dot tiles
        grid += [WoqConfig(1, bn, base.block_k, sk, False, w, 3)
                 for bn in (32, 64, 128) for w in (4, 8) for sk in splits]
    out = []
    for cfg in grid:
        try:
            g = float(do_bench_cudagraph(lambda: gemm(x, *args, config=cfg), rep=20,
                                         return_mode="median"))
        except Exception as exc:
            out.append({"shape": name, "m": m, "format": fmt, "config": cfg.__dict__,
                        "error": repr(exc)[:200]})
            continue
        out.append({"shape": name, "m": m, "format": fmt, "config": cfg.__dict__,
                    "graph_ms": g, "gb_per_s": total / g / 1e6,
                    "speedup_vs_bf16": bf16_ms / g})
    best = min((r for r in out if "graph_ms" in r), key=lambda r: r["graph_ms"], default=None)
    if best:
        print(f"  sweep best {name} M={m} {fmt}: {best['config']} {best['graph_ms'] * 1e3:.1f} "
              f"us x{best['speedup_vs_bf16']:.2f}", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sweep", action="store_true")
    ns = p.parse_args()
    start = time.time()
    result = bench(ns.sweep)
    result.update({"command": "python " + " ".join(sys.argv),
                   "device": torch.cuda.get_device_name(), "hbm_bytes_per_s": HBM,
                   "seconds": time.time() - start,
                   "timing": "do_bench_cudagraph median (graph_ms), do_bench median (eager_ms)"})
    save_result(ns.out, result)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
