"""Summary of the ``quant`` stage of benchmarks/gpu/run.sh: batch-1 decode tokens/s of
int8 / int4 over bf16 (targets of issue 16: int4 >= 2.5x, int8 bound 2x), the kernel
micro-benchmark's speed-ups by shape and M, and the quality table; written to
``OUT/quant-summary.json``.

    python benchmarks/gpu/quant_summary.py OUT
"""

from __future__ import annotations

import json
import os
import sys

from kvflow.bench.machine import save_result


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main(out: str) -> int:
    summary: dict = {"decode": {}, "kernels": [], "quality": None}
    base = None
    found = sorted(f[len("gpu-a-quant-"):-5] for f in os.listdir(out)
                   if f.startswith("gpu-a-quant-") and f.endswith(".json"))
    for q in ["none"] + [f for f in found if f != "none"]:
        r = _load(os.path.join(out, f"gpu-a-quant-{q}.json"))
        fig = (r or {}).get("kvflow") or {}
        tps = fig.get("decode_tokens_per_s_per_seq")
        if tps is None:
            summary["decode"][q] = {"missing": True}
            continue
        base = tps if q == "none" else base
        summary["decode"][q] = {"decode_tokens_per_s": tps, "weight_gib": fig.get("weight_gib"),
                                "over_bf16": tps / base if base else None}
        print(f"decode {q:9s} {tps:7.1f} tokens/s  {fig.get('weight_gib', 0):.2f} GiB  "
              f"x{tps / base if base else float('nan'):.2f} vs bf16")
    bench = _load(os.path.join(out, "woq-bench.json"))
    for row in (bench or {}).get("rows", []):
        if "speedup_vs_bf16" in row:
            summary["kernels"].append({k: row[k] for k in ("shape", "m", "format", "graph_ms",
                                                           "gb_per_s", "hbm_fraction",
                                                           "speedup_vs_bf16")})
    for m in sorted({r["m"] for r in summary["kernels"]}):
        cells = [f"{r['shape']}/{r['format']} x{r['speedup_vs_bf16']:.2f}"
                 for r in summary["kernels"] if r["m"] == m and r["format"] in (
                     "int4-g128", "int8-channel")]
        print(f"kernels M={m}: " + ", ".join(cells))
    quality = _load(os.path.join(out, "quality-cuda.json"))
    if quality:
        summary["quality"] = quality.get("methods", quality)
    save_result(os.path.join(out, "quant-summary.json"), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu-out"))
