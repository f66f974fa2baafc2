"""Fused mixture-of-experts: routed tokens through their experts' gated MLPs in two
grouped-GEMM launches, beside the per-expert reference ``fused_moe_ref``.

Inputs: x [T, H], w13 [E, 2I, H] (gate rows then up rows of each expert), w2 [E, H, I],
the router's choice ``topk_ids`` [T, k] (-1: an expert another rank holds) and
``topk_weights`` [T, k].

Algorithm:

1. Align: the T*k (token, slot) pairs sorted by expert (stable: pair order within an
   expert), each expert's run padded to a multiple of BLOCK_M: ``sorted_ids`` [P] holds
   flat pair indices (padding: T*k), ``block_expert`` [P / BLOCK_M] the expert of each
   row block (-1: padding past the last expert). All on the device with no host
   synchronisation: P is the bound T*k + min(T*k, E)*(BLOCK_M - 1) (``align_capacity``),
   and blocks past the real total exit at once. Two implementations, same outputs:
   ``moe_align_fast``, one Triton launch (each program histograms all the ids to find
   where its group of experts' runs start, then places its experts' pairs by a prefix
   count), for steps of up to FAST_ALIGN_MAX_PAIRS pairs and FAST_ALIGN_MAX_EXPERTS
   experts: decode steps, where a CUDA graph removes the host time and the ~15 small
   kernels of the torch ``moe_align`` (sort, cumsum, scatter, searchsorted, ...) would
   be most of a layer; ``moe_align`` (torch) for larger steps.
2. GEMM 1 (``_moe_gemm_kernel`` with GATED): each program takes one row block and one
   block of I columns, accumulates the gate and the up tile of its expert side by side
   and stores ``silu(gate) * up`` [T*k, I] (the activation never leaves registers).
3. GEMM 2: the same kernel over w2, each output row scaled by its routing weight, into
   [T*k, H]; the k slots of a token are summed by the caller (a [T, k, H] sum).

Each row block reads its expert's weight tile once, so a decode step of B tokens reads
each active expert's weights once per row block: at B * k <= BLOCK_M per expert, once.
Float32 operands multiply in IEEE precision (not TF32), 16-bit ones on the tensor cores.
Weight-only quantized experts go through the same kernel, activations staying in their
dtype: int8 and float8 (e4m3) experts with per-output-channel scales (``w_scale``
[E, N]) have the tile converted in registers and the channel scale applied to the
accumulator; int4 experts (``pack_int4_experts``: two inputs a byte along K, scales and
offsets per group of K inputs laid out [E, K / group, N] so a tile's row of them is
contiguous) are dequantized per tile in registers (a tile of BLOCK_K inputs covers part of one
group or whole groups) and multiplied in the activation dtype. Nothing reads back to
the host, so all of them can be captured in a CUDA graph.
Launch configurations (BLOCK_M/N/K, warps, stages by number of tokens) are measured data:
the ``fused_moe`` rows of the GPU's file in ``kernels/tuning/`` (``fused_moe_config``),
written by ``benchmarks/gpu/bench_moe.py --tune --write-tuning``; ``DEFAULT_CONFIGS``
elsewhere.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvflow import envs


# The one-launch align kernel serves steps of at most this many (token, slot) pairs and
# at most FAST_ALIGN_MAX_EXPERTS experts (its histogram: next_pow2(E + 1) bins, in
# registers); larger steps take the torch ``moe_align``. Every program of the kernel
# reads all the pairs three times (from L2) and its work grows as pairs x its experts:
# at 1024 pairs (128 tokens at top-8: the decode batches CUDA graphs capture) that is
# 8 KB per read and 4096-lane tiles; the larger steps of prefill are few per second,
# their host time is hidden, and the torch path's sort scales better. The benchmark
# (benchmarks/gpu/bench_moe.py: align_us vs align_torch_us per M) is where to move it.
FAST_ALIGN_MAX_PAIRS = 1024
FAST_ALIGN_MAX_EXPERTS = 512
_ALIGN_TILE = 4096


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """P, the rows of ``sorted_ids``: every pair plus at most BLOCK_M - 1 padding rows
    for each expert that has a pair (at most min(pairs, experts) of them), in whole
    blocks. A bound known on the host, so nothing waits for the routing."""
    active = min(num_pairs, num_experts)
    return (num_pairs + active * (block_m - 1) + block_m - 1) // block_m * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids [P] int32, block_expert [P / block_m] int32,
    num_padded [1] int32). Ids outside [0, num_experts) are dropped (their rows stay
    zero in the output). The torch version (~15 small kernels); ``moe_align_fast`` is
    the one-launch Triton version with the same outputs."""
    flat = topk_ids.reshape(-1).to(torch.int64)  # [T*k]
    n = flat.numel()
    dev = flat.device
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.sort(key, stable=True).indices  # pairs grouped by expert
    sorted_key = key[order]
    # rank of each pair inside its expert's run: position minus where the run begins
    run_start = torch.cumsum(counts, 0) - counts
    pos_in_run = torch.arange(n, device=dev) - torch.cat(
        [run_start, run_start.new_full((1,), n)])[sorted_key]
    cap = align_capacity(n, num_experts, block_m)
    dest = torch.where(sorted_key < num_experts,
                       torch.cat([starts, starts.new_full((1,), cap)])[sorted_key] + pos_in_run,
                       torch.full_like(sorted_key, cap))
    sorted_ids = torch.full((cap + 1,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, cap, block_m, device=dev)
    expert = torch.searchsorted(ends, block_starts, right=True)  # [P / block_m]
    block_expert = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return sorted_ids[:cap], block_expert, padded.sum().reshape(1).to(torch.int32)


@triton.jit(do_not_specialize=["n", "cap"])
def _moe_align_kernel(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                      n, num_experts, cap,
                      BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_BINS: tl.constexpr,
                      GROUP: tl.constexpr, BLOCKS: tl.constexpr):
    """``moe_align`` in one launch of cdiv(E, GROUP) + 1 programs. Program g owns
    experts [g GROUP, (g+1) GROUP), whose runs are contiguous in ``sorted_ids``: it
    counts the pairs of every expert (a histogram over all the ids; bin E collects
    dropped ids and the lanes past n) for where its first run begins, then writes its
    experts' pairs in pair order (a prefix count of ``id == e`` along the pairs, so the
    order is the stable sort's), their padding rows and the expert of their row blocks.
    The last program writes the tail past the last run and num_padded. Each output
    element is written by exactly one program: no atomics, no host sync."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, CHUNK)
    bins = tl.arange(0, E_BINS)
    g0 = pid * GROUP
    ex = g0 + tl.arange(0, GROUP)  # this program's experts
    ex_ok = ex < num_experts
    counts = tl.zeros((E_BINS,), dtype=tl.int32)
    for c0 in range(0, n, CHUNK):
        i = c0 + lanes
        raw = tl.load(ids_ptr + i, mask=i < n, other=-1)
        key = tl.where((raw >= 0) & (raw < num_experts), raw, num_experts).to(tl.int32)
        counts += tl.histogram(key, E_BINS)
    padded_all = tl.where(bins < num_experts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    fill = tl.zeros((CHUNK,), dtype=tl.int32) + n  # the padding row id
    if g0 < num_experts:
        base = tl.sum(tl.where(bins < g0, padded_all, 0), 0)  # where run g0 begins
        cnt = tl.zeros((GROUP,), dtype=tl.int32)
        for c0 in range(0, n, CHUNK):
            i = c0 + lanes
            raw = tl.load(ids_ptr + i, mask=i < n, other=-1)
            hit = ((raw[None, :] == ex[:, None]) & ex_ok[:, None]).to(tl.int32)
            cnt += tl.sum(hit, 1)
        padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = base + tl.cumsum(padded, 0)
        starts = ends - padded
        seen = tl.zeros((GROUP,), dtype=tl.int32)
        for c0 in range(0, n, CHUNK):
            i = c0 + lanes
            raw = tl.load(ids_ptr + i, mask=i < n, other=-1)
            hit = ((raw[None, :] == ex[:, None]) & ex_ok[:, None]).to(tl.int32)
            rank = seen[:, None] + tl.cumsum(hit, 1) - hit  # pairs of e before this one
            tl.store(sorted_ids_ptr + starts[:, None] + rank,
                     (i[None, :] + 0 * rank).to(tl.int32), mask=hit != 0)
            seen += tl.sum(hit, 1)
        # padding rows: fewer than BLOCK_M per expert
        pos = (starts + cnt)[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ids_ptr + pos, (pos * 0 + n).to(tl.int32), mask=pos < ends[:, None])
        # row blocks of the group's runs: expert = g0 + (runs ending at or before it)
        group_end = base + tl.sum(padded, 0)
        for b0 in range(base // BLOCK_M, group_end // BLOCK_M, BLOCKS):
            b = b0 + tl.arange(0, BLOCKS)
            done = (ends[None, :] <= b[:, None] * BLOCK_M).to(tl.int32)
            tl.store(block_expert_ptr + b, g0 + tl.sum(done, 1),
                     mask=b < group_end // BLOCK_M)
    else:
        total = tl.sum(padded_all, 0)
        for p0 in range(total, cap, CHUNK):
            pos = p0 + lanes
            tl.store(sorted_ids_ptr + pos, fill, mask=pos < cap)
        for b0 in range(total // BLOCK_M, cap // BLOCK_M, CHUNK):
            b = b0 + lanes
            tl.store(block_expert_ptr + b, fill * 0 - 1, mask=b < cap // BLOCK_M)
        tl.store(num_padded_ptr, total)


def fast_align_fits(num_pairs: int, num_experts: int, device: torch.device) -> bool:
    """Whether ``moe_align_fast`` serves this step: small enough, and a device its
    kernel runs on (CUDA, or the CPU under TRITON_INTERPRET=1 in tests)."""
    return (num_pairs <= FAST_ALIGN_MAX_PAIRS and num_experts <= FAST_ALIGN_MAX_EXPERTS
            and (device.type == "cuda" or envs.triton_interpret()))


def moe_align_fast(topk_ids: torch.Tensor, num_experts: int, block_m: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align`` (same outputs, element for element) in one Triton launch; any
    number of pairs works, ``fast_align_fits`` says when it is the faster path."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    cap = align_capacity(n, num_experts, block_m)
    dev = flat.device
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    block_expert = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    # at least one lane per thread (4 warps): tl.histogram's GPU lowering counts each
    # lane a thread holds, and lanes broadcast over spare threads would be counted again
    chunk = max(128, triton.next_power_of_2(min(max(n, 1), 1024)))
    # experts per program: a [GROUP, CHUNK] tile of about 4096 comparisons
    group = max(1, min(triton.next_power_of_2(num_experts), _ALIGN_TILE // chunk))
    _moe_align_kernel[(triton.cdiv(num_experts, group) + 1,)](
        flat, sorted_ids, block_expert, num_padded, n, num_experts, cap,
        BLOCK_M=block_m, CHUNK=chunk,
        E_BINS=max(32, triton.next_power_of_2(num_experts + 1)),  # >= a warp's lanes
        GROUP=group, BLOCKS=max(16, _ALIGN_TILE // group // 4), num_warps=4)
    return sorted_ids, block_expert, num_padded


@triton.jit
def _load_w(ptrs, mask, a, W_FP8: tl.constexpr):
    """A [BK, BN] weight tile in a's dtype, zero where masked. Float8 tiles take no
    ``other`` (a constant does not cast to float8): converted first, masked lanes zeroed."""
    if W_FP8:  # if/else, not an early return: see _dequant_w4
        w = tl.where(mask, tl.load(ptrs, mask=mask).to(a.dtype), 0.0).to(a.dtype)
    else:
        w = tl.load(ptrs, mask=mask, other=0).to(a.dtype)
    return w


@triton.jit
def _dequant_w4(w, shift, s_ptrs, o_ptrs, col_ok, stride_sg, k_left,
                HAS_OFFSET: tl.constexpr, BLOCK_K: tl.constexpr, W4_GROUP: tl.constexpr):
    """A [BK, BN] tile of packed bytes (each input's byte) -> its float32 weights. One
    group per tile (BLOCK_K <= W4_GROUP): one row of scales (and offsets) [BN] broadcast
    down K; else BLOCK_K / W4_GROUP rows, each over its group of K rows (those past the
    ``k_left`` inputs left are not read)."""
    v = ((w.to(tl.int32) >> shift) & 15).to(tl.float32)
    # if/else, not an early return: the compiler (unlike the interpreter) builds the code
    # after a constexpr branch's return too, where tl.arange(0, 0) does not compile
    if BLOCK_K <= W4_GROUP:
        s = tl.load(s_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_OFFSET:
            out = v * s + tl.load(o_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        else:
            out = (v - 8.0) * s
    else:
        GROUPS: tl.constexpr = BLOCK_K // W4_GROUP
        gi = tl.arange(0, GROUPS)[:, None]  # [G, 1]
        g = gi * stride_sg
        g_ok = (gi * W4_GROUP < k_left) & col_ok[None, :]
        s3 = tl.load(s_ptrs[None, :] + g, mask=g_ok, other=0.0).to(tl.float32)
        v3 = tl.reshape(v, (GROUPS, W4_GROUP, v.shape[1]))  # [G, group, BN]
        if HAS_OFFSET:
            o = tl.load(o_ptrs[None, :] + g, mask=g_ok, other=0.0).to(tl.float32)
            w3 = v3 * s3[:, None, :] + o[:, None, :]
        else:
            w3 = (v3 - 8.0) * s3[:, None, :]
        out = tl.reshape(w3, (BLOCK_K, v.shape[1]))
    return out


# num_pairs (T*k) only bounds a mask: not specialized, so one compile serves every batch
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, scale_ptr, offset_ptr, sorted_ids_ptr,
                     block_expert_ptr, num_padded_ptr, topk_w_ptr, N, K, num_pairs,
                     a_row_div, stride_am, stride_we, stride_wn, stride_om, stride_se,
                     stride_sg,
                     GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr,
                     W4_GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, W_FP8: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[pair, n] = sum_k a[pair // a_row_div, k] * w[e, n, k] for the pairs of one row
    block (all of expert e). GATED: w holds 2N rows (gate, up) and out gets
    silu(gate) * up. MUL_WEIGHT: out *= topk_w[pair]. DOT_PRECISION: "ieee" for float32
    operands (full-precision products; the default, TF32, keeps 10 mantissa bits),
    "tf32" otherwise (no effect on 16-bit operands: they stay on the tensor cores).

    Weight forms: float, int8 or float8 tiles converted to the activation dtype in
    registers (HAS_SCALE: per-channel scales scale_ptr [E, N] on the accumulator); or,
    W4_GROUP > 0, int4 packed along K (w [E, N, K / 2] uint8, input 2j in the low nibble
    of byte j, 2j + 1 in the high one) with per-group scales scale_ptr [E, K / W4_GROUP,
    N] and, HAS_OFFSET, offsets offset_ptr of the same layout: w = v * scale + offset
    (without offsets, (v - 8) * scale), dequantized per tile before the dot. A tile
    covers part of one group or whole groups (BLOCK_K and W4_GROUP powers of two)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows).to(tl.int64)  # [BM]
    row_ok = pairs < num_pairs
    a_rows = pairs // a_row_div
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]  # [BM, BK]
    w_base = w_ptr + e * stride_we
    if W4_GROUP > 0:  # two inputs per byte: lanes 2j and 2j + 1 read byte j
        w_ptrs = w_base + cols[None, :] * stride_wn + (ks // 2)[:, None]  # [BK, BN]
        shift = ((ks % 2) * 4)[:, None]  # [BK, 1]
        s_ptrs = scale_ptr + e * stride_se + cols  # [BN], group 0
        o_ptrs = offset_ptr + e * stride_se + cols
    else:
        w_ptrs = w_base + cols[None, :] * stride_wn + ks[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        u_ptrs = w_ptrs + N * stride_wn
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # CPU interpreter: its tl.dot multiplies bf16 as raw uint16
            a = a.to(tl.float32)
        w_ok = k_ok[:, None] & col_ok[None, :]
        if W4_GROUP > 0:
            g_off = (k0 // W4_GROUP) * stride_sg
            w = _dequant_w4(tl.load(w_ptrs, mask=w_ok, other=0), shift, s_ptrs + g_off,
                            o_ptrs + g_off, col_ok, stride_sg, K - k0, HAS_OFFSET, BLOCK_K,
                            W4_GROUP)
        else:
            w = _load_w(w_ptrs, w_ok, a, W_FP8)
        acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION)
        if GATED:
            if W4_GROUP > 0:
                u = _dequant_w4(tl.load(u_ptrs, mask=w_ok, other=0), shift,
                                s_ptrs + g_off + N, o_ptrs + g_off + N, col_ok, stride_sg,
                                K - k0, HAS_OFFSET, BLOCK_K, W4_GROUP)
            else:
                u = _load_w(u_ptrs, w_ok, a, W_FP8)
            acc_u += tl.dot(a, u.to(a.dtype), input_precision=DOT_PRECISION)
            if W4_GROUP > 0:
                u_ptrs += BLOCK_K // 2
            else:
                u_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        if W4_GROUP > 0:
            w_ptrs += BLOCK_K // 2
        else:
            w_ptrs += BLOCK_K
    if HAS_SCALE:
        s_base = scale_ptr + e * stride_se
        acc *= tl.load(s_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u *= tl.load(s_base + N + cols, mask=col_ok, other=0.0).to(
                tl.float32)[None, :]
    if GATED:
        # rounded like the reference: silu(gate) in the activation dtype, times up
        g = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = act * acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
    if MUL_WEIGHT:
        acc *= tl.load(topk_w_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


# Launch rows for a GPU without measured ones (the tuning data's ``fused_moe``): a
# 16-row block for decode-sized steps, larger tiles as tokens grow.
DEFAULT_CONFIGS = (
    {"max_tokens": 32, "block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4,
     "num_stages": 3},
    {"max_tokens": 256, "block_m": 32, "block_n": 64, "block_k": 64, "num_warps": 4,
     "num_stages": 3},
    {"max_tokens": 1_000_000_000, "block_m": 64, "block_n": 128, "block_k": 64,
     "num_warps": 8, "num_stages": 3},
)


@functools.cache
def _launch_rows(device: torch.device) -> tuple | list:
    """The device's measured launch rows (``kernels/tuning/<gpu>.json``, ``fused_moe``),
    else ``DEFAULT_CONFIGS``; looked up once per device (every MoE layer's forward asks)."""
    if device.type != "cuda":
        return DEFAULT_CONFIGS
    from kvflow.kernels import tuning

    return tuning.current(device).fused_moe or DEFAULT_CONFIGS


def fused_moe_config(num_tokens: int, device: torch.device) -> dict:
    """BLOCK_M / BLOCK_N / BLOCK_K / num_warps / num_stages for a step of ``num_tokens``:
    the entry of the largest ``max_tokens`` bound that covers it."""
    table = _launch_rows(device)
    for entry in table:
        if num_tokens <= entry["max_tokens"]:
            return entry
    return table[-1]


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              config: dict | None = None, fast_align: bool | None = None,
              may_drop: bool = True, *, w13_offset: torch.Tensor | None = None,
              w2_offset: torch.Tensor | None = None, w4_group: int = 0) -> torch.Tensor:
    """x [T, H] through the routed experts -> [T, H] in x's dtype (see the module doc).
    ``w13_scale`` [E, 2I] / ``w2_scale`` [E, H]: per-channel scales of int8 or float8
    weights. ``w4_group`` > 0: int4 experts in ``pack_int4_experts``'s layout (w13
    [E, 2I, H / 2], w2 [E, H, I / 2] uint8; scales and offsets [E, K / group, N]).
    ``fast_align``: force (True) or refuse (False) the one-launch align kernel; None:
    ``fast_align_fits`` decides. ``may_drop=False``: the caller guarantees every id is
    in [0, E) (no expert parallelism), so no output row needs zeroing."""
    t = x.shape[0]
    e = w13.shape[0]
    cfg = config or fused_moe_config(t, x.device)
    if fast_align is None:
        fast_align = fast_align_fits(topk_ids.numel(), e, x.device)
    align = (moe_align_fast if fast_align else moe_align)(topk_ids, e, cfg["block_m"])
    out = moe_gemms(x, w13, w2, topk_weights, topk_ids.shape[1], align, cfg,
                    w13_scale, w2_scale, may_drop, w13_offset=w13_offset,
                    w2_offset=w2_offset, w4_group=w4_group)
    return out.view(t, topk_ids.shape[1], -1).sum(dim=1)


def moe_gemms(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, top_k: int,
              align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cfg: dict,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              may_drop: bool = True, *, w13_offset: torch.Tensor | None = None,
              w2_offset: torch.Tensor | None = None, w4_group: int = 0) -> torch.Tensor:
    """The two grouped-GEMM launches over an aligned routing (``moe_align``'s outputs
    for ``cfg``'s block_m) -> the weighted expert output of each pair [T*k, H]. The rows
    of dropped pairs are zero (``may_drop``) or, when there are none, never touched.
    Int4 tiles (``w4_group``) cover part of a group or whole groups."""
    t, h = x.shape
    k = top_k
    inter = w13.shape[1] // 2
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    if w4_group and bk > w4_group and bk % w4_group:
        bk = w4_group  # a tile holds whole groups
    launch = dict(num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    sorted_ids, block_expert, num_padded = align
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()  # [T*k]
    act = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    # zeros: rows of dropped pairs (ids -1, another rank's experts) are never written;
    # without such pairs every row is, and the fill would be one more kernel per layer
    out = (torch.zeros if may_drop else torch.empty)((t * k, h), dtype=x.dtype,
                                                       device=x.device)
    x = x.contiguous()
    blocks_m = sorted_ids.numel() // bm
    dummy = weights
    launch["UPCAST"] = x.device.type == "cpu" and x.dtype == torch.bfloat16
    launch["DOT_PRECISION"] = "ieee" if x.dtype == torch.float32 else "tf32"
    launch["W4_GROUP"] = w4_group
    launch["HAS_OFFSET"] = w13_offset is not None
    launch["W_FP8"] = w13.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    for a, w, scale, offset, out_t, n, kk, div, gated in (
            (x, w13, w13_scale, w13_offset, act, inter, h, k, True),
            (act, w2, w2_scale, w2_offset, out, h, inter, 1, False)):
        _moe_gemm_kernel[(blocks_m * triton.cdiv(n, bn),)](
            a, w, out_t, scale if scale is not None else dummy,
            offset if offset is not None else dummy, sorted_ids, block_expert, num_padded,
            weights, n, kk, t * k, div, a.stride(0), w.stride(0), w.stride(1),
            out_t.stride(0), scale.stride(0) if scale is not None else 0,
            scale.stride(1) if w4_group else 0,
            GATED=gated, MUL_WEIGHT=not gated, HAS_SCALE=scale is not None and not w4_group,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **launch)
    return out


def pack_int4_experts(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                      dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Int4 experts (``Int4Groups`` convention, stacked: values uint8 [E, N, K] in 0..15,
    scale / zero [E, N, K / g], w = (v - 8) * scale + zero; zero None: symmetric) ->
    the kernel's layout: (packed uint8 [E, N, K / 2], input 2j in the low nibble of
    byte j; scale [E, K / g, N]; offset [E, K / g, N] = zero - 8 scale, w = v * scale +
    offset, or None), scales and offsets in ``dtype`` (the activations')."""
    v = values.to(torch.uint8)
    packed = (v[..., 0::2] | (v[..., 1::2] << 4)).contiguous()
    s = scale.float()
    offset = None
    if zero is not None:
        offset = (zero.float() - 8.0 * s).transpose(1, 2).to(dtype).contiguous()
    return packed, s.transpose(1, 2).to(dtype).contiguous(), offset


def dequantize_int4_experts(packed: torch.Tensor, scale: torch.Tensor,
                            offset: torch.Tensor | None, group: int) -> torch.Tensor:
    """The float32 weights [E, N, K] of ``pack_int4_experts``'s layout (the reference)."""
    v = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).float()  # [E, N, K]
    s = scale.float().transpose(1, 2).repeat_interleave(group, dim=-1)  # [E, N, K]
    if offset is None:
        return (v - 8.0) * s
    return v * s + offset.float().transpose(1, 2).repeat_interleave(group, dim=-1)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The per-expert reference: for each expert, its tokens' gated MLP, weighted and
    added into their rows. x [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = x[tok] @ w13[e].t()  # [n, 2I]
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        y = (h @ w2[e].t()).float() * topk_weights[tok, slot, None].float()  # [n, H]
        out.index_add_(0, tok, y)
    return out.to(x.dtype)
