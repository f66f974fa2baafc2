"""Summary of a ``woq-gemv`` GPU stage: the GEMM time of one Llama-3.1-8B decode step (32
layers of qkv, o, gate_up, down, plus lm_head) per format and M from the micro-benchmark
(bf16 cuBLAS, the previous low-bit path, the new GEMV's best config), and the GPU-A
decode rates of the end-to-end runs against bf16.

    python benchmarks/gpu/woq_gemv_summary.py OUT_DIR [--out OUT_DIR/woq-gemv-summary.json]
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import sys

from kvflow.bench.machine import save_result

LAYERS = 32
PER_LAYER = ("qkv", "o", "gate_up", "down")
# lm_head of each model: --quantization int4 / int8 keep it int8 per channel, fp8 in bf16
# (QuantizationConfig.lm_head); the bench times it once, as int8 beside bf16 cuBLAS
HEAD_FORMAT = {"w4g128": "int8", "int8": "int8", "fp8": None}


def step_ms(rows: list[dict], fmt: str, m: int, impl: str, fused: bool = False
            ) -> float | None:
    """Summed ms of one decode step's GEMMs for ``impl`` (bf16-cublas, previous, gemv-best);
    ``fused``: gate_up with its SiLU-and-multiply (the fused launch; for bf16 and the
    previous path the GEMM + the silu_and_mul kernel)."""
    def t(shape, f):
        for r in rows:
            if (r["shape"], r["format"], r["m"], r["impl"]) == (shape, f, m, impl) and "ms" in r:
                return r["ms"]
        return None
    def t_head(which):
        for r in rows:
            if (r["shape"], r["format"], r["m"], r["impl"]) == ("lm_head", "int8", m, which) \
                    and "ms" in r:
                return r["ms"]
        return None
    parts = [t("gate_up_silu" if fused and s == "gate_up" else s, fmt) for s in PER_LAYER]
    if HEAD_FORMAT[fmt] is None or impl == "bf16-cublas":
        head = t_head("bf16-cublas")
    else:
        head = t_head(impl)
    if any(p is None for p in parts) or head is None:
        return None
    return LAYERS * sum(parts) + head


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    summary: dict = {"step_gemm_ms": {}, "gpu_a": {}}
    bench = os.path.join(ns.out_dir, "woq-gemv-bench.json")
    if os.path.exists(bench):
        rows = json.load(open(bench))["rows"]
        for fmt, fused in itertools.product(HEAD_FORMAT, (False, True)):
            for m in sorted({r["m"] for r in rows}):
                entry = {impl: step_ms(rows, fmt, m, impl, fused)
                         for impl in ("bf16-cublas", "previous", "gemv-best")}
                label = f"{fmt}{'+silu' if fused else ''}/M={m}"
                summary["step_gemm_ms"][label] = entry
                if all(entry.values()):
                    print(f"step GEMMs {label:16s}: bf16 {entry['bf16-cublas']:.3f} ms, "
                          f"previous {entry['previous']:.3f} ms, new {entry['gemv-best']:.3f}"
                          f" ms (x{entry['bf16-cublas'] / entry['gemv-best']:.2f} bf16, "
                          f"x{entry['previous'] / entry['gemv-best']:.2f} previous)")
    runs = {}
    for path in sorted(glob.glob(os.path.join(ns.out_dir, "gpu-a-woq-*.json"))):
        name = os.path.basename(path)[len("gpu-a-woq-"):-len(".json")]
        res = json.load(open(path))
        kv = res.get("kvflow") or {}
        if "decode_tokens_per_s_per_seq" in kv:
            runs[name] = kv["decode_tokens_per_s_per_seq"]
    base = runs.get("none-off")
    for name, tps in runs.items():
        summary["gpu_a"][name] = {"decode_tokens_per_s": tps,
                                  "over_bf16": tps / base if base else None}
        print(f"GPU-A {name:18s} {tps:7.1f} tokens/s" + (f"  x{tps / base:.2f} bf16" if base
                                                          else ""))
    out = ns.out or os.path.join(ns.out_dir, "woq-gemv-summary.json")
    save_result(out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
