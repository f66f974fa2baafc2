"""Engine start-up of the embedded model on CPU: first and second start, before and after.

Each start is a fresh Python process that imports kvflow and builds ``LLM()`` (the
default model, as ``kvflow generate`` does); the time is its import of kvflow plus
``LLM()``, measured in the child (the process's whole life, exit included, is kept as
``process_wall_s``). A *first* start finds no kvflow start caches (the packed-layout
cache and the C++ step's self-check records, in a private folder per run so that other
engines on the machine are not disturbed); a *second* start follows it and finds what
the first wrote. The C++ build cache is warm for both (a one-time build is measured by
its own log lines). ``--trees`` names the kvflow checkouts to compare (e.g. a ``git
archive`` of the base commit and this worktree); rounds alternate between them, since
the machine is shared and its load moves.

    python benchmarks/cpu_startup.py --trees before=/tmp/kvflow-base after=. \\
        --rounds 3 --out benchmarks/results/cpu-startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvflow.bench.machine import save_result  # noqa: E402

# The child: one engine start. The cache folder is redirected where this tree has one.
CHILD = r"""
import os, sys, time, json
t0 = time.perf_counter()
import kvflow
from kvflow import LLM
t1 = time.perf_counter()
try:
    from kvflow.layers.quantization import layout_cache
    from pathlib import Path
    root = Path(os.environ["STARTUP_BENCH_CACHE"]) / "layouts"
    layout_cache.cache_root = lambda: root
except ImportError:
    pass
llm = LLM()
t2 = time.perf_counter()
print("READY " + json.dumps({"import_s": t1 - t0, "llm_s": t2 - t1,
                             "kvflow": os.path.dirname(kvflow.__file__)}), flush=True)
"""

PHASES = {"load_s": re.compile(r"loaded \S+ \(gguf, \w+\) on cpu in ([\d.]+) s"),
          "core_ready_s": re.compile(r"engine core ready in ([\d.]+) s")}


def one_start(tree: str, cache: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "STARTUP_BENCH_CACHE": cache}
    load = os.getloadavg()[0]
    start = time.perf_counter()
    # Run in the tree: ``python -c`` puts the working directory first on sys.path, so a
    # child started elsewhere (e.g. in another checkout) would import that kvflow.
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tree)
    if proc.returncode != 0:
        raise RuntimeError(f"start failed in {tree}:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("READY "))
    child = json.loads(line[6:])
    if os.path.realpath(child["kvflow"]) != os.path.realpath(os.path.join(tree, "kvflow")):
        raise RuntimeError(f"the start meant for {tree} imported {child['kvflow']}")
    # The process's own time to ready: import + LLM() (its exit is not counted).
    out = {"seconds": round(child["import_s"] + child["llm_s"], 2),
           "import_s": round(child["import_s"], 2), "llm_s": round(child["llm_s"], 2),
           "process_wall_s": round(time.perf_counter() - start, 2), "loadavg_1m": load}
    for name, pattern in PHASES.items():
        m = pattern.search(proc.stderr)
        if m:
            out[name] = float(m.group(1))
    out["cache_lines"] = [x.split("] ", 1)[-1][:160] for x in proc.stderr.splitlines()
                          if "packed layouts" in x or "self-check passed" in x
                          or "recorded at an earlier start" in x]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="+", required=True, help="label=path of a kvflow tree")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--notes", default="")
    args = p.parse_args()
    trees = [t.split("=", 1) for t in args.trees]
    runs: dict[str, dict[str, list]] = {label: {"first": [], "second": []}
                                        for label, _ in trees}
    for r in range(args.rounds):
        for label, tree in trees:
            cache = tempfile.mkdtemp(prefix="kvflow-startup-")
            try:
                for kind in ("first", "second"):
                    res = one_start(tree, cache)
                    runs[label][kind].append(res)
                    print(f"round {r + 1} {label} {kind}: {res['seconds']:.1f} s "
                          f"(import {res['import_s']:.1f}, LLM() {res['llm_s']:.1f}; "
                          f"load {res['loadavg_1m']:.1f})", flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    summary = {label: {kind: {"median_s": sorted(x["seconds"] for x in v)[len(v) // 2],
                              "min_s": min(x["seconds"] for x in v),
                              "max_s": max(x["seconds"] for x in v)}
                       for kind, v in kinds.items()} for label, kinds in runs.items()}
    print(json.dumps(summary, indent=1))
    save_result(args.out, {"workload": "engine start of the embedded model (LLM(), CPU): "
                           "process spawn to ready, first start without kvflow's start "
                           "caches, second start with them",
                           "trees": dict(trees), "rounds": args.rounds, "summary": summary,
                           "runs": runs, "notes": args.notes})


if __name__ == "__main__":
    main()
