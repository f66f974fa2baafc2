"""GPU micro-benchmark of kvflow's Triton kernels against their torch references.

Shapes are Llama-3.1-8B's (hidden 4096, intermediate 14336, H=32, KVH=8, D=128, bf16,
cache block size 16). Each case is timed with ``triton.testing.do_bench`` (median, L2
flushed between runs) and reported as achieved GB/s against the H200's 4.2 TB/s HBM
ceiling (memory-bound kernels) or TFLOP/s against ~790 TFLOP/s dense bf16 (prefill
attention). Decode attention is also timed replayed from a CUDA graph.

    python benchmarks/kernels/bench_kernels.py --out benchmarks/results/kernels-h200.json
    python benchmarks/kernels/bench_kernels.py --out sweep.json --only attention --sweep

The byte counts are the ideal traffic of each operation (every input read once, every
output written once); the kernel files' docstrings derive them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from kvflow.kernels.paged_attention import (TileConfig, attention_bytes_flops,  # noqa: E402
                                            choose_num_kv_splits, paged_attention)
from kvflow.kernels.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from kvflow.kernels.rotary_kv import rotary_and_cache_write  # noqa: E402
from kvflow.kernels.silu_and_mul import silu_and_mul  # noqa: E402
from kvflow.layers.activation import silu_and_mul_ref  # noqa: E402
from kvflow.layers.attention.torch_backend import gather_kv, write_kv_ref  # noqa: E402
from kvflow.layers.norm import rms_norm_ref  # noqa: E402
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary_ref  # noqa: E402

HBM_BYTES_PER_S = 4.2e12
BF16_FLOP_PER_S = 790e12
HIDDEN, INTER, H, KVH, D, BS = 4096, 14336, 32, 8, 128, 16
DTYPE = torch.bfloat16
DEV = "cuda"
EPS = 1e-5


def _time(fn: Callable[[], object], graph: bool = False) -> float:
    """Median milliseconds of ``fn``; ``graph`` replays it from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    if graph:
        return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


class Report:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, kernel: str, case: str, kernel_ms: float, ref_ms: float | None,
            nbytes: int, flops: int = 0, **extra) -> None:
        row = dict(kernel=kernel, case=case, kernel_ms=kernel_ms, ref_ms=ref_ms,
                   speedup=(ref_ms / kernel_ms) if ref_ms else None, bytes=nbytes,
                   flops=flops, gb_per_s=nbytes / kernel_ms / 1e6,
                   hbm_fraction=nbytes / kernel_ms / 1e-3 / HBM_BYTES_PER_S,
                   tflop_per_s=flops / kernel_ms / 1e9 if flops else None,
                   bf16_fraction=flops / kernel_ms / 1e-3 / BF16_FLOP_PER_S if flops else None,
                   **extra)
        self.rows.append(row)
        ref = f"{ref_ms:9.4f}" if ref_ms else "      n/a"
        spd = f"{row['speedup']:6.2f}x" if ref_ms else "    n/a"
        line = (f"{kernel:<22} {case:<34} {kernel_ms:9.4f} {ref} {spd} "
                f"{row['gb_per_s']:8.1f} GB/s ({100 * row['hbm_fraction']:5.1f}% HBM)")
        if flops:
            line += f" {row['tflop_per_s']:7.1f} TFLOP/s ({100 * row['bf16_fraction']:5.1f}%)"
        extra_s = " ".join(f"{k}={v}" for k, v in extra.items() if k != "shape")
        print(line + (f"  {extra_s}" if extra_s else ""), flush=True)


# --- elementwise / norm kernels --------------------------------------------------------

