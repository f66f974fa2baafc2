"""GPU micro-benchmark of the FP8 W8A8 linears at Llama-3.1-8B's shapes: the Triton
kernels (``kvflow/kernels/fp8_gemm.py``, ``fp8_quant.py``) against the previous path
(torch per-token quantization + ``torch._scaled_mm``) and bf16 cuBLAS (``F.linear``).

    python benchmarks/gpu/bench_fp8.py --out $OUT/fp8-bench.json [--sweep]
    python benchmarks/gpu/bench_fp8.py --out /tmp/x.json --smoke   # CPU: interpreter

Per shape (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) and M
(1, 2, 4, 8, 64, 256), each a whole linear from bf16 activations to bf16 output, median
time replayed from a CUDA graph (what decode graphs see):

- ``bf16-cublas``: F.linear;
- ``fp8-torch-scaled_mm``: the previous ``--quantization fp8`` path (five torch kernels
  for the per-token quantization, then _scaled_mm);
- ``fp8-quant-scaled_mm``: one-launch ``quantize_fp8`` + _scaled_mm (``--quantization
  fp8`` at every M since the first H200 run);
- ``fp8-triton``: ``fp8_gemm`` per channel (in-kernel quantization up to M = 16, else
  quantize_fp8 + the Triton GEMM; slower than the row above there, so unused by the layer);
- ``fp8-block-triton``: ``fp8_linear`` with 128 x 128 blocks (``--quantization
  fp8-block``); ``fp8-block-fused``: the in-kernel quantization at every M.

The bytes a launch must move (fp8 weight + scales + activations + output) over the time
give GB/s against the H200's 4.8 TB/s. ``--sweep`` times a grid of tile configurations
for the per-channel kernel at M = 1 and 8 (and the block kernel at M = 1) on each shape.
``--smoke`` runs every path once at tiny shapes in the Triton interpreter (no GPU; the
times mean nothing), so the script is known to work before a GPU call.
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
SMOKE = "--smoke" in sys.argv
if SMOKE:  # read when the kernels are decorated, so before their import
    os.environ["TRITON_INTERPRET"] = "1"

from triton.testing import do_bench_cudagraph  # noqa: E402

from kvflow.bench.machine import save_result  # noqa: E402
from kvflow.kernels.fp8_gemm import (Fp8Config, choose_config, fp8_gemm,  # noqa: E402
                                     fp8_gemm_ref, fp8_linear)
from kvflow.kernels.fp8_quant import quantize_fp8, quantize_fp8_ref  # noqa: E402
from kvflow.layers.quantization.fp8 import quantize_fp8_rows  # noqa: E402
from kvflow.layers.quantization.fp8_block import quantize_fp8_blocks  # noqa: E402

HBM = 4.8e12
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}  # (K, N)
MS = (1, 2, 4, 8, 64, 256)
DT = torch.bfloat16
BLOCK = (128, 128)
DEV = "cpu" if SMOKE else "cuda"
if SMOKE:
    SHAPES = {"qkv": (256, 192), "gate_up": (256, 128)}
    MS = (1, 8, 20)


def _scaled_mm(xq, sx, wq, sw):
    return torch._scaled_mm(xq, wq.t(), scale_a=sx[:, None], scale_b=sw[None, :],
                            out_dtype=DT)


def _formats(x, w_bf16, wq, sw, wqb, swb) -> dict:
    """name -> (fn, weight bytes)."""
    m = x.shape[0]
    fmts = {
        "bf16-cublas": (lambda: F.linear(x, w_bf16), w_bf16.nbytes),
        "fp8-torch-scaled_mm": (lambda: _scaled_mm(*quantize_fp8_rows(x), wq, sw),
                                wq.nbytes + sw.nbytes),
        "fp8-quant-scaled_mm": (lambda: _scaled_mm(*quantize_fp8(x), wq, sw),
                                wq.nbytes + sw.nbytes),
        "fp8-triton": ((lambda: fp8_gemm(x, wq, sw)) if m <= 16 else
                       (lambda: _pre_gemm(x, wq, sw)), wq.nbytes + sw.nbytes),
        "fp8-block-triton": (lambda: fp8_linear(x, wqb, swb, BLOCK), wqb.nbytes + swb.nbytes),
        "fp8-block-fused": (lambda: fp8_gemm(x, wqb, swb, BLOCK), wqb.nbytes + swb.nbytes),
    }
    if SMOKE:  # no _scaled_mm on a CPU
        del fmts["fp8-torch-scaled_mm"], fmts["fp8-quant-scaled_mm"]
    return fmts


def _pre_gemm(x, wq, sw):
    """Above 16 rows: quantize once, then the GEMM on FP8 activations."""
    xq, sx = quantize_fp8(x)
    return fp8_gemm(xq, wq, sw, None, x_scale=sx, out_dtype=DT)


def _time(fn, rep=40) -> float:
    fn()
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def _check(x, wq, sw, wqb, swb) -> dict:
    """Largest error of the Triton paths against the references (relative to max|ref|)."""
    xq, sx = quantize_fp8_ref(x)
    ref = fp8_gemm_ref(xq, sx, wq, sw, None, torch.float32)
    xqb, sxb = quantize_fp8_ref(x, BLOCK[1])
    refb = fp8_gemm_ref(xqb, sxb, wqb, swb, BLOCK, torch.float32)
    per = fp8_gemm(x, wq, sw) if x.shape[0] <= 16 else _pre_gemm(x, wq, sw)
    return {"fp8-triton": float((per.float() - ref).abs().max() / ref.abs().max()),
            "fp8-block-triton": float((fp8_linear(x, wqb, swb, BLOCK).float() - refb).abs().max()
                                      / refb.abs().max())}


def bench(sweep: bool, save) -> dict:
    """``save(partial)`` is called after each shape, so a timeout keeps what was measured."""
    rows, sweeps, pending = [], [], []
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, dtype=DT, device=DEV) * 0.02
        wq, sw = quantize_fp8_rows(w)
        wqb, swb = quantize_fp8_blocks(w, BLOCK)
        for m in MS:
            x = torch.randn(m, k, dtype=DT, device=DEV)
            io = x.nbytes + m * n * 2
            try:
                errs = _check(x, wq, sw, wqb, swb)
            except Exception as exc:
                errs = {"error": repr(exc)[:300]}
            base = None
            for fmt, (fn, wbytes) in _formats(x, w, wq, sw, wqb, swb).items():
                try:
                    g = _time(fn)
                except Exception as exc:  # one failing format must not hide the others
                    rows.append({"shape": name, "m": m, "format": fmt,
                                 "error": repr(exc)[:300]})
                    print(f"{name:8s} M={m:<4d} {fmt:20s} FAILED {repr(exc)[:120]}", flush=True)
                    continue
                base = g if fmt == "bf16-cublas" else base
                total = wbytes + io
                row = {"shape": name, "k": k, "n": n, "m": m, "format": fmt, "graph_ms": g,
                       "bytes": total, "gb_per_s": total / g / 1e6,
                       "hbm_fraction": total / g / 1e-3 / HBM,
                       "speedup_vs_bf16": base / g if base else None}
                if fmt in errs:
                    row["max_rel_err_vs_ref"] = errs[fmt]
                if fmt.startswith("fp8-triton") or fmt.startswith("fp8-block"):
                    row["config"] = choose_config(m, n, k, None if fmt == "fp8-triton" else
                                                  BLOCK[1], x.device).__dict__
                rows.append(row)
                print(f"{name:8s} M={m:<4d} {fmt:20s} {g * 1e3:8.1f} us {total / g / 1e6:7.0f} "
                      f"GB/s  x{(base or g) / g:.2f} vs bf16", flush=True)
            if "error" in errs:
                print(f"{name} M={m} check failed: {errs['error']}", flush=True)
            if sweep and m in (1, 8):  # after every shape's rows (a timeout keeps those)
                bf16 = next(r["graph_ms"] for r in rows if r["shape"] == name and r["m"] == m
                            and r["format"] == "bf16-cublas")
                pending.append((name, m, n, k, x, wq, sw, None, wq.nbytes + io, bf16))
                if m == 1:
                    pending.append((name, m, n, k, x, wqb, swb, BLOCK, wqb.nbytes + io, bf16))
        save({"rows": rows, "sweep": sweeps, "partial": True})
        del w
    for case in pending:
        sweeps += _sweep(*case)
        save({"rows": rows, "sweep": sweeps, "partial": True})
    return {"rows": rows, "sweep": sweeps}


def _sweep(name, m, n, k, x, wq, sw, block, total, bf16_ms) -> list[dict]:
    """Tile configurations around the heuristic's, in-kernel quantization (M <= 16)."""
    base = choose_config(m, n, k, None if block is None else block[1], x.device)
    splits = sorted({1, max(1, base.split_k // 2), base.split_k, min(32, base.split_k * 2)})
    grid = [Fp8Config(16, bn, base.block_k, sk, 4, 3, swap)
            for bn, sk, swap in itertools.product((32, 64, 128), splits, (False, True))]
    grid += [Fp8Config(16, 64, base.block_k, base.split_k, w, st, swap)
             for w, st, swap in ((8, 3, False), (8, 3, True), (4, 4, False), (4, 4, True))]
    if block is None:
        grid += [Fp8Config(16, 64, 256, max(1, base.split_k // 2), 4, 3, swap)
                 for swap in (False, True)]
    fmt = "fp8-triton" if block is None else "fp8-block-fused"
    if SMOKE:
        grid = grid[:2] + grid[-2:]
    out = []
    for cfg in grid:
        try:
            g = _time(lambda: fp8_gemm(x, wq, sw, block, config=cfg), rep=20)
        except Exception as exc:
            out.append({"shape": name, "m": m, "format": fmt, "config": cfg.__dict__,
                        "error": repr(exc)[:200]})
            continue
        out.append({"shape": name, "m": m, "format": fmt, "config": cfg.__dict__,
                    "graph_ms": g, "gb_per_s": total / g / 1e6, "speedup_vs_bf16": bf16_ms / g})
    best = min((r for r in out if "graph_ms" in r), key=lambda r: r["graph_ms"], default=None)
    if best:
        print(f"  sweep best {name} M={m} {fmt}: {best['config']} "
              f"{best['graph_ms'] * 1e3:.1f} us x{best['speedup_vs_bf16']:.2f} "
              f"(heuristic {base.__dict__})", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpreter, CPU")
    ns = p.parse_args()
    start = time.time()

    def meta(result: dict) -> dict:
        result.update({"command": "python " + " ".join(sys.argv),
                       "device": "cpu (interpreter)" if SMOKE else torch.cuda.get_device_name(),
                       "hbm_bytes_per_s": HBM, "seconds": time.time() - start,
                       "timing": "do_bench_cudagraph median (graph_ms)"})
        return result

    def save(partial: dict) -> None:
        with open(ns.out, "w") as f:  # the last complete shape, if a timeout comes
            json.dump(meta(partial), f)

    result = meta(bench(ns.sweep, save))
    save_result(ns.out, result)
    print(f"wrote {ns.out} ({time.time() - start:.0f} s)")
    summary = {}
    for r in result["rows"]:
        if r.get("speedup_vs_bf16") and r["shape"] == "gate_up":
            summary.setdefault(r["format"], {})[r["m"]] = round(r["speedup_vs_bf16"], 2)
    print("gate_up speed-up over bf16 by M:", json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
