"""Per-layer CPU decode attention time at CPU-B's shape: the torch backend's gather +
dequantize + SDPA path against the C++ kernel that reads the cache in place
(kvflow/cpu/kernels/paged_attention.cpp), for float32, int8 and fp8 caches.

    flock /tmp/kvflow-bench.lock python benchmarks/cpu_decode_attention.py \
        --save-result benchmarks/results/cpu-decode-attention.json

SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64), block size 16,
64 decodes with contexts uniform in 16..768 (CPU-B's prompts 16..512 plus up to 256
output tokens), blocks scattered over the cache. One decode step of one layer: rotary,
cache write and attention (what the backend's forward does). Best of several repeats;
``--threads 1`` times the thread's CPU time instead of wall time (for a busy machine).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kvflow.bench.machine import save_result
from kvflow.layers.attention import AttentionMetadata, AttentionSpec
from kvflow.layers.attention.kv_quant import KVQuant, storage_dtype
from kvflow.layers.attention.torch_backend import TorchAttentionBackend
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.utils import cdiv


def best_ms(fn, reps: int, inner: int, clock=time.perf_counter) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = clock()
        for _ in range(inner):
            fn()
        best = min(best, (clock() - t) / inner)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--min-context", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=768)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: as set); with 1 the figures are the "
                         "thread's CPU time, which other processes on a busy machine "
                         "disturb less than wall time")
    ap.add_argument("--save-result", default=None)
    ns = ap.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    h, kvh, d, bs = 9, 3, 64, ns.block_size
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(ns.min_context, ns.max_context + 1, (ns.batch,), generator=g)
    width = cdiv(int(lens.max()), bs)
    nb = ns.batch * width + 1
    tables = torch.randperm(nb, generator=g)[: ns.batch * width].view(ns.batch, width)
    tables = tables.to(torch.int32)
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs
                          for i, n in enumerate(lens.tolist())])
    rotary = RotaryEmbedding(d, 4096, 10000.0, None)
    spec = AttentionSpec(block_size=bs, num_kv_heads=kvh, dtype=torch.float32,
                         device=torch.device("cpu"), rotary=rotary)
    backend = TorchAttentionBackend()
    q = torch.randn(ns.batch, h, d, generator=g)
    k, v = torch.randn(ns.batch, kvh, d, generator=g), torch.randn(ns.batch, kvh, d, generator=g)
    positions = (lens - 1).long()
    rows = []
    for kind in ("auto", "int8", "fp8"):
        dtype = torch.float32 if kind == "auto" else storage_dtype(kind)
        cache = torch.randn(2, nb, bs, kvh, d, generator=g).to(dtype)
        quant = None if kind == "auto" else KVQuant(
            kind, torch.rand(2, nb, bs, kvh, generator=g) * 0.02 if kind == "int8" else None,
            0.05, 0.05)
        row = {"kv_cache_dtype": kind}
        for path in ("torch", "kernel"):
            builder = backend.metadata_builder(spec)
            builder.decode_kernel = builder.decode_kernel and path == "kernel"
            if path == "kernel" and not builder.decode_kernel:
                row["kernel_ms"] = None
                continue
            meta = AttentionMetadata(
                num_actual_tokens=ns.batch, num_reqs=ns.batch, num_decodes=ns.batch,
                max_query_len=1, max_seq_len=int(lens.max()), slot_mapping=slots,
                query_start_loc=torch.arange(ns.batch + 1, dtype=torch.int32),
                seq_lens=lens.to(torch.int32), block_tables=tables,
                query_start_loc_cpu=list(range(ns.batch + 1)), seq_lens_cpu=lens.tolist())
            builder.build(meta, positions)
            row[f"{path}_ms"] = best_ms(
                lambda: backend.forward(positions, q, k, v, cache, rotary, d ** -0.5, meta,
                                        kv_quant=quant), ns.reps, ns.inner, clock)
        if row.get("kernel_ms"):
            row["speedup"] = row["torch_ms"] / row["kernel_ms"]
        print(row)
        rows.append(row)
    save_result(ns.save_result, {
        "workload": {"batch": ns.batch, "context": [ns.min_context, ns.max_context],
                     "tokens": int(lens.sum()), "block_size": bs, "heads": h,
                     "kv_heads": kvh, "head_dim": d, "threads": torch.get_num_threads(),
                     "clock": clock.__name__},
        "loadavg_start": os.getloadavg(), "rows": rows})


if __name__ == "__main__":
    main()
