"""GPU micro-benchmark of batch-1 decode attention at Llama-3.1-8B shape (32 query heads,
8 KV heads, head dim 128, bf16, 16-token blocks): split counts, the merge as its own
launch or fused into the attention launch (KVFLOW_ATTN_MERGE; ``fused-K``: with KVFLOW_ATTN_SPLIT_KEYS=K, the split count
decided on device), PDL off / on (KVFLOW_PDL).

    python benchmarks/gpu/bench_decode_attn.py --out $OUT/decode-attn.json

Timing is what a decode CUDA graph sees: one graph replays the call for ``layers``
distinct KV caches (disjoint blocks, together several times the 50 MB L2, as each layer's
cache is cold in a real step), median per call. The decode graphs bake in the split
count chosen for a 4096-token design context (16 at batch 1 on an H200), so the rows
with 16 splits are what GPU-A runs at its 128..384-token contexts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from kvflow.bench.machine import save_result  # noqa: E402
from kvflow.kernels import paged_attention as pa  # noqa: E402
from kvflow.kernels import pdl  # noqa: E402
from kvflow.layers.attention.torch_backend import paged_attention_ref  # noqa: E402
from graph_timing import graph_ms  # noqa: E402  (this folder)

H, KVH, D, BS = 32, 8, 128, 16
DT = torch.bfloat16


def _set(merge: str, pdl_on: bool) -> None:
    """merge: kernel, fused, or fused-K (fused with KVFLOW_ATTN_SPLIT_KEYS=K)."""
    os.environ["KVFLOW_ATTN_MERGE"] = merge.split("-")[0]
    os.environ["KVFLOW_ATTN_SPLIT_KEYS"] = merge.split("-")[1] if "-" in merge else "0"
    os.environ["KVFLOW_PDL"] = "on" if pdl_on else "off"
    pa.merge_mode.cache_clear()
    pa.split_keys.cache_clear()
    pdl._enabled.cache_clear()


def bench(contexts: list[int], splits_list: list[int]) -> list[dict]:
    rows = []
    for ctx in contexts:
        per_layer = ctx * KVH * D * 2 * 2
        layers = max(32, min(256, -(-200 * 2**20 // per_layer)))
        nblk = -(-ctx // BS)
        cache = torch.randn(2, layers * nblk + 1, BS, KVH, D, dtype=DT, device="cuda")
        tables = [torch.arange(i * nblk, (i + 1) * nblk, dtype=torch.int32,
                               device="cuda")[None] for i in range(layers)]
        q = torch.randn(1, H, D, dtype=DT, device="cuda")
        qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
        sl = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        ref = paged_attention_ref(q, cache, tables[0], [0, 1], [ctx], D ** -0.5).float()
        outs = [torch.empty_like(q) for _ in range(layers)]
        for splits in splits_list:
            for merge in ("kernel", "fused", "fused-128", "fused-256"):
                if splits == 1 and merge != "kernel" or merge.startswith("fused-") and (
                        splits != 16):
                    continue
                for pdl_on in (False, True):
                    _set(merge, pdl_on)

                    def call(i, splits=splits):
                        return pa.paged_attention(q, cache, tables[i], qsl, sl, D ** -0.5,
                                                  num_decodes=1, max_query_len=1,
                                                  max_seq_len=4096, num_kv_splits=splits,
                                                  out=outs[i])
                    err = float((call(0).float() - ref).abs().max())
                    ms = graph_ms([lambda i=i: call(i) for i in range(layers)])
                    r = {"context": ctx, "splits": splits, "merge": merge, "pdl": pdl_on,
                         "us": ms * 1e3, "kv_bytes": per_layer,
                         "gb_per_s": per_layer / ms / 1e6, "max_abs_err": err,
                         "layers": layers}
                    rows.append(r)
                    print(f"ctx {ctx:5d} splits {splits:2d} merge {merge:9s} pdl {pdl_on:d}: "
                          f"{r['us']:6.2f} us/layer  {r['gb_per_s']:6.0f} GB/s  err {err:.1e}",
                          flush=True)
        cache = tables = outs = None  # free before the next context
        torch.cuda.empty_cache()
    _set("kernel", False)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--splits", default="1,4,16")
    ns = ap.parse_args()
    start = time.time()
    rows = bench([int(c) for c in ns.contexts.split(",")],
                 [int(s) for s in ns.splits.split(",")])
    save_result(ns.out, {"command": "python " + " ".join(sys.argv), "rows": rows,
                         "device": torch.cuda.get_device_name(),
                         "seconds": time.time() - start,
                         "timing": "one CUDA graph over per-layer KV caches > L2, median "
                                   "per call"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
