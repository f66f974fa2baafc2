"""GPU micro-benchmark of the FP8 decode linears at Llama-3.1-8B's shapes: the W8A8 GEMV on
the FP8 tensor cores (``kvflow/kernels/gemv_fp8.py``, activations quantized per token)
against the weight-dequant GEMV (``gemv_w8.py``, bf16 activations, the path FP8 layers
took at M <= 8 before) and bf16 cuBLAS, plus the launches that feed it (the norm with
FP8 output, ``quantize_fp8``).

    python benchmarks/gpu/bench_fp8_gemv.py --out $OUT/fp8-gemv-bench.json [--budget-s 150]

Per (shape, M): bf16 ``F.linear`` (and + ``silu_and_mul`` for the SiLU form); the
weight-dequant GEMV at its table config (``woq_gemv_config.plan('fp8' | 'fp8-silu')``);
the W8A8 GEMV at a sweep of tiles x split-K (``--budget-s`` shared by the cases, M = 1
first), alone and with the ``quantize_fp8`` launch in front (what a layer whose input
comes from no norm pays); the best config's error against ``gemv_fp8_ref`` and, for
``promote`` 0 / 128 / 64 / 32, against the exact float64 product. Each time is the median
per launch over one CUDA graph of launches over weight copies > 4x the L2.
``table``: per case the best W8A8 config (the rows of the ``woq_gemv`` tuning data,
format ``fp8a8`` / ``fp8a8-silu``).

``--configs`` replaces the W8A8 sweep (not ``--chain``'s): each case times the table's
config in force for it and exactly the configs given, with no budget cut:
``BN:BK:SPLIT:WARPS:STAGES[:PROMOTE[:ROWS]]`` (PROMOTE: inputs per float32 promotion, 0
or a power of two from 16 to BK, default 0 as the sweep's; ROWS: output rows per
program, ``WoqGemvConfig.rows``, a grid balanced over the SMs); ``--shapes`` picks the
shapes (a ROWS suits one N).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from kvflow.bench.machine import save_result  # noqa: E402
from kvflow.kernels.fp8_quant import quantize_fp8, quantize_fp8_ref  # noqa: E402
from kvflow.kernels.gemv_fp8 import gemv_fp8, gemv_fp8_ref  # noqa: E402
from kvflow.kernels.gemv_w8 import gemv_w8  # noqa: E402
from kvflow.kernels.rms_norm import fused_add_rms_norm, rms_norm_fp8  # noqa: E402
from kvflow.kernels.silu_and_mul import silu_and_mul  # noqa: E402
from kvflow.kernels.woq_gemv_config import (WoqGemvConfig, _bucket,  # noqa: E402
                                            _device_table, default_config, plan)
from graph_timing import graph_ms  # noqa: E402  (this folder)

L2_BYTES = 50 * 2**20
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
          ("gate_up_silu", 4096, 28672), ("down", 14336, 4096)]  # (name, K, N rows)
DT = torch.bfloat16


def _grid(n: int, k: int, sms: int, silu: bool) -> list[WoqGemvConfig]:
    tiles = [(bn, bk, 4, st) for bn, bk, st in itertools.product(
        (64, 128), (256, 512, 128), (4, 3, 6))]
    if silu:
        tiles = [t for t in tiles if t[0] * t[1] <= 64 * 256]
    out = []
    for bn, bk, w, st in tiles:
        if bn * bk * st > 200 * 1024 // (2 if silu else 1):  # shared memory of the stages
            continue
        nt, kt = -(-n // bn), -(-k // bk)
        for split in (1, 2, 3, 4, 6, 8):
            if split > 1 and split > kt // 2:
                continue
            if not sms // 2 <= nt * split <= 8 * sms and not (split == 1 and nt > sms):
                continue
            out.append(WoqGemvConfig(bn, bk, split, w, st))
    return out


def _parse_config(text: str) -> WoqGemvConfig:
    """BN:BK:SPLIT:WARPS:STAGES[:PROMOTE[:ROWS]] -> a WoqGemvConfig for ``gemv_fp8``
    (PROMOTE 0 or a power of two from 16 to BK, so a ROWS written after STAGES alone is
    an error, not a PROMOTE)."""
    f = [int(v) for v in text.split(":")]
    promote = f[5] if len(f) > 5 else 0
    if len(f) not in (5, 6, 7) or (promote and (promote & (promote - 1)
                                                or not 16 <= promote <= f[1])):
        raise ValueError(f"config {text!r}: BN:BK:SPLIT:WARPS:STAGES[:PROMOTE[:ROWS]] "
                         "(PROMOTE: 0 or a power of two from 16 to BK)")
    return WoqGemvConfig(*f[:5], promote=promote, rows=f[6] if len(f) > 6 else 0)


def _table_config(fmt: str, n: int, k: int, m: int) -> WoqGemvConfig | None:
    """The config the table in force (the GPU's tuning data, ``KVFLOW_TUNING_FILE``) has for this
    case, or None (not measured, or measured slower than the weight-dequant GEMV)."""
    from kvflow import envs

    table = _device_table(torch.cuda.get_device_name(), envs.tuning_file())
    return table.get((fmt, n, k), {}).get(_bucket(m))


def bench(budget_s: float, ms: tuple[int, ...], shapes: set[str] | None = None,
          configs: list[WoqGemvConfig] | None = None) -> dict:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, table, errors = [], [], []
    cases = [(s, m) for m in ms for s in SHAPES if not shapes or s[0] in shapes]
    end = time.time() + budget_s
    for i, ((name, k, n_w), m) in enumerate(cases):
        silu = name.endswith("_silu")
        n = n_w // 2 if silu else n_w
        copies = max(1, min(8, -(-4 * L2_BYTES // (n_w * k))))
        wts = []
        for _ in range(copies):
            w = torch.randn(n_w, k, device="cuda")
            wts.append(quantize_fp8_ref(w))
            del w
        x = torch.randn(m, k, dtype=DT, device="cuda")
        xq, sx = quantize_fp8(x)
        wbytes = n_w * k + 4 * n_w
        case = {"shape": name, "k": k, "n": n, "m": m, "weight_bytes": wbytes}
        bcopies = max(1, min(8, -(-4 * L2_BYTES // (n_w * k * 2))))
        bw = [torch.randn(n_w, k, dtype=DT, device="cuda") for _ in range(bcopies)]
        f = (lambda w: silu_and_mul(F.linear(x, w))) if silu else (lambda w: F.linear(x, w))
        bf16_ms = graph_ms([lambda w=w: f(w) for w in bw])
        del bw
        rows.append({**case, "impl": "bf16-cublas", "ms": bf16_ms,
                     "gb_per_s": 2 * n_w * k / bf16_ms / 1e6})
        fmt = "fp8-silu" if silu else "fp8"
        wcfg = plan(fmt, n, k, x.device).get(m) or default_config(fmt, m, n, k, x.device)
        w8_ms = graph_ms([lambda wt=wt: gemv_w8(x, wt[0], wt[1], wcfg, silu_and_mul=silu)
                          for wt in wts])
        rows.append({**case, "impl": "w8-dequant", "config": wcfg.as_dict(), "ms": w8_ms,
                     "gb_per_s": wbytes / w8_ms / 1e6, "speedup_vs_bf16": bf16_ms / w8_ms})
        own = None
        if configs:  # a given list: the table's and these, all timed
            own = _table_config("fp8a8-silu" if silu else "fp8a8", n, k, m)
            grid = list(dict.fromkeys(c for c in [own, *configs] if c is not None))
        else:
            grid = _grid(n, k, sms, silu)
        deadline = time.time() + max(0.0, end - time.time()) / (len(cases) - i)
        best = None
        for j, cfg in enumerate(grid):
            if j and time.time() > deadline and not configs:
                break
            try:
                t = graph_ms([lambda wt=wt: gemv_fp8(xq, sx, wt[0], wt[1], cfg,
                                                     silu_and_mul=silu) for wt in wts])
            except Exception as exc:  # a tile that does not fit this GPU
                rows.append({**case, "impl": "w8a8", "config": cfg.as_dict(),
                             "error": repr(exc)[:160]})
                continue
            rows.append({**case, "impl": "w8a8", "config": cfg.as_dict(), "ms": t,
                         "gb_per_s": wbytes / t / 1e6,
                         **({"table": True} if own is not None and cfg == own else {})})
            if best is None or t < best[1]:
                best = (cfg, t)
        cfg, t = best
        tq = graph_ms([lambda wt=wt: gemv_fp8(*quantize_fp8(x), wt[0], wt[1], cfg,
                                              silu_and_mul=silu) for wt in wts])
        y = gemv_fp8(xq, sx, wts[0][0], wts[0][1], cfg, silu_and_mul=silu).float()
        r = gemv_fp8_ref(xq, sx, wts[0][0], wts[0][1], DT).float()
        if silu:
            r = F.silu(r[:, :n]) * r[:, n:]
        exact = (xq.double() @ wts[0][0].double().t()) * wts[0][1].double() * sx.double()[:, None]
        prec = {}
        if not silu:
            for p in (0, 128, 64, 32):
                c = dataclasses.replace(cfg, promote=min(p, cfg.block_k) if p else 0)
                yy = gemv_fp8(xq, sx, wts[0][0], wts[0][1], c, out_dtype=torch.float32)
                tp = graph_ms([lambda wt=wt: gemv_fp8(xq, sx, wt[0], wt[1], c)
                               for wt in wts])
                prec[str(p)] = {"max_rel_err": float(((yy.double() - exact).abs().max()
                                                      / exact.abs().max())), "ms": tp}
        summary = {**case, "best_w8a8": cfg.as_dict(), "w8a8_ms": t, "w8a8_quant_ms": tq,
                   "w8_dequant_ms": w8_ms, "bf16_ms": bf16_ms,
                   "w8a8_gb_per_s": wbytes / t / 1e6,
                   "w8a8_over_dequant": w8_ms / t, "w8a8_quant_over_dequant": w8_ms / tq,
                   "w8a8_over_bf16": bf16_ms / t,
                   "max_abs_err_vs_ref": float((y - r).abs().max()),
                   "ref_max": float(r.abs().max()), "promote": prec,
                   "configs_tried": sum(1 for rr in rows if rr["impl"] == "w8a8"
                                        and rr["shape"] == name and rr["m"] == m)}
        table.append({"format": "fp8a8-silu" if silu else "fp8a8", "n": n, "k": k, "m": m,
                      "config": cfg.as_dict()})
        errors.append(summary)
        print(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v)
                          for kk, v in summary.items() if kk != "promote"}), flush=True)
        print("  promote:", {p: (round(v["max_rel_err"], 6), round(v["ms"] * 1e3, 1))
                             for p, v in prec.items()}, flush=True)
        del wts
        torch.cuda.empty_cache()
    # the launches in front of the GEMV at batch 1 and 8
    launches = []
    for m in ms:
        for k in (4096, 14336):
            x = torch.randn(m, k, dtype=DT, device="cuda")
            launches.append({"launch": "quantize_fp8", "m": m, "k": k,
                             "ms": graph_ms([lambda: quantize_fp8(x)] * 8)})
        x = torch.randn(m, 4096, dtype=DT, device="cuda")
        res = torch.randn(m, 4096, dtype=DT, device="cuda")
        wn = torch.randn(4096, dtype=DT, device="cuda")
        launches.append({"launch": "fused_add_rms_norm", "m": m, "k": 4096,
                         "ms": graph_ms([lambda: fused_add_rms_norm(x, res, wn, 1e-5)] * 8)})
        launches.append({"launch": "rms_norm_fp8 (add + norm + quantize)", "m": m, "k": 4096,
                         "ms": graph_ms([lambda: rms_norm_fp8(x, res, wn, 1e-5)] * 8)})
    for row in launches:
        print(json.dumps(row), flush=True)
    return {"rows": rows, "summary": errors, "table": table, "launches": launches}


def bench_chain(budget_s: float, ms: tuple[int, ...]) -> dict:
    """The gated MLP's FP8 chain at 8B shape: gate/up + SiLU writing FP8 in 128-wide
    groups (``siluq``: 128-row tiles, no split-K) and down reading them (``xg``: 128-input
    K steps), each over a small sweep, against the per-token pair it replaces (gate/up +
    SiLU in bf16, the quantize launch, down) at the table's configs."""
    from kvflow.kernels.woq_gemv_config import plan as woq_plan

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = torch.device("cuda")
    d, k = 14336, 4096
    out = {"rows": [], "table": [], "summary": []}
    end = time.time() + budget_s
    gu = [quantize_fp8_ref(torch.randn(2 * d, k, device="cuda")) for _ in range(2)]
    dn = [quantize_fp8_ref(torch.randn(k, d, device="cuda")) for _ in range(4)]
    for i, m in enumerate(ms):
        x = torch.randn(m, k, dtype=DT, device="cuda")
        xq, sx = quantize_fp8(x)
        deadline = time.time() + max(0.0, end - time.time()) / (len(ms) - i)
        best = {}
        sq = [WoqGemvConfig(128, bk, 1, w, st, promote=128) for bk, w, st in
              itertools.product((128, 256), (4, 8), (4, 3, 6)) if 128 * bk * st <= 100 * 1024]
        xg = [WoqGemvConfig(bn, 128, sp, 4, st) for bn, st, sp in itertools.product(
            (64, 128), (6, 4, 3), (1, 2, 3, 4, 6, 8)) if sms // 2 <= (k // bn) * sp <= 8 * sms]
        hq, hs = gemv_fp8(xq, sx, gu[0][0], gu[0][1], sq[0], silu_and_mul=True, fp8_out=True)
        for form, grid in (("siluq", sq), ("xg", xg)):
            for j, cfg in enumerate(grid):
                if j and time.time() > deadline:
                    break
                if form == "siluq":
                    fns = [lambda wt=wt, c=cfg: gemv_fp8(xq, sx, wt[0], wt[1], c,
                                                         silu_and_mul=True, fp8_out=True)
                           for wt in gu]
                else:
                    fns = [lambda wt=wt, c=cfg: gemv_fp8(hq, hs, wt[0], wt[1], c) for wt in dn]
                try:
                    t = graph_ms(fns)
                except Exception as exc:
                    out["rows"].append({"form": form, "m": m, "config": cfg.as_dict(),
                                        "error": repr(exc)[:160]})
                    continue
                out["rows"].append({"form": form, "m": m, "config": cfg.as_dict(), "ms": t})
                if form not in best or t < best[form][1]:
                    best[form] = (cfg, t)
        # the pair it replaces, at the table's configs
        scfg = woq_plan("fp8a8-silu", d, k, dev).get(m) or default_config("fp8a8-silu", m, d,
                                                                            k, dev)
        dcfg = woq_plan("fp8a8", k, d, dev).get(m) or default_config("fp8a8", m, k, d, dev)
        t_gu = graph_ms([lambda wt=wt: gemv_fp8(xq, sx, wt[0], wt[1], scfg, silu_and_mul=True)
                         for wt in gu])
        h = gemv_fp8(xq, sx, gu[0][0], gu[0][1], scfg, silu_and_mul=True)
        t_q = graph_ms([lambda: quantize_fp8(h)] * 4)
        hq1, hs1 = quantize_fp8(h)
        t_dn = graph_ms([lambda wt=wt: gemv_fp8(hq1, hs1, wt[0], wt[1], dcfg) for wt in dn])
        summ = {"m": m, "siluq": best["siluq"][0].as_dict(), "siluq_ms": best["siluq"][1],
                "xg": best["xg"][0].as_dict(), "xg_ms": best["xg"][1],
                "chain_ms": best["siluq"][1] + best["xg"][1],
                "pair_ms": {"gate_up_silu": t_gu, "quantize": t_q, "down": t_dn,
                            "total": t_gu + t_q + t_dn}}
        out["summary"].append(summ)
        out["table"] += [{"format": "fp8a8-siluq", "n": d, "k": k, "m": m,
                          "config": best["siluq"][0].as_dict()},
                         {"format": "fp8a8-xg", "n": k, "k": d, "m": m,
                          "config": best["xg"][0].as_dict()}]
        print(json.dumps({kk: (round(v * 1e3, 1) if isinstance(v, float) else v)
                          for kk, v in summ.items() if kk != "pair_ms"}),
              {kk: round(v * 1e3, 1) for kk, v in summ["pair_ms"].items()}, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--chain", action="store_true",
                    help="only the gated MLP's FP8 chain (bench_chain)")
    ap.add_argument("--shapes", default="",
                    help="only these shapes (comma-separated: " + ", ".join(
                        s[0] for s in SHAPES) + ")")
    ap.add_argument("--configs", default="",
                    help="time exactly these W8A8 configurations (and the table's) instead "
                         "of the sweep: BN:BK:SPLIT:WARPS:STAGES[:PROMOTE[:ROWS]],... "
                         "(PROMOTE: 0 or a power of two <= BK; ROWS: output rows per "
                         "program, WoqGemvConfig.rows); not with --chain")
    ap.add_argument("--write-tuning", default=None, metavar="FILE",
                    help="merge the measured table into this tuning data file "
                         "(kvflow/kernels/tuning/<gpu>.json; created if missing)")
    args = ap.parse_args()
    try:
        configs = [_parse_config(c) for c in args.configs.split(",") if c] or None
    except ValueError as exc:  # a malformed field or rows > BN
        ap.error(str(exc))
    if args.chain and (configs or args.shapes):
        ap.error("--configs and --shapes are for the per-shape sweep, not --chain")
    ms = tuple(int(v) for v in args.ms.split(","))
    res = (bench_chain(args.budget_s, ms) if args.chain else
           bench(args.budget_s, ms, set(args.shapes.split(",")) if args.shapes else None,
                 configs))
    save_result(args.out, {"command": "python benchmarks/gpu/bench_fp8_gemv.py " + " ".join(
        sys.argv[1:]), **res, "timing": "one CUDA graph over weight copies > 4x L2, "
        "median per launch"})
    if args.write_tuning:
        from kvflow.kernels import tuning

        tuning.write_bench(args.write_tuning, res, os.path.relpath(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
