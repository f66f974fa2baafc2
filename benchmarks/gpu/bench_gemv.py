"""GPU micro-benchmark of the dense decode GEMV (``kvflow/kernels/gemv.py``) against cuBLAS
at Llama-3.1-8B's linear shapes, M = 1, 2, 4, 8.

    python benchmarks/gpu/bench_gemv.py --out $OUT/gemv-bench.json [--sweep] [--budget-s 150]

Shapes (K -> N): qkv 4096->6144, o 4096->4096, gate_up 4096->28672 (plain, and with
SiLU-and-multiply fused: against cuBLAS + the ``silu_and_mul`` kernel), down 14336->4096,
lm_head 4096->128256; and the residual add + RMSNorm folded in (``gemv_norm``) for qkv and
gate_up+silu, against ``fused_add_rms_norm`` + cuBLAS (+ ``silu_and_mul``). Timing is
what a decode CUDA graph sees: one graph replays the launch over enough copies of the
weight that they do not fit the 50 MB L2 (each layer's weight is cold in a real step),
median of the replays, per launch. Reported: time, the
bytes each launch must move (weight + activations + output) as GB/s and as a fraction
of the H200's 4.8 TB/s, speed-up over cuBLAS, error against the reference.

Without ``--sweep`` each case times the built-in table's configurations for its shape
(every M bucket's) and the heuristic. ``--sweep`` (``--sweep-kinds`` picks the kinds)
also times a grid of tile configurations per case, most promising first, until
``--budget-s`` runs out. The ``table`` lists per case the best configuration where it beat
cuBLAS by at least 2 % (else null: keep cuBLAS): ``--write-tuning kvflow/kernels/tuning/<gpu>.json``
merges it into the GPU's tuning data, ``KVFLOW_TUNING_FILE=<this file>`` tries it as it is.
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

from kvflow import envs  # noqa: E402
from kvflow.bench.machine import save_result  # noqa: E402
from kvflow.kernels import tuning  # noqa: E402
from kvflow.kernels.gemv import (gemv, gemv_ref, gemv_silu_and_mul,  # noqa: E402
                                 gemv_silu_and_mul_ref)
from kvflow.kernels.gemv_config import (GemvConfig, _device_table,  # noqa: E402
                                        default_config)
from kvflow.kernels.gemv_norm import gemv_rms_norm, gemv_rms_norm_ref  # noqa: E402
from kvflow.kernels.rms_norm import fused_add_rms_norm  # noqa: E402
from kvflow.kernels.silu_and_mul import silu_and_mul  # noqa: E402
from graph_timing import graph_ms  # noqa: E402  (this folder)

HBM = 4.8e12
L2_BYTES = 50 * 2**20
SHAPES = [("qkv", "linear", 4096, 6144), ("o", "linear", 4096, 4096),
          ("gate_up", "linear", 4096, 28672), ("gate_up", "silu_mul", 4096, 28672),
          ("down", "linear", 14336, 4096), ("lm_head", "linear", 4096, 128256),
          ("qkv", "norm_linear", 4096, 6144), ("gate_up", "norm_silu_mul", 4096, 28672)]
MS = (1, 2, 4, 8)
DT = torch.bfloat16


def _tile(c: GemvConfig) -> tuple:
    return (c.block_n, c.block_k, c.dot, c.num_warps, c.num_stages)


def _programs(c: GemvConfig, n: int, k: int) -> int:
    return -(-n // c.tile_rows) * c.split_k


def _grid(kind: str, m: int, n: int, k: int, sms: int) -> list[GemvConfig]:
    """Configurations to try, the heuristic first, then tiles by expected promise."""
    pairs = kind.endswith("silu_mul")
    base = default_config(m, n, k, torch.device("cuda"), pairs=pairs)
    out = [base]
    stages = (2, 3) if pairs else (4, 3, 5)
    for bn, bk, w, st in itertools.product((64, 32, 16, 128), (256, 128), (4, 8), stages):
        tiles = -(-n // bn)
        k_tiles = -(-k // bk)
        for split in (1, 2, 3, 4, 6, 8, 12, 16):
            if split > k_tiles // 2 and split > 1:
                continue
            if not sms // 2 <= tiles * split <= 8 * sms and not (split == 1 and tiles > sms):
                continue
            if split > 1 and tiles > 4096:
                continue
            out.append(GemvConfig(bn, bk, split, True, w, st))
    if m == 1 and kind == "linear":  # the register form
        for bn, bk, w in itertools.product((16, 32, 64), (256, 512), (4, 8)):
            tiles = -(-n // bn)
            for split in (1, 2, 4, 8):
                if tiles * split < sms // 2 or tiles * split > 16 * sms or (
                        split > 1 and tiles > 4096) or split > -(-k // bk) // 2 and split > 1:
                    continue
                out.append(GemvConfig(bn, bk, split, False, w, 1))
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def bench(sweep: bool, budget_s: float, sweep_kinds: set[str] | None = None,
          ms: tuple[int, ...] = MS, shapes: set[str] | None = None,
          configs: list[GemvConfig] | None = None) -> dict:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, sweeps, table = [], [], []
    end = time.time() + budget_s
    cases = [c for c in itertools.product(SHAPES, ms) if not shapes or c[0][0] in shapes]
    swept = lambda kind: sweep and (not sweep_kinds or kind in sweep_kinds)  # noqa: E731

    def weight(kind: str, m: int) -> int:  # batch 1 is the target
        return (3 if m == 1 else 1) if swept(kind) else 0
    left = sum(weight(shape[1], m) for shape, m in cases)
    for (name, kind, k, n), m in cases:
        # this case's share of the sweep budget still left
        share = weight(kind, m) / left if left else 0.0
        deadline = time.time() + max(0.0, end - time.time()) * share
        left -= weight(kind, m)
        wbytes = n * k * 2
        copies = max(1, min(8, -(-4 * L2_BYTES // wbytes)))
        ws = [torch.randn(n, k, dtype=DT, device="cuda") * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, dtype=DT, device="cuda")
        pairs = kind.endswith("silu_mul")
        n_out = n // 2 if pairs else n
        total = wbytes + x.nbytes + m * n_out * 2
        if kind.startswith("norm"):  # + residual read, r written, norm weight
            res = torch.randn(m, k, dtype=DT, device="cuda")
            nw = torch.rand(k, dtype=DT, device="cuda") + 0.5
            total += 2 * x.nbytes + nw.nbytes

            def unfused(w):
                h, _ = fused_add_rms_norm(x, res, nw, 1e-5)
                return silu_and_mul(F.linear(h, w)) if pairs else F.linear(h, w)
            cublas = [lambda w=w: unfused(w) for w in ws]
            ours = lambda cfg: [lambda w=w: gemv_rms_norm(x, res, nw, 1e-5, w, cfg, pairs)  # noqa
                                for w in ws]
            ref = gemv_rms_norm_ref(x, res, nw, 1e-5, ws[0], pairs)[0].float()
            run = lambda cfg: gemv_rms_norm(x, res, nw, 1e-5, ws[0], cfg, pairs)[0]  # noqa
        elif kind == "silu_mul":
            cublas = [lambda w=w: silu_and_mul(F.linear(x, w)) for w in ws]
            ours = lambda cfg: [lambda w=w: gemv_silu_and_mul(x, w, cfg) for w in ws]  # noqa
            ref = gemv_silu_and_mul_ref(x, ws[0]).float()
            run = lambda cfg: gemv_silu_and_mul(x, ws[0], cfg)  # noqa: E731
        else:
            cublas = [lambda w=w: F.linear(x, w) for w in ws]
            ours = lambda cfg: [lambda w=w: gemv(x, w, None, cfg) for w in ws]  # noqa
            ref = gemv_ref(x, ws[0]).float()
            run = lambda cfg: gemv(x, ws[0], None, cfg)  # noqa: E731
        tol = float(ref.abs().max())
        cub_ms = graph_ms(cublas)
        base = default_config(m, n_out, k, x.device, pairs=pairs)
        case = {"shape": name, "kind": kind, "k": k, "n": n, "m": m, "bytes": total}
        rows.append({**case, "impl": "cublas", "ms": cub_ms, "gb_per_s": total / cub_ms / 1e6,
                     "hbm_fraction": total / cub_ms / 1e-3 / HBM})
        known = _device_table(torch.cuda.get_device_name(),
                              envs.tuning_file()).get((kind, n_out, k), {})
        own = known.get(m)
        if swept(kind) and configs:  # a given list: each one timed, no budget cut
            grid = [c for c in [own, *configs] if c is not None]
            timed = grid
        elif swept(kind):
            grid = _grid(kind, m, n_out, k, sms)
            timed = [own] if own is not None else []
        else:  # the table's configs for this shape (every bucket) and the heuristic
            grid = [c for c in [own, *known.values(), base] if c is not None]
            timed = grid
        # the heuristic's tile at every split first, then the other tiles ordered by
        # how close their program count is to the best so far (compiles cost more than
        # timings, so the budget goes to the likeliest tiles); table configs always run
        first = list(dict.fromkeys(timed + [c for c in grid if _tile(c) == _tile(base)]))
        rest = [c for c in grid if c not in first]
        best = best_cfg = None
        i = 0
        while first or rest:
            if not first:
                if best_cfg is not None:
                    rest.sort(key=lambda c: abs(math.log(_programs(c, n_out, k)
                                                         / _programs(best_cfg, n_out, k))))
                first, rest = rest, []
            cfg = first.pop(0)
            if i > 0 and time.time() > deadline and cfg not in timed:
                break
            i += 1
            try:
                err = float((run(cfg).float() - ref).abs().max())
                ms = graph_ms(ours(cfg), replays=10 if i > 1 else 20)
            except Exception as exc:  # one failing configuration must not hide the others
                sweeps.append({**case, "config": cfg.as_dict(), "error": repr(exc)[:200]})
                continue
            r = {**case, "config": cfg.as_dict(), "ms": ms, "gb_per_s": total / ms / 1e6,
                 "speedup_vs_cublas": cub_ms / ms, "max_abs_err": err}
            if err > 0.05 * tol:  # a wrong result is never a candidate
                sweeps.append({**r, "wrong": True})
                continue
            for label, c in (("gemv-table", own), ("gemv-default", base)):
                if cfg == c:
                    rows.append({**r, "impl": label, "hbm_fraction": total / ms / 1e-3 / HBM})
            sweeps.append(r)
            if best is None or ms < best["ms"]:
                best, best_cfg = r, cfg
        if best is not None:
            rows.append({**best, "impl": "gemv-best", "hbm_fraction": total / best["ms"]
                         / 1e-3 / HBM, "tried": len([s for s in sweeps if s.get("m") == m
                                                     and s["shape"] == name
                                                     and s["kind"] == kind])})
            win = best["speedup_vs_cublas"] >= 1.02
            table.append({**case, "config": best["config"] if win else None,
                          "speedup_vs_cublas": best["speedup_vs_cublas"]})
            print(f"{name:8s} {kind:8s} M={m}  cublas {cub_ms * 1e3:6.1f} us "
                  f"{total / cub_ms / 1e6:5.0f} GB/s | gemv {best['ms'] * 1e3:6.1f} us "
                  f"{best['gb_per_s']:5.0f} GB/s x{best['speedup_vs_cublas']:.2f}  "
                  f"{best['config']}", flush=True)
        ws = cublas = None  # free the copies before the next shape
        torch.cuda.empty_cache()
    return {"rows": rows, "sweep": sweeps, "table": table}


def _parse_config(text: str) -> GemvConfig:
    """BN:BK:SPLIT:WARPS:STAGES[:ROWS] -> a tensor-core GemvConfig."""
    f = [int(v) for v in text.split(":")]
    return GemvConfig(f[0], f[1], f[2], True, f[3], f[4], *f[5:6])


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--write-tuning", default=None, metavar="FILE",
                   help="merge the measured table into this tuning data file "
                        "(kvflow/kernels/tuning/<gpu>.json; created if missing)")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--ms", default="1,2,4,8", help="activation row counts")
    p.add_argument("--sweep-kinds", default="",
                   help="sweep only these kinds (comma-separated: linear, silu_mul, "
                        "norm_linear, norm_silu_mul); the others time the table's configs")
    p.add_argument("--shapes", default="",
                   help="only these shapes (comma-separated: qkv, o, gate_up, down, lm_head)")
    p.add_argument("--configs", default="",
                   help="with --sweep: time exactly these configurations (and the table's) "
                        "instead of the grid: BN:BK:SPLIT:WARPS:STAGES[:ROWS],... (ROWS: "
                        "output rows per program, GemvConfig.rows)")
    p.add_argument("--budget-s", type=float, default=150.0,
                   help="seconds of sweeping in all; later cases get the heuristic only")
    ns = p.parse_args()
    start = time.time()
    result = bench(ns.sweep, ns.budget_s,
                   set(ns.sweep_kinds.split(",")) if ns.sweep_kinds else None,
                   tuple(int(m) for m in ns.ms.split(",")),
                   set(ns.shapes.split(",")) if ns.shapes else None,
                   [_parse_config(c) for c in ns.configs.split(",") if c] or None)
    result.update({"command": "python " + " ".join(sys.argv),
                   "device": torch.cuda.get_device_name(), "hbm_bytes_per_s": HBM,
                   "seconds": time.time() - start,
                   "timing": "one CUDA graph over weight copies > L2, median per launch",
                   # the decode switches in force
                   "env": {k: v for k, v in os.environ.items() if k.startswith("KVFLOW_")}})
    save_result(ns.out, result)
    if ns.write_tuning:
        tuning.write_bench(ns.write_tuning, result, os.path.relpath(ns.out))
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