def bench_rms_norm(rep: Report, token_counts: list[int]) -> None:
    w = torch.rand(HIDDEN, dtype=DTYPE, device=DEV) + 0.5
    for t in token_counts:
        x = torch.randn(t, HIDDEN, dtype=DTYPE, device=DEV)
        res = torch.randn_like(x)
        e = x.element_size()
        rep.add("rms_norm", f"T={t} hidden={HIDDEN}", _time(lambda: rms_norm(x, w, EPS)),
                _time(lambda: rms_norm_ref(x, w, EPS)), 2 * t * HIDDEN * e + HIDDEN * e)

        def ref_fused():
            r = x + res
            return rms_norm_ref(r, w, EPS), r

        rep.add("fused_add_rms_norm", f"T={t} hidden={HIDDEN}",
                _time(lambda: fused_add_rms_norm(x, res, w, EPS)), _time(ref_fused),
                4 * t * HIDDEN * e + HIDDEN * e)
    # Qwen3-style per-head norm on a strided view of the qkv output.
    wd = torch.rand(D, dtype=DTYPE, device=DEV) + 0.5
    for t in token_counts:
        qkv = torch.randn(t, (H + 2 * KVH) * D, dtype=DTYPE, device=DEV)
        q = qkv[:, : H * D].view(t, H, D)
        rep.add("rms_norm(per-head)", f"T={t} [T,{H},{D}] strided",
                _time(lambda: rms_norm(q, wd, EPS)), _time(lambda: rms_norm_ref(q, wd, EPS)),
                2 * t * H * D * 2 + D * 2)


def bench_silu_and_mul(rep: Report, token_counts: list[int]) -> None:
    for t in token_counts:
        x = torch.randn(t, 2 * INTER, dtype=DTYPE, device=DEV)
        rep.add("silu_and_mul", f"T={t} d={INTER}", _time(lambda: silu_and_mul(x)),
                _time(lambda: silu_and_mul_ref(x)), 3 * t * INTER * x.element_size())


def bench_rotary(rep: Report, token_counts: list[int]) -> None:
    rotary = RotaryEmbedding(D, 131072, 500000.0, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}).to(DEV)
    for t in token_counts:
        num_blocks = max(1024, 2 * triton.cdiv(t, BS))
        kv_cache = torch.randn(2, num_blocks, BS, KVH, D, dtype=DTYPE, device=DEV)
        qkv = torch.randn(t, (H + 2 * KVH) * D, dtype=DTYPE, device=DEV)
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        q, k, v = q.view(t, H, D), k.view(t, KVH, D), v.view(t, KVH, D)
        positions = torch.randint(0, 131072, (t,), device=DEV)
        slots = torch.randperm(num_blocks * BS, device=DEV)[:t]

        def ref():
            cos, sin = rotary.cos_sin(positions)
            qr, kr = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
            write_kv_ref(kr, v, kv_cache, slots)
            return qr, kr

        e = 2
        nbytes = t * ((2 * H * D + 2 * KVH * D) * e + KVH * D * e + 2 * KVH * D * e
                      + 4 * D + 16)
        rep.add("rotary_and_cache_write", f"T={t} H={H} KVH={KVH} D={D}",
                _time(lambda: rotary_and_cache_write(positions, q, k, v, rotary.cos_sin_cache,
                                                     kv_cache, slots)),
                _time(ref), nbytes)


# --- attention -------------------------------------------------------------------------

