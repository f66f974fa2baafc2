"""GPU micro-benchmark of the greedy sampler's argmax: ``torch.argmax(dim=-1)`` (one block
per row) against ``argmax_rows`` (``kvflow/kernels/argmax.py``: each row split over
cdiv(V, BLOCK) programs, then a merge launch) on float32 logits [B, 128256]
(Llama-3's vocabulary), B = 1, 8, 64.

    python benchmarks/gpu/bench_argmax.py --out $OUT/argmax-bench.json [--rows 1,8,64]

Per (shape, impl): ``us``, microseconds per call, the median over replays of one CUDA
graph of ``--calls`` calls back to back (graph_timing.graph_ms; the logits stay in the
L2, as right after the LM head wrote them); ``eager_us``, ``--eager-calls`` calls
launched from Python with one sync at the end. The sampler runs eagerly, so where the
host cost exceeds the GPU time it shows there: on the H200 machine one Triton launch
cost ~13 us of host time and one torch.empty ~4 us. ``argmax_rows`` is timed at the
default BLOCK and at ``--blocks``. Every result is checked equal to torch's (``match``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from kvflow.bench.machine import git_commit, save_result  # noqa: E402
from kvflow.kernels.argmax import BLOCK, argmax_rows  # noqa: E402
from graph_timing import graph_ms  # noqa: E402  (this folder)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _commit() -> str:
    """git (or KVFLOW_GIT_COMMIT), else the ``.git-commit`` a tree copied without its
    history carries (benchmarks/gpu/env.sh), else "unknown"."""
    sha = git_commit()
    if not sha.startswith("unknown"):
        return sha
    try:
        with open(os.path.join(REPO, ".git-commit")) as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"


def _eager_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def bench(rows_list: list[int], vocab: int, blocks: list[int], calls: int,
          eager_calls: int) -> list[dict]:
    impls = [("torch.argmax", lambda x: x.argmax(dim=-1))]
    impls.append(("argmax_rows", lambda x: argmax_rows(x)))  # the default BLOCK
    impls += [(f"argmax_rows[block={b}]", lambda x, b=b: argmax_rows(x, block=b))
              for b in blocks if b != BLOCK]
    out = []
    for rows in rows_list:
        torch.manual_seed(rows)
        x = torch.randn(rows, vocab, device="cuda")
        x[0, vocab - 5] = 1e4  # the first row's max in the last chunk
        want = x.argmax(dim=-1)
        for name, f in impls:
            match = torch.equal(f(x), want)
            us = graph_ms([lambda f=f: f(x)] * calls) * 1e3
            row = {"shape": [rows, vocab], "dtype": "float32", "impl": name, "us": us,
                   "eager_us": _eager_us(lambda f=f: f(x), eager_calls), "match": match}
            out.append(row)
            print(f"[{rows}, {vocab}] {name:26s} {us:7.2f} us/call (graph)  "
                  f"{row['eager_us']:7.2f} us/call (eager)  match={match}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,8,64", help="batch sizes B")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--blocks", default="2048,8192",
                    help="other BLOCK sizes of argmax_rows to time besides the default")
    ap.add_argument("--calls", type=int, default=100, help="calls captured in one graph")
    ap.add_argument("--eager-calls", type=int, default=2000, help="calls timed eagerly")
    args = ap.parse_args()
    rows = bench([int(v) for v in args.rows.split(",")], args.vocab,
                 [int(v) for v in args.blocks.split(",") if v], args.calls, args.eager_calls)
    save_result(args.out, {
        "command": "python benchmarks/gpu/bench_argmax.py " + " ".join(sys.argv[1:]),
        "commit": _commit(), "default_block": BLOCK, "rows": rows,
        "timing": f"one CUDA graph of {args.calls} calls, median of 20 replays, per call; "
                  f"eager: {args.eager_calls} calls from Python after 50 warm-up, one sync"})
    return 0 if all(r["match"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
