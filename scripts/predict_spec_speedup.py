#!/usr/bin/env python
"""Predict batch-1 speculative decoding speedups on the GPU from two measurements:

* the GPU's cost per verification step (``kvflow bench spec-verify`` at 8B shape:
  ``oracle_chain_bs1[k].ms_per_step`` for k drafts, ``oracle_tree_bs1[N]`` for an N-node
  Medusa tree, ``medusa_heads_ms`` for the heads' own forward, ``plain_bs1`` for plain
  decoding), and
* the tokens each verification step yields on real text (``mean_accepted_length`` of the
  CPU runs with the embedded model, ``benchmarks/results/spec-*-cpu.json``), which
  random GPU weights cannot give.

predicted tokens/s = mean accepted length / (step cost at that k or tree + proposer
cost); speedup = that over plain decoding's tokens/s. The acceptance of a 135M model's
drafts on chat is not an 8B model's, so read the figures as what this machinery would
give at that acceptance, not as a forecast for Llama-3.1-8B with its own heads.

    python scripts/predict_spec_speedup.py --gpu gpu-out/spec-verify.json \\
        --out benchmarks/results/spec-predict-h200.json [--eagle eagle-head.json] \\
        [CPU result files ...]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

from kvflow.bench.machine import save_result


def _nearest(table: dict, key: int) -> tuple[int, dict] | None:
    if not table:
        return None
    k = min((int(x) for x in table), key=lambda x: (abs(x - key), x))
    return k, table[str(k)]


def _eagle_ms(eagle: dict | None, k: int, confidence: float) -> float | None:
    """The eagle_mlp proposer's measured cost for k drafts (benchmarks/gpu/
    eagle_head_timing.py), at the run's draft_confidence gating or without it."""
    if not eagle:
        return None
    gated = confidence > 0
    rows = [r for r in eagle["rows"] if (r["draft_confidence"] > 0) == gated]
    if not rows:
        return None
    row = min(rows, key=lambda r: (abs(r["k"] - k), r["k"]))
    return float(row["ms_per_propose"]) * k / row["k"]


