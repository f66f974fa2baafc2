"""GPU micro-benchmark of the fused MoE kernel (kvflow/kernels/fused_moe.py) against a
per-expert loop of cuBLAS GEMMs (the same routing; each active expert's rows gathered,
gate/up GEMM, SiLU-and-mul, down GEMM, weighted index_add), at M = 1..256 tokens.

Shapes: one Qwen3-30B-A3B MoE layer (E 128, top-8, hidden 2048, expert 768) and one
Mixtral-8x7B layer (E 8, top-2, hidden 4096, expert 14336), bf16, uniform random routing.

The kernel is timed the way the engine's decode runs it, inside a CUDA graph (no host
time): ``--copies`` layers' worth of expert weights (default 4) are run one after the
other in the graph, so a step reads its experts from HBM and not from the 50 MB L2, and
the time per layer is reported. Per case (row fields):

- ``graph_us``: fused_moe as the engine calls it (fast one-launch align when it fits);
  ``graph_torch_align_us``: the same with the torch align; ``align_us`` /
  ``align_torch_us``: the align alone (fast kernel, when it fits / torch);
  ``gemm_us``: the two GEMM launches alone (with the output's zero fill), so the three
  parts show where a layer's time goes; ``graph_gbs`` / ``gemm_gbs``: the bytes of the
  experts the step touches (each active expert's w13 and w2 read once) over those times;
- ``kernel_us`` (``kernel_gbs``): fused_moe timed eagerly (``triton.testing.do_bench``:
  includes the host's launch time, as in the first runs); ``loop_us``: the per-expert
  loop, eager (it syncs with the host, so it cannot be graphed); ``speedup``: loop over
  eager kernel, ``graph_speedup``: loop over graphed kernel.

``--tune``: sweep launch configurations per M (under the graph; decode, M <= 8: BLOCK_M
16 with BLOCK_N down to 16 and 2 or 4 warps) within ``--budget`` seconds and write the
fastest as the ``fused_moe`` launch rows: ``--table`` writes them as a tuning overlay
(try it with ``KVFLOW_TUNING_FILE=t.json``), ``--write-tuning`` merges them into the
GPU's data file in kvflow/kernels/tuning/ (docs/decode-gemv.md describes the files).

``--quant int4,fp8`` (any of int8, fp8, int4, int4-g64, int4-g128, int4-sym, ...:
``int4`` is kvflow's default, group 32 asymmetric) adds weight-only quantized experts
against bf16 on the ``--quant-shapes`` (default Qwen3-30B-A3B) at every M: rows with
``quant`` set, each format graphed the same way (``graph_us``, ``gemm_us``), with
``bytes`` the format's active expert bytes (scales and offsets included) and
``vs_bf16`` the bf16 time over the format's. ``--quant-only`` skips the bf16-vs-loop
rows (and --tune).

    python benchmarks/gpu/bench_moe.py --out moe-kernel-bench.json --tune --table t.json
    python benchmarks/gpu/bench_moe.py --out moe-quant-bench.json --quant int4,fp8 --quant-only
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from triton.testing import do_bench  # noqa: E402

from kvflow.bench.machine import machine_info, save_result  # noqa: E402
from kvflow.kernels import tuning  # noqa: E402
from kvflow.kernels.fused_moe import (dequantize_int4_experts, fast_align_fits,  # noqa: E402
                                      fused_moe, fused_moe_config, fused_moe_ref, moe_align,
                                      moe_align_fast, moe_gemms, pack_int4_experts)
from kvflow.layers.quantization.fp8 import quantize_fp8_rows  # noqa: E402
from kvflow.layers.quantization.packed import quantize_int4, quantize_int8  # noqa: E402
from kvflow.layers.moe.methods import routed_experts  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# decode (M <= 8): one or two rows per expert, so BLOCK_M 16 only; at M = 1 only
# 8 experts x (N / BLOCK_N) programs run, so small BLOCK_N spreads the weights over more
# SMs. Listed in the order tried (the budget may stop the sweep early).
SWEEP_DECODE = [dict(block_m=16, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
                for bn, bk, w, s in itertools.product((32, 16, 64, 128), (128, 64, 256),
                                                      (4, 2), (4, 3))]
SWEEP = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
         for bm, bn, bk, w, s in itertools.product((16, 32, 64), (64, 32, 128), (64, 128),
                                                   (4, 8), (3, 4))]


def make_weights(e, h, inter, copies, dev, dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(0)
    out = []
    for _ in range(copies):
        w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dtype, generator=g) * h ** -0.5
        w2 = torch.randn(e, h, inter, device=dev, dtype=dtype, generator=g) * inter ** -0.5
        out.append((w13, w2))
    return out


def make_routing(e, k, h, m, dev, dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(m)
    x = torch.randn(m, h, device=dev, dtype=dtype, generator=g)
    logits = torch.randn(m, e, device=dev, generator=g)
    w, ids = torch.topk(logits.softmax(-1), k, dim=-1)
    return x, w / w.sum(-1, keepdim=True), ids


def quantize_layer(w13, w2, fmt):
    """One layer's bf16 experts in ``fmt`` -> (w13, w2, fused_moe keyword arguments,
    bytes per expert, the dequantized (w13, w2) for the error check)."""
    if fmt == "bf16":
        return w13, w2, {}, (w13.numel() + w2.numel()) * 2 // w13.shape[0], (w13, w2)
    qs, kw, deq, nbytes = [], {}, [], 0
    for name, w in (("w13", w13), ("w2", w2)):
        e, n, k = w.shape
        if fmt in ("int8", "fp8"):
            q, sc = (quantize_int8 if fmt == "int8" else quantize_fp8_rows)(w.reshape(-1, k))
            q, sc = q.view(e, n, k), sc.view(e, n).float()
            kw[f"{name}_scale"] = sc
            deq.append((q.float() * sc[..., None]).to(w.dtype))
            nbytes += q.numel() + sc.numel() * 4
        else:  # int4[-gG][-sym]
            parts = fmt.split("-")
            group = next((int(p[1:]) for p in parts if p.startswith("g")), 32)
            sym = "sym" in parts
            groups = [quantize_int4(w[i], group, sym) for i in range(e)]
            q, sc, off = pack_int4_experts(
                torch.stack([g.values for g in groups]), torch.stack([g.scale for g in groups]),
                None if sym else torch.stack([g.zero for g in groups]), w.dtype)
            kw[f"{name}_scale"], kw[f"{name}_offset"], kw["w4_group"] = sc, off, group
            deq.append(dequantize_int4_experts(q, sc, off, group).to(w.dtype))
            nbytes += q.numel() + (sc.numel() + (off.numel() if off is not None else 0)) * 2
        qs.append(q)
    return qs[0], qs[1], kw, nbytes // w13.shape[0], tuple(deq)


def quant_rows(name, fmts, copies, dev):
    """bf16 and each weight-only format at every M, graphed like ``measure``."""
    e, k, h, inter = SHAPES[name]
    base = make_weights(e, h, inter, copies, dev)
    per_fmt = {f: [quantize_layer(a, b, f) for a, b in base] for f in ["bf16"] + fmts}
    rows = []
    for m in MS:
        x, w, ids = make_routing(e, k, h, m, dev)
        active = int(torch.unique(ids).numel())
        cfg = fused_moe_config(m, dev)
        align = (moe_align_fast if fast_align_fits(ids.numel(), e, dev) else moe_align)(
            ids, e, cfg["block_m"])
        bf16_us = None
        for fmt, layers in per_fmt.items():
            q13, q2, kw, per_expert, deq = layers[0]
            err = (fused_moe(x, q13, q2, w, ids, **kw).float()
                   - fused_moe_ref(x, *deq, w, ids).float()).abs().max().item()
            g_us = graph_us(lambda: [fused_moe(x, a, b, w, ids, **kv)
                                     for a, b, kv, _, _ in layers]) / len(layers)
            gemm_us = graph_us(lambda: [moe_gemms(x, a, b, w, k, align, cfg, **kv)
                                        for a, b, kv, _, _ in layers]) / len(layers)
            bf16_us = g_us if fmt == "bf16" else bf16_us
            nbytes = active * per_expert
            row = dict(shape=name, m=m, quant=fmt, active_experts=active, bytes=nbytes,
                       graph_us=g_us, graph_gbs=nbytes / g_us / 1e3, gemm_us=gemm_us,
                       vs_bf16=bf16_us / g_us, max_abs_err=err, config=cfg, copies=copies)
            rows.append(row)
            print(f"{name:14s} M={m:4d} {fmt:10s} graph {g_us:7.1f} us ({row['graph_gbs']:5.0f}"
                  f" GB/s) gemms {gemm_us:7.1f}  x{row['vs_bf16']:.2f} vs bf16  err {err:.1e}",
                  flush=True)
    return rows


def _mlp(r, w13, w2):
    gate, up = F.linear(r, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def loop(x, w13, w2, w, ids):
    """The per-expert cuBLAS loop (kvflow's CPU path, run on the GPU)."""
    return routed_experts(x, w, ids, w13.shape[0], lambda e, r: _mlp(r, w13[e], w2[e]))


def graph_us(fn, calls: int = 10, replays: int = 5) -> float:
    """Median time of one ``fn()`` in microseconds, replayed from a CUDA graph holding
    ``calls`` calls (the first call, on a side stream, compiles and warms up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del g
    return sorted(times)[len(times) // 2]


def per_layer(layers, fn):
    """fn(w13, w2) over every weight copy in turn: one call = len(layers) layers."""
    def run():
        for w13, w2 in layers:
            fn(w13, w2)
    return run


def measure(layers, x, w, ids, cfg=None, fast=None, calls=10, replays=5):
    """Graphed fused_moe time per layer (us)."""
    n = len(layers)
    return graph_us(per_layer(layers, lambda a, b: fused_moe(x, a, b, w, ids, config=cfg,
                                                             fast_align=fast)),
                    calls, replays) / n


def tune(layers, x, w, ids, m, default_us, default_cfg, deadline):
    """The fastest config for this M found before ``deadline`` (time.monotonic())."""
    best = (default_us, default_cfg)
    tried = 0
    for cfg in (SWEEP_DECODE if m <= 8 else sorted(
            SWEEP, key=lambda c: abs(math.log2(c["block_m"]) - math.log2(default_cfg["block_m"])))):
        if time.monotonic() > deadline:
            break
        try:
            t = measure(layers, x, w, ids, cfg, calls=5, replays=3)
        except Exception as exc:  # out of shared memory, etc.
            print("skip", cfg, type(exc).__name__, flush=True)
            torch.cuda.synchronize()
            continue
        tried += 1
        if t < best[0]:
            best = (t, cfg)
    return best, tried


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--table", help="write the tuned launch rows here as a tuning overlay "
                    "(with --tune)")
    ap.add_argument("--write-tuning", metavar="PATH",
                    help="merge the tuned launch rows into this tuning data file, e.g. "
                         "kvflow/kernels/tuning/h100.json (with --tune)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tune-shapes", default="qwen3-30b-a3b",
                    help="shapes the sweep runs on (the table takes the first one's)")
    ap.add_argument("--budget", type=float, default=80.0,
                    help="seconds for the whole --tune sweep (compiles included); decode "
                         "M's get twice the share of the others")
    ap.add_argument("--copies", type=int, default=4,
                    help="layers of expert weights run in turn inside the graph")
    ap.add_argument("--quant", default="",
                    help="weight-only expert formats timed against bf16, e.g. int4,fp8 "
                         "(int8, fp8, int4, int4-g128, int4-sym, ...)")
    ap.add_argument("--quant-shapes", default="qwen3-30b-a3b")
    ap.add_argument("--quant-only", action="store_true",
                    help="only the --quant rows (no bf16-vs-loop rows, no --tune)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows, tuned = [], {}
    tune_shapes = [s for s in args.tune_shapes.split(",") if s in args.shapes.split(",")]
    shares = {m: (2.0 if m <= 8 else 1.0) for m in MS}
    tune_total = sum(shares.values()) * len(tune_shapes)
    budget_left, share_left = args.budget, tune_total
    for name in ([] if args.quant_only else args.shapes.split(",")):
        e, k, h, inter = SHAPES[name]
        layers = make_weights(e, h, inter, args.copies, dev)
        w13, w2 = layers[0]
        for m in MS:
            x, w, ids = make_routing(e, k, h, m, dev)
            active = int(torch.unique(ids).numel())
            nbytes = active * 3 * h * inter * 2
            err = (fused_moe(x, w13, w2, w, ids).float()
                   - fused_moe_ref(x, w13, w2, w, ids).float()).abs().max().item()
            cfg = fused_moe_config(m, dev)
            fits = fast_align_fits(ids.numel(), e, dev)
            t_kernel = do_bench(lambda: fused_moe(x, w13, w2, w, ids)) * 1e-3
            t_loop = do_bench(lambda: loop(x, w13, w2, w, ids)) * 1e-3
            g_us = measure(layers, x, w, ids)
            g_torch_us = measure(layers, x, w, ids, fast=False) if fits else g_us
            align_torch_us = graph_us(lambda: moe_align(ids, e, cfg["block_m"]), 20)
            align_us = (graph_us(lambda: moe_align_fast(ids, e, cfg["block_m"]), 20)
                        if fits else align_torch_us)
            align = (moe_align_fast if fits else moe_align)(ids, e, cfg["block_m"])
            gemm_us = graph_us(per_layer(layers, lambda a, b: moe_gemms(
                x, a, b, w, k, align, cfg))) / len(layers)
            row = dict(shape=name, m=m, active_experts=active, bytes=nbytes,
                       kernel_us=t_kernel * 1e6, loop_us=t_loop * 1e6,
                       speedup=t_loop / t_kernel, kernel_gbs=nbytes / t_kernel / 1e9,
                       loop_gbs=nbytes / t_loop / 1e9, max_abs_err=err, config=cfg,
                       graph_us=g_us, graph_gbs=nbytes / g_us / 1e3,
                       graph_speedup=t_loop * 1e6 / g_us, fast_align=fits,
                       graph_torch_align_us=g_torch_us, align_us=align_us,
                       align_torch_us=align_torch_us, gemm_us=gemm_us,
                       gemm_gbs=nbytes / gemm_us / 1e3, copies=args.copies)
            if args.tune and name in tune_shapes:
                allot = budget_left * shares[m] / share_left
                t0 = time.monotonic()
                best, tried = tune(layers, x, w, ids, m, g_us, cfg, t0 + allot)
                spent = time.monotonic() - t0
                budget_left, share_left = budget_left - spent, share_left - shares[m]
                row["tuned_us"], row["tuned_config"] = best[0], best[1]
                row["tuned_gbs"], row["tuned_tried"] = nbytes / best[0] / 1e3, tried
                tuned.setdefault(m, []).append(best)
            rows.append(row)
            print(f"{name:14s} M={m:4d} experts={active:3d} graph {g_us:7.1f} us "
                  f"({row['graph_gbs']:5.0f} GB/s) = align {align_us:5.1f} "
                  f"(torch {align_torch_us:5.1f}) + gemms {gemm_us:7.1f}; torch-align "
                  f"{g_torch_us:7.1f}; eager {row['kernel_us']:7.1f}  loop "
                  f"{row['loop_us']:8.1f}  err {err:.1e}"
                  + (f"  tuned {row['tuned_us']:.1f} us ({row['tuned_tried']} tried) "
                     f"{row['tuned_config']}" if "tuned_us" in row else ""), flush=True)
    fmts = [f for f in args.quant.split(",") if f and f != "bf16"]
    for name in (args.quant_shapes.split(",") if fmts else []):
        rows += quant_rows(name, fmts, args.copies, dev)
    result = dict(command="python " + " ".join(sys.argv), machine=machine_info(),
                  device=torch.cuda.get_device_name(dev), rows=rows)
    save_result(args.out, result)
    if args.tune and tuned and (args.table or args.write_tuning):
        # per M, the config that won for the first tuned shape (Qwen3-30B-A3B: the target)
        configs = [dict(max_tokens=m, **{k: v for k, v in best[0][1].items()
                                          if k != "max_tokens"})
                   for m, best in sorted(tuned.items())]
        configs[-1]["max_tokens"] = 1_000_000_000
        name = torch.cuda.get_device_name(dev)
        if args.table:
            with open(args.table, "w") as f:
                f.write(tuning.dumps(dict(device=name, fused_moe=configs)))
        if args.write_tuning:
            tuning.write_rows(args.write_tuning, tuning.match_token(name), "fused_moe",
                              configs, args.out)


if __name__ == "__main__":
    main()
