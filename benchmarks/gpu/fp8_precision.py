"""GPU check of the FP8 W8A8 GEMM's accuracy (issue 16): the Triton kernel
(``kvflow/kernels/fp8_gemm.py``) with each tensor-core promotion setting
(``Fp8Config.promote_k``: 0 = the compiler's default, the kernel before the fix, which
promotes once per 128-wide K tile since each tile's dot starts from zero; 32 = every
wgmma instruction), ``torch._scaled_mm`` (cuBLAS,
default and fast accumulation) and the float32 reference ``fp8_gemm_ref``, each against a
float64 product of the same quantized operands, at Llama-3.1-8B's linear shapes.

    python benchmarks/gpu/fp8_precision.py --out $OUT/fp8-precision.json
    python benchmarks/gpu/fp8_precision.py --out /tmp/x.json --smoke   # CPU: interpreter

Per shape (o, qkv, down, gate_up), M (1, 8, 64, 256) and scale layout (per channel;
block 128 x 128 with 1 x 128 activation groups), the activations quantized as the
layer does (in the kernel at M <= 16, ``quantize_fp8`` above), float32 outputs:

- ``rel_max``: max |y - y64| / max |y64|; ``abs_over_mag``: max |y - y64| / m, where m is
  the same product of the operands' magnitudes (sum_k |x_k w_k| with the scales): an
  error in units of the terms' size, about 2^-24 for float32 sums of exact products;
- ``test_tol_excess``: the largest amount by which the error passes the interpreter
  test's float32 tolerance (1e-5 max|ref| + eps|ref| + 1e-6; <= 0: within it);
- above M = 16 the 128-wide tiles with promote_k 0 and 32, and ``triton-bn64-promote32``
  (64 columns per tile: room for the promotion's second accumulator; 128 x 128 tiles with
  8 warps spill with it); ``is_default`` marks the variant ``choose_config`` picks
  (the first H200 run also had ``triton-bk32``, K steps of one instruction: 1.5-2.5x
  slower at M 256);
- ``graph_ms``: median time of the launch replayed in a CUDA graph (do_bench_cudagraph),
  so old vs new promotion speed comes from the same process.

The result is saved after every shape, so a timeout keeps what was measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
SMOKE = "--smoke" in sys.argv
if SMOKE:  # read when the kernels are decorated, so before their import
    os.environ["TRITON_INTERPRET"] = "1"

from kvflow.bench.machine import save_result  # noqa: E402
from kvflow.kernels.fp8_gemm import SMALL_M, choose_config, fp8_gemm, fp8_gemm_ref  # noqa: E402
from kvflow.kernels.fp8_quant import quantize_fp8_ref  # noqa: E402
from kvflow.layers.quantization.fp8 import quantize_fp8_rows  # noqa: E402
from kvflow.layers.quantization.fp8_block import quantize_fp8_blocks  # noqa: E402

SHAPES = {"o": (4096, 4096), "qkv": (4096, 6144), "down": (14336, 4096),
          "gate_up": (4096, 28672)}  # (K, N), smallest first (a timeout keeps those)
MS = (1, 8, 64, 256)
PROMOTE = (0, 32)
BLOCK = (128, 128)
DEV = "cpu" if SMOKE else "cuda"
if SMOKE:
    SHAPES = {"o": (256, 64)}
    MS = (1, 20)
    PROMOTE = (0, 32)


def _expand(scale: torch.Tensor, reps: int, size: int) -> torch.Tensor:
    return scale.repeat_interleave(reps, -1)[..., :size]


def _dequant64(xq, sx, wq, sw, block):
    """The operands as float64 (each fp8 value times its float32 scale: exact)."""
    k = xq.shape[1]
    if block is None:
        return xq.double() * sx.double()[:, None], wq.double() * sw.double()[:, None]
    r, g = block
    sw_full = _expand(sw.double().repeat_interleave(r, 0)[:wq.shape[0]], g, k)
    return xq.double() * _expand(sx.double(), g, k), wq.double() * sw_full


def _errors(y: torch.Tensor, ref64: torch.Tensor, mag64: torch.Tensor) -> dict:
    err = (y.double() - ref64).abs()
    amax = ref64.abs().max()
    tol = 1e-5 * amax + torch.finfo(torch.float32).eps * ref64.abs() + 1e-6
    return {"rel_max": float(err.max() / amax), "rel_mean": float(err.mean() / amax),
            "abs_over_mag": float((err / mag64.clamp_min(1e-30)).max()),
            "test_tol_excess": float((err - tol).max())}


def _time(fn) -> float | None:
    if SMOKE:
        return None
    from triton.testing import do_bench_cudagraph
    fn()
    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=20, return_mode="median"))


def _scaled_mm(xq, sx, wq, sw, block, fast):
    """cuBLAS: per channel always; block-wise where this torch/cuBLAS takes 1x128 and
    128x128 scales (else the row records the error)."""
    if block is None:
        return torch._scaled_mm(xq, wq.t(), scale_a=sx[:, None], scale_b=sw[None, :],
                                out_dtype=torch.float32, use_fast_accum=fast)
    # DeepSeek-style: scale_a [M, K/128] outer-dim-major, scale_b [N/128, K/128] as [K/128, N/128]
    sa = sx.t().contiguous().t()
    sb = sw.t().contiguous().t()
    try:
        return torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb.t(),
                                out_dtype=torch.float32, use_fast_accum=fast)
    except Exception:  # block scaling may take bf16 outputs only (the row says which)
        return torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb.t(),
                                out_dtype=torch.bfloat16, use_fast_accum=fast)


def emulate_wgmma(xq, sx, wq, sw, block, cfg, bits: int, fused: bool) -> torch.Tensor:
    """A model of the kernel on Hopper's FP8 tensor cores: each wgmma instruction (32 K)
    adds its exact products and the incoming accumulator after aligning them to the
    largest one's exponent and truncating to ``bits`` bits below it (toward zero); at a
    promotion (``cfg.promote_k``, else each K tile's end) the partial goes into a float32
    sum (scaled per group in block mode). ``fused``: with promote_k 0 the per-channel
    loop's ``acc += dot`` is one tensor-core accumulator over the whole split. Float64
    on the device; comparing it with the kernel's output tells the adder's width."""
    m, k = xq.shape
    n = wq.shape[0]
    x, w = xq.double(), wq.double()
    bk = cfg.block_k
    tiles = -(-k // bk)
    per_split = -(-tiles // cfg.split_k)
    pk = min(cfg.promote_k, bk)
    out = torch.zeros(m, n, dtype=torch.float64, device=xq.device)
    for s0 in range(0, tiles, per_split):
        acc = torch.zeros(m, n, dtype=torch.float64, device=xq.device)
        hw = None
        for t in range(s0, min(s0 + per_split, tiles)):
            scale = 1.0
            if block is not None:
                r = block[0]
                sw_t = sw[:, t].double().repeat_interleave(r)[:n]
                scale = sx[:, t].double()[:, None] * sw_t[None, :]
            done = 0
            for c0 in range(t * bk, min((t + 1) * bk, k), 32):
                prod = x[:, None, c0:c0 + 32] * w[None, :, c0:c0 + 32]  # [M, N, 32] exact
                big = prod.abs().amax(-1)
                if hw is not None:
                    big = torch.maximum(big, hw.abs())
                q = torch.exp2(torch.floor(torch.log2(big.clamp_min(1e-300))) - bits)[..., None]
                terms = torch.trunc(prod / q) * q
                ssum = terms.sum(-1)
                if hw is not None:
                    ssum = ssum + torch.trunc(hw / q[..., 0]) * q[..., 0]
                hw = ssum.float().double()
                done += 32
                if pk and done >= pk:
                    acc = (acc + hw * scale).float().double()
                    hw, done = None, 0
            if hw is not None and not (fused and block is None and pk == 0):
                acc = (acc + hw * scale).float().double()
                hw = None
        if hw is not None:
            acc = (acc + hw).float().double()
        out += acc
    if block is None:
        out = out * sx.double()[:, None] * sw.double()[None, :]
    return out


def fit_adder(rows, cases) -> list[dict]:
    """For each case (kernel output, operands, config): the kernel's distance to each
    model of ``emulate_wgmma`` relative to max|y64| (the smallest is the adder's width)."""
    fits = []
    for (base, y, xq, sx, wq, sw, block, cfg, ref64) in cases:
        amax = float(ref64.abs().max())
        row = {**base, "promote_k": cfg.promote_k, "split_k": cfg.split_k,
               "kernel_rel_err_vs_f64": float((y.double() - ref64).abs().max()) / amax}
        for bits in (11, 12, 13, 14, 15, 16, 24):
            for fused in ((False, True) if block is None and cfg.promote_k == 0 else (False,)):
                try:
                    e = emulate_wgmma(xq, sx, wq, sw, block, cfg, bits, fused)
                    d = float((y.double() - e).abs().max()) / amax
                except Exception as exc:
                    d = repr(exc)[:120]
                row[f"bits{bits}{'-fused' if fused else ''}"] = d
        fits.append(row)
        print("fit", json.dumps(row), flush=True)
    return fits


def run(save) -> dict:
    rows, fits = [], []
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, generator=gen, device=DEV, dtype=torch.float32).to(torch.bfloat16)
        w = w * 0.02
        layouts = {"channel": (None, *quantize_fp8_rows(w)),
                   "block": (BLOCK, *quantize_fp8_blocks(w, BLOCK))}
        del w
        for m in MS:
            x = torch.randn(m, k, generator=gen, device=DEV, dtype=torch.float32)
            x[:, 7] *= 20  # an outlier channel, as real activations have
            x = x.to(torch.bfloat16)
            for layout, (block, wq, sw) in layouts.items():
                group = None if block is None else block[1]
                xq, sx = quantize_fp8_ref(x, group)
                xd, wd = _dequant64(xq, sx, wq, sw, block)
                ref64 = xd @ wd.t()
                mag64 = xd.abs() @ wd.abs().t()
                del xd, wd
                base = {"shape": name, "k": k, "n": n, "m": m, "layout": layout}

                def record(variant, fn, extra=None, timed=True):
                    row = {**base, "variant": variant, **(extra or {})}
                    try:
                        y = fn()
                        row.update(_errors(y, ref64, mag64))
                        row["out_dtype"] = str(y.dtype)
                        row["graph_ms"] = _time(fn) if timed else None
                    except Exception as exc:  # one failing variant must not hide the others
                        row["error"] = repr(exc)[:300]
                    rows.append(row)
                    print(f"{name:8s} M={m:<4d} {layout:7s} {variant:22s} "
                          + (f"rel {row['rel_max']:.2e} /mag {row['abs_over_mag']:.2e} "
                             f"excess {row['test_tol_excess']:+.1e} "
                             f"{(row['graph_ms'] or 0) * 1e3:7.1f} us"
                             if "rel_max" in row else f"FAILED {row['error'][:100]}"),
                          flush=True)

                record("ref-fp32", lambda: fp8_gemm_ref(xq, sx, wq, sw, block, torch.float32),
                       timed=False)
                cfg0 = choose_config(m, n, k, group, x.device)  # today's default
                tiles = dataclasses.replace(cfg0, block_n=64 if m <= SMALL_M else 128)
                variants = [(f"triton-promote{pk}", dataclasses.replace(tiles, promote_k=pk))
                            for pk in PROMOTE]  # promote0: the kernel before the fix
                if m > SMALL_M:  # half the columns: room for the promotion's accumulator
                    variants.append(("triton-bn64-promote32", dataclasses.replace(
                        tiles, block_n=64, promote_k=32)))
                for variant, cfg in variants:
                    pk = cfg.promote_k
                    if m <= SMALL_M:  # what fp8_linear launches: quantized in the kernel
                        def fn(cfg=cfg, block=block, wq=wq, sw=sw):
                            return fp8_gemm(x, wq, sw, block, out_dtype=torch.float32,
                                            config=cfg)
                    else:
                        def fn(cfg=cfg, block=block, wq=wq, sw=sw, xq=xq, sx=sx):
                            return fp8_gemm(xq, wq, sw, block, x_scale=sx,
                                            out_dtype=torch.float32, config=cfg)
                    record(variant, fn, {"config": dataclasses.asdict(cfg),
                                         "is_default": cfg == cfg0})
                    # the adder's width, from the kernel
                    if name == "o" and m in (1, 8) and variant.startswith("triton-promote"):
                        try:
                            fits += fit_adder(rows, [(base, fn(), xq, sx, wq, sw, block, cfg,
                                                      ref64)])
                        except Exception as exc:
                            fits.append({**base, "promote_k": pk, "error": repr(exc)[:300]})
                if not SMOKE:
                    for fast in (False, True):
                        record("scaled_mm" + ("-fast" if fast else ""),
                               lambda fast=fast: _scaled_mm(xq, sx, wq, sw, block, fast))
        save({"rows": rows, "adder_fit": fits, "partial": True})
        del layouts
    return {"rows": rows, "adder_fit": fits}


def summary(rows) -> dict:
    """Per layout and variant: the worst rel_max / abs_over_mag over shapes and M, and
    the time of each promotion setting over the old kernel's (promote0), per M."""
    out: dict = {}
    for r in rows:
        if "rel_max" not in r:
            continue
        s = out.setdefault(r["layout"], {}).setdefault(r["variant"], {
            "rel_max": 0.0, "abs_over_mag": 0.0, "test_tol_fails": 0, "cases": 0})
        s["rel_max"] = max(s["rel_max"], r["rel_max"])
        s["abs_over_mag"] = max(s["abs_over_mag"], r["abs_over_mag"])
        s["test_tol_fails"] += r["test_tol_excess"] > 0
        s["cases"] += 1
    old = {(r["shape"], r["m"], r["layout"]): r.get("graph_ms") for r in rows
           if r["variant"] == "triton-promote0"}
    for r in rows:
        o = old.get((r["shape"], r["m"], r["layout"]))
        if r["variant"].startswith("triton-") and o and r.get("graph_ms"):
            t = out[r["layout"]][r["variant"]].setdefault("time_over_promote0_by_m", {})
            t.setdefault(str(r["m"]), []).append(round(r["graph_ms"] / o, 3))
    return out


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpreter, CPU")
    ns = p.parse_args()
    start = time.time()

    def meta(result: dict) -> dict:
        result.update({"command": "python " + " ".join(sys.argv),
                       "device": "cpu (interpreter)" if SMOKE else torch.cuda.get_device_name(),
                       "torch": torch.__version__, "seconds": time.time() - start,
                       "summary": summary(result["rows"]),
                       "timing": "do_bench_cudagraph median (graph_ms), float32 output"})
        return result

    def save(partial: dict) -> None:
        with open(ns.out, "w") as f:
            json.dump(meta(partial), f)

    result = meta(run(save))
    save_result(ns.out, result)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {ns.out} ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
