"""GPU micro-benchmark of the low-bit decode GEMVs (``kvflow/kernels/gemv_w4.py``: int4
group 128; ``gemv_w8.py``: int8 and FP8 per channel) at Llama-3.1-8B's linear shapes, M =
1, 2, 4, 8, against bf16 cuBLAS and each format's previous path.

    python benchmarks/gpu/bench_woq_gemv.py --out $OUT/woq-gemv-bench.json [--budget-s 60]

Per (shape, M, format): bf16 ``F.linear``; the previous path (int4: ``w4a16_gemm``'s
register GEMV, int8: ``w8a16_gemm``, FP8: the one-launch activation quantization +
``torch._scaled_mm``); the new kernel at its heuristic config and at the configs of a
small sweep (tiles x split-K, the heuristic's tile first; the budget is shared by the
cases, batch 1 weighted 6x; ``--other-m-share``). Each time is the median per launch over a CUDA graph of
launches over several weight copies (> 4x the 50 MB L2, so the weights come from HBM),
as GB/s of the bytes the launch must move and as a fraction of the H200's 4.8 TB/s (4.2
measured by a read). ``table`` has per case the best config when it beat the previous
path by >= 2 % (else None): ``--write-tuning kvflow/kernels/tuning/<gpu>.json`` merges it
into the GPU's tuning data, ``KVFLOW_TUNING_FILE=<this file>`` tries it as it is.

``--configs`` replaces the sweep: each case times the heuristic, the table's config in
force for it (``woq_gemv_config``'s, with ``KVFLOW_TUNING_FILE``) and exactly the
configs given, with no budget cut: ``BN:BK:SPLIT:WARPS:STAGES[:DEQ:XA[:ROWS]]`` (DEQ,
XA 0 or 1; ROWS: output rows per program, ``WoqGemvConfig.rows``, a grid balanced over
the SMs); ``--shapes`` picks the shapes (a ROWS suits one N).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from kvflow.bench.machine import save_result  # noqa: E402
from kvflow.kernels import tuning  # noqa: E402
from kvflow.kernels.gemv_w4 import gemv_w4, gemv_w4_ref  # noqa: E402
from kvflow.kernels.gemv_w8 import gemv_w8, gemv_w8_ref  # noqa: E402
from kvflow.kernels.int4_layout import pack_int4  # noqa: E402
from kvflow.kernels.w4a16_gemm import w4a16_gemm  # noqa: E402
from kvflow.kernels.w8a16_gemm import w8a16_gemm  # noqa: E402
from kvflow.kernels.woq_gemv_config import (WoqGemvConfig, _bucket,  # noqa: E402
                                            _device_table, default_config)
from graph_timing import graph_ms  # noqa: E402  (this folder)

HBM = 4.8e12
L2_BYTES = 50 * 2**20
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
          ("gate_up_silu", 4096, 28672), ("down", 14336, 4096),
          ("lm_head", 4096, 128256)]  # (name, K, N); gate_up_silu: + SiLU-and-multiply
FORMATS = ("w4g128", "fp8", "int8")
DT = torch.bfloat16


def _weights(fmt: str, n: int, k: int):
    """One copy of the format's weight tensors and their bytes."""
    if fmt == "w4g128":
        qw = pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda"))
        s = (torch.rand(n, k // 128, device="cuda") * 0.01 + 1e-3).to(DT)
        b = (torch.randn(n, k // 128, device="cuda") * 0.01).to(DT)
        return (qw, s, b), qw.nbytes + s.nbytes + b.nbytes
    w = torch.randn(n, k, device="cuda")
    s = w.abs().amax(1) / (448.0 if fmt == "fp8" else 127.0)
    q = w / s[:, None]
    q = q.to(torch.float8_e4m3fn) if fmt == "fp8" else q.round().clamp(-127, 127).to(torch.int8)
    return (q, s.float()), q.nbytes + s.nbytes


def _previous(fmt: str, x, wt, silu: bool = False):
    if silu:  # the unfused path: the GEMM, then the silu_and_mul kernel
        from kvflow.kernels.silu_and_mul import silu_and_mul

        return silu_and_mul(_previous(fmt, x, wt))
    if fmt == "w4g128":
        return w4a16_gemm(x, *wt, 128)
    if fmt == "int8":
        return w8a16_gemm(x, wt[0], wt[1], None, None)
    from kvflow.kernels.fp8_quant import quantize_fp8
    from kvflow.layers.quantization.fp8 import fp8_mm

    xq, sx = quantize_fp8(x)
    return fp8_mm(xq, sx, wt[0], wt[1], x.dtype)


def _ours(fmt: str, x, wt, cfg, silu: bool = False):
    if fmt == "w4g128":
        return gemv_w4(x, *wt, 128, cfg, silu_and_mul=silu)
    return gemv_w8(x, wt[0], wt[1], cfg, silu_and_mul=silu)


def _ref(fmt: str, x, wt, silu: bool = False):
    y = gemv_w4_ref(x, *wt, 128) if fmt == "w4g128" else gemv_w8_ref(x, *wt)
    if silu:
        d = y.shape[1] // 2
        y = F.silu(y[:, :d]) * y[:, d:]
    return y


def _grid(fmt: str, m: int, n: int, k: int, sms: int) -> list[WoqGemvConfig]:
    """The heuristic first, then tiles x splits that give between 1/2 and 8 programs
    per SM (the heuristic's tile first). ``fmt`` ending in -silu: n = d."""
    base = default_config(fmt, m, n, k, torch.device("cuda"))
    if fmt.endswith("-silu"):  # two accumulators: the smaller tiles
        if fmt.startswith("w4"):
            tiles = [(bn, 256, w, st, deq, False) for bn, w, st, deq in (
                (64, 4, 3, False), (64, 4, 3, True), (64, 4, 2, True), (32, 2, 3, False),
                (32, 2, 3, True))]
        else:
            tiles = [(64, 128, 4, 3, False, False), (64, 128, 4, 4, False, True),
                     (32, 128, 2, 4, False, True), (64, 256, 4, 3, False, True)]
    elif fmt == "w4g128":
        # BN 64 / 128: wgmma (the word tile is the warpgroup's operand); BN 32: mma.sync
        # (in the order tried: the mma.sync tiles, which the first H200 sweep lacked, first)
        # and two 8-warp tiles (two warpgroups: more warps to hide the wgmma waits)
        tiles = [(32, 256, 2, 3, True, False), (128, 256, 8, 3, True, False),
                 (32, 256, 2, 3, False, False), (128, 256, 8, 3, False, False),
                 (32, 256, 1, 3, True, False), (32, 256, 4, 3, True, False),
                 (32, 256, 2, 4, True, False)] + [
            (bn, 256, 4, st, deq, False) for bn, st, deq in itertools.product(
                (64, 128), (3, 4, 2), (True, False))]
    else:
        # weight first (wgmma at BN >= 64) or x first (xa: mma.sync, the old w8a16 form)
        tiles = [(bn, bk, 4, st, False, xa) for xa, bn, bk, st in itertools.product(
            (True, False), (64, 128), (256, 128), (4, 3))] + [
            (32, 256, 2, 4, False, True), (64, 512, 4, 3, False, True),
            (128, 256, 8, 3, False, False)]
    out = [base]
    for bn, bk, w, st, deq, xa in tiles:
        nt, kt = -(-n // bn), -(-k // bk)
        for split in (1, 2, 3, 4, 6, 8, 12, 16):
            if split > 1 and (split > kt // 2 or nt > 4096):
                continue
            if not sms // 2 <= nt * split <= 8 * sms and not (split == 1 and nt > sms):
                continue
            out.append(WoqGemvConfig(bn, bk, split, w, st, deq, xa))
    return list(dict.fromkeys(out))


def _parse_config(text: str) -> WoqGemvConfig:
    """BN:BK:SPLIT:WARPS:STAGES[:DEQ:XA[:ROWS]] -> a WoqGemvConfig (DEQ, XA: 0 or 1, so
    a ROWS written after STAGES alone is an error, not a DEQ)."""
    f = [int(v) for v in text.split(":")]
    if len(f) not in (5, 7, 8) or any(v not in (0, 1) for v in f[5:7]):
        raise ValueError(f"config {text!r}: BN:BK:SPLIT:WARPS:STAGES[:DEQ:XA[:ROWS]] "
                         "(DEQ, XA: 0 or 1)")
    return WoqGemvConfig(*f[:5], deq=len(f) > 5 and bool(f[5]), xa=len(f) > 6 and bool(f[6]),
                         rows=f[7] if len(f) > 7 else 0)


def _table_config(kfmt: str, n: int, k: int, m: int) -> WoqGemvConfig | None:
    """The config the table in force (the GPU's tuning data, ``KVFLOW_TUNING_FILE``) has for this
    case, or None."""
    from kvflow import envs

    table = _device_table(torch.cuda.get_device_name(), envs.tuning_file())
    return table.get((kfmt, n, k), {}).get(_bucket(m))


def bench(budget_s: float, ms: tuple[int, ...], formats: tuple[str, ...],
          other: float = 1 / 6, shapes: set[str] | None = None,
          configs: list[WoqGemvConfig] | None = None) -> dict:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, sweeps, table = [], [], []
    # lm_head: int4 and int8 models keep it int8 per channel, fp8 ones in bf16
    cases = [(shape, m, fmt) for m in ms for shape in SHAPES for fmt in formats
             if (shape[0] != "lm_head" or fmt == "int8") and (not shapes or shape[0] in shapes)]
    # batch 1 is the target: an M > 1 case gets ``other`` times an M = 1 case's share of
    # the sweep (0: its heuristic config alone)
    weight = lambda m: 1.0 if m == 1 else other  # noqa: E731
    left = sum(weight(m) for _, m, _ in cases) or 1.0
    end = time.time() + budget_s
    cache: dict = {}
    for (name, k, n_w), m, fmt in cases:
        silu = name.endswith("_silu")
        n = n_w // 2 if silu else n_w  # the output width
        kfmt = fmt + "-silu" if silu else fmt  # the table's and the heuristic's key
        share = weight(m) / left if left > 0 else 0.0
        left -= weight(m)
        deadline = time.time() + max(0.0, end - time.time()) * share
        key = (n_w, k, fmt)
        if key not in cache:  # weight copies of this shape and format (> 4x L2 in all)
            cache.clear()
            torch.cuda.empty_cache()
            one, wbytes = _weights(fmt, n_w, k)
            copies = max(1, min(8, -(-4 * L2_BYTES // wbytes)))
            cache[key] = ([one] + [_weights(fmt, n_w, k)[0] for _ in range(copies - 1)],
                          wbytes)
        wts, wbytes = cache[key]
        x = torch.randn(m, k, dtype=DT, device="cuda")
        total = wbytes + x.nbytes + m * n * 2  # the whole weight (both halves with silu)
        case = {"shape": name, "format": fmt, "k": k, "n": n, "m": m, "bytes": total}  # n: out
        # bf16 cuBLAS over enough copies to leave L2 too
        bcopies = max(1, min(8, -(-4 * L2_BYTES // (n_w * k * 2))))
        bw = [torch.randn(n_w, k, dtype=DT, device="cuda") for _ in range(bcopies)]
        if silu:
            from kvflow.kernels.silu_and_mul import silu_and_mul

            bf16_ms = graph_ms([lambda w=w: silu_and_mul(F.linear(x, w)) for w in bw])
        else:
            bf16_ms = graph_ms([lambda w=w: F.linear(x, w) for w in bw])
        bf16_bytes = n_w * k * 2 + x.nbytes + m * n * 2
        del bw
        rows.append({**case, "impl": "bf16-cublas", "ms": bf16_ms, "bytes": bf16_bytes,
                     "gb_per_s": bf16_bytes / bf16_ms / 1e6})
        try:
            prev_ms = graph_ms([lambda w=w: _previous(fmt, x, w, silu) for w in wts])
        except Exception as exc:
            prev_ms = math.inf
            rows.append({**case, "impl": "previous", "error": repr(exc)[:200]})
        else:
            rows.append({**case, "impl": "previous", "ms": prev_ms,
                         "gb_per_s": total / prev_ms / 1e6, "speedup_vs_bf16": bf16_ms / prev_ms})
        ref = _ref(fmt, x, wts[0], silu).float()
        tol = float(ref.abs().max())
        best = None
        grid = _grid(kfmt, m, n, k, sms)
        base = grid[0]
        own = None
        if configs:  # a given list: the heuristic, the table's and these, all timed
            own = _table_config(kfmt, n, k, m)
            grid = list(dict.fromkeys(c for c in [base, own, *configs] if c is not None))
        # the heuristic's tile at every split, then the rest by program count near the best
        tile = lambda c: (c.block_n, c.block_k, c.num_warps, c.num_stages, c.deq, c.xa)  # noqa
        first = grid if configs else [c for c in grid if tile(c) == tile(base)]
        rest = [c for c in grid if c not in first]
        i = 0
        tiered = False
        while first or rest:
            if not first:
                bp = (-(-n // best[1].tile_rows) * best[1].split_k if best is not None
                      else -(-n // base.tile_rows) * base.split_k)
                near = lambda c: abs(math.log(-(-n // c.tile_rows) * c.split_k / bp))  # noqa
                if not tiered:  # each other tile once, at the split nearest the best's
                    tiered = True  # program count, in the grid's tile order
                    seen: dict = {}
                    for c in rest:
                        if tile(c) not in seen or near(c) < near(seen[tile(c)]):
                            seen[tile(c)] = c
                    first = list(seen.values())
                    rest = [c for c in rest if c not in first]
                    continue
                rest.sort(key=near)
                first, rest = rest, []
            cfg = first.pop(0)
            if i > 0 and time.time() > deadline and not configs:
                break
            i += 1
            try:
                err = float((_ours(fmt, x, wts[0], cfg, silu).float() - ref).abs().max())
                t = graph_ms([lambda w=w: _ours(fmt, x, w, cfg, silu) for w in wts],
                              replays=10 if i > 1 else 20)
            except Exception as exc:  # one failing configuration must not hide the others
                sweeps.append({**case, "config": cfg.as_dict(), "error": repr(exc)[:300]})
                continue
            r = {**case, "config": cfg.as_dict(), "ms": t, "gb_per_s": total / t / 1e6,
                 "hbm_fraction": total / t / 1e-3 / HBM, "speedup_vs_bf16": bf16_ms / t,
                 "speedup_vs_previous": prev_ms / t, "max_abs_err": err}
            if err > 0.03 * tol:  # a wrong result is never a candidate
                sweeps.append({**r, "wrong": True})
                continue
            sweeps.append(r)
            if cfg == base:
                rows.append({**r, "impl": "gemv-default"})
            if own is not None and cfg == own:
                rows.append({**r, "impl": "gemv-table"})
            if best is None or t < best[0]["ms"]:
                best = (r, cfg)
        tcase = {**case, "format": kfmt}  # the table's key (n: the output width)
        if best is None:
            table.append({**tcase, "config": None})
            print(f"{name:8s} M={m} {fmt:7s} no working config", flush=True)
            continue
        r = best[0]
        rows.append({**r, "impl": "gemv-best", "tried": i})
        win = r["speedup_vs_previous"] >= 1.02
        table.append({**tcase, "config": r["config"] if win else None,
                      "speedup_vs_previous": r["speedup_vs_previous"],
                      "speedup_vs_bf16": r["speedup_vs_bf16"]})
        print(f"{name:8s} M={m} {fmt:7s} bf16 {bf16_ms * 1e3:6.1f} us "
              f"{bf16_bytes / bf16_ms / 1e6:5.0f} GB/s | prev {prev_ms * 1e3:6.1f} us | new "
              f"{r['ms'] * 1e3:6.1f} us {r['gb_per_s']:5.0f} GB/s x{r['speedup_vs_bf16']:.2f} "
              f"bf16 x{r['speedup_vs_previous']:.2f} prev ({i} tried) {r['config']}", flush=True)
    return {"rows": rows, "sweep": sweeps, "table": table}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--write-tuning", default=None, metavar="FILE",
                   help="merge the measured table into this tuning data file "
                        "(kvflow/kernels/tuning/<gpu>.json; created if missing)")
    p.add_argument("--ms", default="1,2,4,8")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="seconds of sweeping in all (each case gets a share)")
    p.add_argument("--other-m-share", type=float, default=1 / 6,
                   help="sweep share of an M > 1 case relative to an M = 1 case (0: the "
                        "heuristic config only)")
    p.add_argument("--shapes", default="",
                   help="only these shapes (comma-separated: " + ", ".join(
                       s[0] for s in SHAPES) + ")")
    p.add_argument("--configs", default="",
                   help="time exactly these configurations (and the heuristic's and the "
                        "table's) instead of the sweep: BN:BK:SPLIT:WARPS:STAGES"
                        "[:DEQ:XA[:ROWS]],... (DEQ, XA: 0 or 1; ROWS: output rows per "
                        "program, WoqGemvConfig.rows)")
    ns = p.parse_args()
    try:
        configs = [_parse_config(c) for c in ns.configs.split(",") if c] or None
    except ValueError as exc:  # a malformed field or rows > BN
        p.error(str(exc))
    start = time.time()
    result = bench(ns.budget_s, tuple(int(m) for m in ns.ms.split(",")),
                   tuple(ns.formats.split(",")), ns.other_m_share,
                   set(ns.shapes.split(",")) if ns.shapes else None, configs)
    result.update({"command": "python " + " ".join(sys.argv),
                   "device": torch.cuda.get_device_name(), "hbm_bytes_per_s": HBM,
                   "seconds": time.time() - start,
                   "timing": "one CUDA graph over weight copies > 4x L2, median per launch"})
    save_result(ns.out, result)
    if ns.write_tuning:
        tuning.write_bench(ns.write_tuning, result, os.path.relpath(ns.out))
    print(f"wrote {ns.out}")
    print(json.dumps({"seconds": result["seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