def predict(gpu: dict, cpu_files: list[str], eagle: dict | None = None) -> dict:
    plain = gpu["plain_bs1"]
    plain_tps = plain["decode_tokens_per_s"]
    chain = gpu.get("oracle_chain_bs1", {})
    trees = gpu.get("oracle_tree_bs1", {})
    heads_ms = float(gpu.get("medusa_heads_ms", 0.0))
    depth = int(gpu.get("workload", {}).get("tree_depth", 4)) or 1
    rows = []
    for path in cpu_files:
        with open(path) as f:
            r = json.load(f)
        spec = (r.get("engine_config") or {}).get("speculative_config")
        stats = (r.get("kvflow") or {}).get("spec_decode")
        if not spec or not stats or not stats.get("num_drafts"):
            continue
        if (r.get("workload") or {}).get("max_num_seqs", 1) not in (None, 1) and \
                "bs1" not in os.path.basename(path):
            continue  # batch-1 figures only
        method, k = spec["method"], int(spec["num_speculative_tokens"])
        length = float(stats["mean_accepted_length"])
        row = {"cpu_result": os.path.basename(path), "method": method, "k": k,
               "cpu_mean_accepted_length": round(length, 3),
               "cpu_speedup": r.get("spec_over_no_spec")}
        tree = spec.get("medusa_tree", "chain")  # results before trees: chains
        tree_size = None
        if method == "medusa" and tree != "chain" and "medusa_tree" in spec:
            # None: the CPU default tree (the runs here are CPU runs).
            tree_size = 4 if tree is None else tree if isinstance(tree, int) else len(tree)
            named = re.search(r"tree(\d+)", os.path.basename(path))
            if named and tree is None:  # a run from when the CPU default was another size
                tree_size = int(named.group(1))
        if method == "draft_model":
            row["predicted"] = None
            row["why_not"] = "needs a draft model's cost at this shape (not measured)"
            rows.append(row)
            continue
        if method == "medusa" and tree_size:
            hit = _nearest(trees, int(tree_size))
            what = f"tree {tree_size} nodes"
        else:
            hit = _nearest(chain, k)
            what = f"chain k={k}"
            if hit is not None and "ms_per_verify_step" not in hit[1] and \
                    hit[1].get("verify_steps_per_request", 0) < 10 and trees:
                # A result from before per-verification-step costing whose oracle ran off
                # its reference: its steps were plain ones. A tree step of at least
                # k + 1 tokens is the nearest measured verification cost.
                bigger = [int(n) for n in trees if int(n) >= k] or [max(int(n) for n in trees)]
                used_n = min(bigger)
                hit = (used_n, trees[str(used_n)])
                what += f" (cost of the {used_n}-node tree step)"
        if hit is None:
            continue
        used, cost = hit
        # Cost of a verification step (older results: per step, which counted plain
        # steps too when the oracle's drafts ran off its reference).
        step_ms = float(cost.get("ms_per_verify_step", cost["ms_per_step"]))
        propose_ms = heads_ms * min(k, depth) / depth if method == "medusa" else 0.0
        if method == "eagle_mlp":
            propose_ms = _eagle_ms(eagle, k, float(spec.get("draft_confidence") or 0.0))
            if propose_ms is None:
                row["predicted"] = None
                row["why_not"] = "needs the proposer's cost (benchmarks/gpu/eagle_head_timing.py)"
                rows.append(row)
                continue
        tps = length / (step_ms + propose_ms) * 1000.0
        row.update({"verify": what, "gpu_cost_measured_at": used,
                    "gpu_ms_per_verify_step": step_ms, "proposer_ms": round(propose_ms, 3),
                    "predicted_tokens_per_s": round(tps, 1),
                    "predicted_speedup": round(tps / plain_tps, 3)})
        rows.append(row)
    upper = {k: v.get("always_right_speedup") for k, v in chain.items()}
    tree_upper = {}
    for n, v in trees.items():  # depth + 1 tokens per verification step if always right
        bound = v.get("always_right_speedup")
        if bound is None and v.get("depth"):
            bound = round((v["depth"] + 1) * plain["ms_per_step"] / v["ms_per_step"], 3)
        tree_upper[n] = bound
    return {"gpu_plain_bs1_tokens_per_s": plain_tps,
            "gpu_plain_ms_per_step": plain["ms_per_step"],
            "always_right_chain_speedup": upper,
            "always_right_tree_speedup": tree_upper,
            "predictions": rows}


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", required=True, help="kvflow bench spec-verify result JSON")
    ap.add_argument("--out", default=None)
    ap.add_argument("--eagle", default=None, help="eagle_head_timing.py result JSON (the "
                    "eagle_mlp proposer's drafting cost at the GPU's shape)")
    ap.add_argument("cpu", nargs="*", help="CPU speculation results (default: "
                    "benchmarks/results/spec-*bs1*-cpu*.json)")
    ns = ap.parse_args()
    with open(ns.gpu) as f:
        gpu = json.load(f)
    files = ns.cpu or sorted(glob.glob("benchmarks/results/spec-*bs1*-cpu*.json"))
    eagle = None
    if ns.eagle:
        with open(ns.eagle) as f:
            eagle = json.load(f)
    out = predict(gpu, files, eagle)
    out["gpu_result"] = ns.gpu
    out["eagle_result"] = ns.eagle
    out["cpu_results"] = files
    out = save_result(ns.out, out)
    for row in out["predictions"]:
        speedup = row.get("predicted_speedup")
        verdict = f"{speedup}x" if speedup is not None else \
            f"no prediction ({row.get('why_not', 'no GPU figure for it')})"
        print(f"{row['method']:11s} {row.get('verify', ''):18s} accepted length "
              f"{row['cpu_mean_accepted_length']:.2f} -> predicted {verdict} "
              f"({row['cpu_result']})")
    print(f"always-right chain: {out['always_right_chain_speedup']}")
    print(f"always-right tree: {out['always_right_tree_speedup']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