class PagedBatch:
    """Random paged batch (shuffled block ids) with Llama-3.1-8B attention shapes."""

    def __init__(self, q_lens: list[int], seq_lens: list[int], num_decodes: int,
                 seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.q_lens, self.seq_lens, self.num_decodes = q_lens, seq_lens, num_decodes
        nblk = [triton.cdiv(s, BS) for s in seq_lens]
        num_blocks = sum(nblk) + 1
        self.kv_cache = torch.randn(2, num_blocks, BS, KVH, D, dtype=DTYPE, device=DEV)
        perm = torch.randperm(num_blocks).to(torch.int32)
        self.block_tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
        c = 0
        for i, n in enumerate(nblk):
            self.block_tables[i, :n] = perm[c:c + n]
            c += n
        self.block_tables = self.block_tables.to(DEV)
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        self.qsl = qsl
        self.q = torch.randn(qsl[-1], H, D, dtype=DTYPE, device=DEV)
        self.query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=DEV)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        self.scale = D ** -0.5
        self.out = torch.empty_like(self.q)

    def run(self, splits: int = 1, **cfg) -> torch.Tensor:
        return paged_attention(self.q, self.kv_cache, self.block_tables, self.query_start_loc,
                               self.seq_lens_t, self.scale, num_decodes=self.num_decodes,
                               max_query_len=max(self.q_lens), max_seq_len=max(self.seq_lens),
                               num_kv_splits=splits, out=self.out, **cfg)

    def bytes_flops(self) -> tuple[int, int]:
        return attention_bytes_flops(self.q_lens, self.seq_lens, H, KVH, D, 2)

    def torch_decode(self) -> Callable[[], torch.Tensor]:
        """TorchAttentionBackend's decode: gather the contexts, one masked SDPA call."""
        b, max_len = self.num_decodes, max(self.seq_lens[: self.num_decodes])
        nblk = triton.cdiv(max_len, BS)
        bt = self.block_tables[:b, :nblk].long()
        q = self.q[:b]
        mask = (torch.arange(nblk * BS, device=DEV)[None, :]
                < self.seq_lens_t[:b, None].long())[:, None, None, :]

        def fn():
            kv = self.kv_cache[:, bt].view(2, b, nblk * BS, KVH, D).transpose(2, 3)
            return F.scaled_dot_product_attention(q.unsqueeze(2), kv[0], kv[1], attn_mask=mask,
                                                  scale=self.scale, enable_gqa=True)
        return fn

    def torch_prefill(self) -> Callable[[], None]:
        """TorchAttentionBackend's prefill: SDPA per chunk; a fresh prompt's K/V are taken
        as already contiguous (the backend has them from the projection), a chunk with a
        cached prefix gathers its context from the cache inside the timed call."""
        chunks = []
        for i in range(self.num_decodes, len(self.seq_lens)):
            s, e = self.qsl[i], self.qsl[i + 1]
            n, sl = e - s, self.seq_lens[i]
            qi = self.q[s:e].transpose(0, 1)
            if n == sl:
                k, v = gather_kv(self.kv_cache, self.block_tables[i], sl)
                chunks.append((qi, k.transpose(0, 1).contiguous(),
                               v.transpose(0, 1).contiguous(), None, i))
            else:
                pos = torch.arange(sl - n, sl, device=DEV)[:, None]
                mask = torch.arange(sl, device=DEV)[None, :] <= pos
                chunks.append((qi, None, None, mask, i))

        def fn():
            for qi, k, v, mask, i in chunks:
                if k is None:
                    kk, vv = gather_kv(self.kv_cache, self.block_tables[i], self.seq_lens[i])
                    F.scaled_dot_product_attention(qi, kk.transpose(0, 1), vv.transpose(0, 1),
                                                   attn_mask=mask, scale=self.scale,
                                                   enable_gqa=True)
                else:
                    F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
        return fn


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def bench_decode(rep: Report, cases: list[tuple[int, int]], sweep: bool) -> None:
    rng = random.Random(0)
    for b, ctx in cases:
        seq_lens = [ctx] * b if b <= 16 else [rng.randint(ctx // 2, ctx) for _ in range(b)]
        batch = PagedBatch([1] * b, seq_lens, b)
        nbytes, flops = batch.bytes_flops()
        splits = choose_num_kv_splits(b, max(seq_lens), KVH, _num_sms())
        ref_ms = _time(batch.torch_decode())
        case = f"B={b} ctx={'%d' % ctx if b <= 16 else f'U[{ctx // 2},{ctx}]'}"
        for s in sorted({1, splits}):
            ms = _time(lambda: batch.run(s))
            graph_ms = _time(lambda: batch.run(s), graph=True)
            rep.add("paged_attention", f"decode {case}", ms, ref_ms, nbytes, flops,
                    splits=s, graph_ms=round(graph_ms, 5),
                    graph_hbm_fraction=round(nbytes / graph_ms / 1e-3 / HBM_BYTES_PER_S, 4))
        if sweep:
            _sweep(rep, batch, f"decode {case}", nbytes, flops, splits, decode=True)


def bench_prefill(rep: Report, sweep: bool) -> None:
    cases = [
        ("prefill 1x8192 fresh", [8192], [8192], 0),
        ("prefill 4x1024 fresh", [1024] * 4, [1024] * 4, 0),
        ("prefill 2048 chunk after 6144 cached", [2048], [8192], 0),
        ("mixed 128 decodes (ctx 2048) + 1024 chunk after 1024", [1] * 128 + [1024],
         [2048] * 128 + [2048], 128),
    ]
    for name, q_lens, seq_lens, nd in cases:
        batch = PagedBatch(q_lens, seq_lens, nd)
        nbytes, flops = batch.bytes_flops()
        ms = _time(lambda: batch.run(1))
        if nd == 0:
            ref_ms = _time(batch.torch_prefill())
        else:
            dec, pre = batch.torch_decode(), batch.torch_prefill()
            ref_ms = _time(lambda: (dec(), pre()))
        rep.add("paged_attention", name, ms, ref_ms, nbytes, flops)
        if sweep and nd == 0:
            _sweep(rep, batch, name, nbytes, flops, 1, decode=False)


def _sweep(rep: Report, batch: PagedBatch, name: str, nbytes: int, flops: int, splits: int,
           decode: bool) -> None:
    """Time other tile configs (the defaults live in default_tile_configs)."""
    if decode:
        configs = [TileConfig(16, n, w, s) for n in (32, 64, 128) for w in (2, 4, 8)
                   for s in (2, 3, 5)]
    else:
        configs = [TileConfig(m, n, w, s) for m in (64, 128) for n in (32, 64, 128)
                   for w in (4, 8) for s in (2, 3)]
    best = None
    for cfg in configs:
        key = "decode_config" if decode else "prefill_config"
        try:
            ms = _time(lambda: batch.run(splits, **{key: cfg}))
        except Exception as exc:  # e.g. out of shared memory
            print(f"  sweep {cfg}: failed ({type(exc).__name__})", flush=True)
            continue
        rep.add("paged_attention[sweep]", name, ms, None, nbytes, flops, splits=splits,
                config=str(cfg))
        if best is None or ms < best[0]:
            best = (ms, cfg)
    if best:
        print(f"  best for {name}: {best[1]} at {best[0]:.4f} ms", flush=True)


# --- main ------------------------------------------------------------------------------

def _machine() -> dict:
    props = torch.cuda.get_device_properties(0)
    info = dict(gpu=torch.cuda.get_device_name(0), sms=props.multi_processor_count,
                capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                memory_gib=round(props.total_memory / 2 ** 30, 1), torch=torch.__version__,
                cuda=torch.version.cuda, triton=triton.__version__,
                python=platform.python_version(), host=platform.node())
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except Exception:
        info["driver"] = None
    return info


def _git() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return dict(commit=commit or None, dirty=dirty)
    except Exception:
        return dict(commit=None, dirty=None)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON result file")
    parser.add_argument("--only", choices=["norm", "silu", "rotary", "attention"],
                        action="append", help="run only these groups (repeatable)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time other attention tile configs")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    groups = set(args.only or ["norm", "silu", "rotary", "attention"])
    tokens = [1, 256, 8192] if not args.quick else [256]
    decode_cases = ([(1, 4096), (1, 32768), (16, 4096), (64, 4096), (256, 1024), (256, 4096)]
                    if not args.quick else [(1, 4096), (256, 4096)])
    rep = Report()
    print(f"{'kernel':<22} {'case':<34} {'kern ms':>9} {'ref ms':>9} {'speedup':>7}")
    if "norm" in groups:
        bench_rms_norm(rep, tokens)
    if "silu" in groups:
        bench_silu_and_mul(rep, tokens)
    if "rotary" in groups:
        bench_rotary(rep, tokens)
    if "attention" in groups:
        bench_decode(rep, decode_cases, args.sweep)
        bench_prefill(rep, args.sweep)
    result = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=_machine(), git=_git(),
        ceilings=dict(hbm_bytes_per_s=HBM_BYTES_PER_S, bf16_flop_per_s=BF16_FLOP_PER_S),
        model_shapes=dict(model="Llama-3.1-8B", hidden=HIDDEN, intermediate=INTER,
                          num_heads=H, num_kv_heads=KVH, head_dim=D, block_size=BS,
                          dtype=str(DTYPE)),
        timing="triton.testing.do_bench median ms (L2 flushed); graph_ms: do_bench_cudagraph",
        results=rep.rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
