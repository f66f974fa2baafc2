"""Residual add + RMSNorm + the activation's FP8 quantization folded into the FP8 W8A8 decode
GEMV: ``r = x + residual``, ``y = rms_norm(r) @ W^T`` with W float8_e4m3fn [N, K] and one
scale per output channel (optionally ``silu(gate) * up`` of it, optionally written in FP8
for the down GEMV), in one launch instead of ``rms_norm.rms_norm_fp8`` and then
``gemv_fp8``.

Why: at batch 1 the norm launch before qkv and before gate/up is a kernel of its own
(a few us of launch, ramp and drain) in front of a 15-30 us weight stream. The dense
path folds it away (``gemv_norm.py``); this is the same fold for the FP8 tensor-core GEMV.

Algorithm: RMSNorm scales each row by one number, so ``rms_norm(r) W^T = rstd * ((r *
w_norm) W^T)`` with ``rstd = rsqrt(mean(r^2) + eps)``. Grid ``(cdiv(N, BLOCK_N),
split_k)`` as ``gemv_fp8``: each program streams its K range of the weight (the wgmma's
wide operand, from the pipelined shared-memory stages) and builds the activation tile on
the fly from the x, residual and norm-weight tiles (L2-resident; loaded by hand one K step
ahead, since loads that do not feed ``tl.dot`` directly are not pipelined):
``h_t = r_t * w_norm_t`` rounded to bf16, quantized to FP8 with its own scale per row and
K tile ``s_t = max|h_t| / 448`` (the ``XGROUP`` numerics of ``gemv_fp8``: the tile's dot
starts from zero and is scaled by s_t before it goes into the float32 accumulator). The
per-tile scale is what makes the fold possible: a per-token scale would need the whole
row's max before the first dot. The row's sum of squares of r is accumulated beside the
dot; the split-K sum adds the squares with the partials (workspace + arrival counter, as
``gemv_norm``), then ``y = acc * sw[n] * rstd[m]`` goes out through ``store_output`` /
``gemv.store_silu_pair`` / ``gemv_fp8._store_silu_mul_fp8``. The programs of the first
column tile write their K range of r (a fresh tensor: every program reads x/residual).

Numerics: r rounded to bf16 (as ``fused_add_rms_norm``); h rounded to bf16 before the
quantization and rstd applied to the float32 sums, where the unfused path rounds
``r * rstd`` then the product with w_norm and quantizes per token: per-tile scales are
finer (each tile's max maps to 448), the bf16 rounding is the same size in another
place. Products of two FP8 values are exact; on the GPU the MMA sums one K step in its
reduced precision (~13-14 bits, ``gemv_fp8``'s promotion at 0: once per BLOCK_K).
Reference: ``gemv_fp8_rms_norm_ref`` (the same per-tile quantization,
``quantize_fp8_ref(h, group=block_k)``, float32 sums of the exact products).

Traffic: as ``gemv_fp8`` (N K bytes of weight) plus x and residual read by every program
from L2 (2 * M * K * 2 bytes per program's K range) and r written once; no xq / scale
round trip through memory and one launch fewer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvflow.kernels.fp8_quant import F8INV, F8MAX, quantize_fp8_ref, round_e4m3
from kvflow.kernels.gemv import _pdl_args, silu_buffers, store_silu_pair
from kvflow.kernels.gemv_fp8 import _store_silu_mul_fp8
from kvflow.kernels.gemv_norm import _load_x_side, one_row
from kvflow.kernels.pdl import pdl_trigger, pdl_wait, prefetch_tiles
from kvflow.kernels.woq_config import LOCK_SLOTS, store_output

MAX_M = 8  # decode rows (the MMA tile has 16; the x side is built on at most 16)


@triton.jit
def _round_bf16(v, EMULATE: tl.constexpr):
    """float32 -> bfloat16, rounded to nearest even. The interpreter's cast truncates, so
    there the value is first rounded onto the bf16 grid in float32 (add half an ulp less
    one, plus the kept lsb, then drop the low 16 bits; finite values), and the cast is
    exact: r and h then have the GPU's bits under the interpreter too."""
    if EMULATE:
        u = v.to(tl.int32, bitcast=True)
        u = (u + (0x7FFF + ((u >> 16) & 1))) & -65536
        v = u.to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _quantize_tile(h, EMULATE: tl.constexpr):
    """h [XR, BK] float32 (bf16 values) -> (FP8 [XR, BK], scales [XR]) as
    ``quantize_fp8(h, group=BK)``: s = max|h| / 448 (1 for a zero row), q = rne(h / s)."""
    s = tl.max(tl.abs(h), axis=1) * F8INV  # [XR]
    s = tl.where(s > 0, s, 1.0)
    v = tl.clamp(tl.math.div_rn(h, s[:, None]), -F8MAX, F8MAX)
    if EMULATE:  # the interpreter's cast does not round to nearest even
        v = round_e4m3(v)
    return v.to(tl.float8e4nv), s


@triton.jit
def _tile_dot(w, q, UPCAST: tl.constexpr):
    """[BN, BK] x [BM, BK] FP8 -> [BN, BM] float32 (one K step, starting from zero)."""
    if UPCAST:  # CPU interpreter: FP8 values widened exactly, float32 products
        part = tl.dot(w.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")
    else:
        part = tl.dot(w, tl.trans(q))
    return part


@triton.jit
def _gemv_fp8_norm_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, sw_ptr, out_ptr, r_out_ptr, ws_ptr,
                          ssq_ptr, lock_ptr, oscale_ptr, M, N, K, stride_xm, stride_rm,
                          stride_om, split_k, eps,
                          HAS_RES: tl.constexpr, SILU: tl.constexpr, OUT_FP8: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          EVEN_K: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
                          PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
                          X_ROWS: tl.constexpr = 16):
    """N: the output width (SILU: the gate rows; the up rows N.. 2N follow them in w).
    ``X_ROWS``: rows the x side is computed on, 16 or 1 (M = 1: [1, BK] vectors, padded
    to the dot's 16 rows only at the dot, as ``gemv_norm``)."""
    BM: tl.constexpr = 16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BM)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_w = offs_n.to(tl.int64)[:, None] * K  # [BN, 1]
    rows_u = (offs_n + N).to(tl.int64)[:, None] * K  # SILU: the matching up rows
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)
    if PDL:  # weights first (no kernel writes them), then wait for x and the residual
        if SILU:
            prefetch_tiles(w_ptr, rows_w, n_ok, t_start, t_end, BLOCK_K, PREFETCH // 2)
            prefetch_tiles(w_ptr, rows_u, n_ok, t_start, t_end, BLOCK_K, PREFETCH // 2)
        else:
            prefetch_tiles(w_ptr, rows_w, n_ok, t_start, t_end, BLOCK_K, PREFETCH)
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_N, BM), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BM), dtype=tl.float32)
    offs_xm = tl.arange(0, X_ROWS)
    xm_ok = offs_xm < M
    ssq = tl.zeros((X_ROWS,), dtype=tl.float32)
    first_col = (offs_xm * 0 + pid_n) == 0  # [XR]: this program writes r
    # The x side (x, residual, norm weight) feeds the dot only through the add, the norm
    # weight and the quantization, so the pipeliner leaves its loads synchronous (an L2
    # round trip per K step in front of the MMA): prefetched by hand one step ahead.
    ar_k = tl.arange(0, BLOCK_K)
    k_end = t_end * BLOCK_K
    x_nxt, res_nxt, nw_nxt = _load_x_side(x_ptr, res_ptr, nw_ptr, offs_xm, xm_ok,
                                          t_start * BLOCK_K + ar_k, K, k_end, stride_xm,
                                          stride_rm, HAS_RES)
    for t in range(t_start, t_end):
        offs_k = t * BLOCK_K + ar_k  # [BK]
        k_ok = offs_k < K
        if EVEN_K:
            w_mask = n_ok[:, None]
        else:
            w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + rows_w + offs_k[None, :], mask=w_mask, other=0.0,
                    eviction_policy="evict_first")  # [BN, BK], streamed once
        if SILU:
            wu = tl.load(w_ptr + rows_u + offs_k[None, :], mask=w_mask, other=0.0,
                         eviction_policy="evict_first")
        x, res, nw = x_nxt, res_nxt, nw_nxt  # [XR, BK], [XR, BK], [BK]
        x_nxt, res_nxt, nw_nxt = _load_x_side(x_ptr, res_ptr, nw_ptr, offs_xm, xm_ok,
                                              offs_k + BLOCK_K, K, k_end, stride_xm,
                                              stride_rm, HAS_RES)
        if HAS_RES:
            x = _round_bf16(x.to(tl.float32) + res.to(tl.float32), UPCAST)
            tl.store(r_out_ptr + offs_xm[:, None] * K + offs_k[None, :], x,
                     mask=xm_ok[:, None] & k_ok[None, :] & first_col[:, None])
        xf = x.to(tl.float32)
        ssq += tl.sum(xf * xf, axis=1)
        h = _round_bf16(xf * nw.to(tl.float32)[None, :], UPCAST).to(tl.float32)  # unscaled
        q, s = _quantize_tile(h, UPCAST)  # [XR, BK] FP8, [XR]: zero rows past M
        if X_ROWS == 1:  # [1, BK] -> the dot's [BM, BK], rows past the first zero
            q = tl.where((offs_m == 0)[:, None], q, tl.zeros((BM, BLOCK_K), q.dtype))
        acc += _tile_dot(w, q, UPCAST) * s[None, :]  # one group: promoted, then scaled
        if SILU:
            acc_u += _tile_dot(wu, q, UPCAST) * s[None, :]
    pdl_trigger(PDL)  # in the tail: the next kernel may become resident
    if X_ROWS == 1:
        ssq = tl.where(offs_m == 0, tl.sum(ssq, axis=0), 0.0)  # [BM]
    if SPLIT:  # workspace [split_k, 2, M, N] (+ [tiles, split_k, BM] sums of squares)
        o_mask = m_ok[None, :] & n_ok[:, None]  # [BN, BM], the accumulators' layout
        ws = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(ws + pid_k * 2 * M * N, acc, mask=o_mask)
        if SILU:
            tl.store(ws + (pid_k * 2 + 1) * M * N, acc_u, mask=o_mask)
        tl.store(ssq_ptr + (pid_n * split_k + pid_k) * BM + offs_m, ssq)
        tl.debug_barrier()  # every thread's partials are written before the release
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            acc = tl.zeros_like(acc)
            acc_u = tl.zeros_like(acc_u)
            ssq = tl.zeros_like(ssq)
            for j in range(0, split_k):  # in order (deterministic); .cg: read at L2
                acc += tl.load(ws + j * 2 * M * N, mask=o_mask, other=0.0,
                               cache_modifier=".cg")
                if SILU:
                    acc_u += tl.load(ws + (j * 2 + 1) * M * N, mask=o_mask, other=0.0,
                                     cache_modifier=".cg")
                ssq += tl.load(ssq_ptr + (pid_n * split_k + j) * BM + offs_m,
                               cache_modifier=".cg")
            _epilogue(acc, acc_u, ssq, sw_ptr, out_ptr, oscale_ptr, offs_m, offs_n, n_ok, M,
                      N, K, eps, stride_om, pid_n, SILU, OUT_FP8, BLOCK_N, UPCAST)
            tl.atomic_xchg(lock_ptr + pid_n, 0)  # zero again for the next launch
    else:
        _epilogue(acc, acc_u, ssq, sw_ptr, out_ptr, oscale_ptr, offs_m, offs_n, n_ok, M, N,
                  K, eps, stride_om, pid_n, SILU, OUT_FP8, BLOCK_N, UPCAST)


@triton.jit
def _epilogue(acc, acc_u, ssq, sw_ptr, out_ptr, oscale_ptr, offs_m, offs_n, n_ok, M, N, K,
              eps, stride_om, tile, SILU: tl.constexpr, OUT_FP8: tl.constexpr,
              BLOCK_N: tl.constexpr, EMULATE: tl.constexpr):
    """The full K sums [BN, BM] (and the rows' sums of squares [BM]) -> y = acc * sw[n] *
    rstd[m], stored as ``gemv_fp8`` stores its (already reduced) outputs."""
    rstd = tl.rsqrt(ssq / K + eps)[:, None]  # [BM, 1]
    sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=0.0)  # [BN] float32
    y = tl.trans(acc * sw[:, None]) * rstd  # [BM, BN]
    if SILU:
        su = tl.load(sw_ptr + N + offs_n, mask=n_ok, other=0.0)
        u = tl.trans(acc_u * su[:, None]) * rstd
        if OUT_FP8:
            _store_silu_mul_fp8(y, u, out_ptr, oscale_ptr, offs_m, offs_n, M, N, stride_om,
                                tile, BLOCK_N, EMULATE)
        else:
            store_silu_pair(y, u, out_ptr, out_ptr, out_ptr, offs_m, offs_n, M, N,
                            stride_om, tile, 0, 1, False)
    else:
        store_output(y, out_ptr, out_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, tile,
                     0, 1, False)


def gemv_fp8_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None,
                          w_norm: torch.Tensor, eps: float, wq: torch.Tensor, sw: torch.Tensor,
                          group: int, silu_and_mul: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: r = x (+ residual) rounded to x's dtype; h = r * w_norm rounded to x's
    dtype, quantized per row and ``group`` inputs (``quantize_fp8_ref``); y = rstd *
    sum_t s_t (q_t . wq_t) * sw with float32 sums per group -> (y float32 [M, N], r).
    ``silu_and_mul``: y = silu(gate) * up [M, N / 2] rounded as the kernel rounds it
    (gate, up, silu and the product to x's dtype)."""
    m, k = x.shape
    n = wq.shape[0]
    r = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    rf = r.float()
    h = (rf * w_norm.float()[None, :]).to(x.dtype)
    q, s = quantize_fp8_ref(h, group=group)  # [M, K], [M, T]
    t = s.shape[1]
    pad = t * group - k
    qt = F.pad(q.float(), (0, pad)).view(m, t, group)
    wt = F.pad(wq.float(), (0, pad)).view(n, t, group)
    parts = torch.einsum("mtg,ntg->mnt", qt, wt)  # exact products, float32 sums per tile
    acc = (parts * s[:, None, :]).sum(-1)  # [M, N]
    rstd = torch.rsqrt((rf * rf).sum(-1) / k + eps)  # [M]
    y = acc * sw.float()[None, :] * rstd[:, None]
    if silu_and_mul:
        d = n // 2
        g = y[:, :d].to(x.dtype).float()
        u = y[:, d:].to(x.dtype).float()
        y = (F.silu(g).to(x.dtype).float() * u).to(x.dtype)
    return y, r


def gemv_fp8_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, w_norm: torch.Tensor,
                      eps: float, wq: torch.Tensor, sw: torch.Tensor, config,
                      silu_and_mul: bool = False, fp8_out: bool = False,
                      out_dtype: torch.dtype = torch.bfloat16):
    """x [M, K] bf16 (M <= 8, unit stride along K) (+ residual [M, K]) -> (y, r) with
    r = x + residual (x itself without a residual) and y = rms_norm(r; w_norm [K], eps)
    @ dequant(wq [N, K] float8_e4m3fn, per-channel sw [N] float32)^T [M, N] bf16, the
    normed activation quantized to FP8 per row and ``config.block_k`` inputs inside the
    launch. ``silu_and_mul``: wq = [gate; up] (N = 2d rows) -> silu(gate) * up [M, d];
    with ``fp8_out`` (no split-K, d a multiple of ``block_n``) that product quantized per
    row and ``block_n``-wide group -> ((float8 [M, d], float32 scales [M, d / block_n]),
    r). ``config``: a ``woq_gemv_config.WoqGemvConfig`` (``promote`` is not read: each K
    step's dot is one scale group, promoted once). ``out_dtype``: y's dtype (float32: the sums
    unrounded, for tests; the SiLU epilogue rounds gate, up and silu to it too)."""
    m, k = x.shape
    n = wq.shape[0]
    assert m <= MAX_M and x.dtype == torch.bfloat16 and x.stride(1) == 1
    assert wq.shape == (n, k) and wq.is_contiguous() and wq.dtype == torch.float8_e4m3fn
    assert sw.shape == (n,) and sw.dtype == torch.float32 and sw.is_contiguous()
    assert w_norm.shape == (k,) and w_norm.is_contiguous() and w_norm.dtype == x.dtype
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(1) == 1
    n_out = n // 2 if silu_and_mul else n
    assert not silu_and_mul or n == 2 * n_out, "gate and up halves of one size"
    cfg = config
    r = x if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    oscale = None
    if fp8_out:
        assert silu_and_mul and cfg.split_k == 1 and n_out % cfg.block_n == 0
        assert out_dtype == torch.bfloat16, "the SiLU product is rounded to bf16 first"
        out = torch.empty((m, n_out), dtype=torch.float8_e4m3fn, device=x.device)
        oscale = torch.empty((m, n_out // cfg.block_n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n_out), dtype=out_dtype, device=x.device)
    result = (out, oscale) if fp8_out else out
    if m == 0:
        return result, r
    tiles = triton.cdiv(n_out, cfg.block_n)
    ws = ssq = locks = None
    if cfg.split_k > 1:
        assert tiles <= LOCK_SLOTS, f"{tiles} output tiles for split-K (at most {LOCK_SLOTS})"
        # [split_k, 2, M, N] (the up slot unused without silu_and_mul) and the counters
        ws, locks = silu_buffers(cfg, m, n_out, x.device)
        ssq = torch.empty((tiles, cfg.split_k, 16), dtype=torch.float32, device=x.device)
    cpu = x.device.type == "cpu"
    _gemv_fp8_norm_kernel[(tiles, cfg.split_k)](
        x, residual if residual is not None else x, w_norm, wq, sw, out, r,
        out if ws is None else ws, sw if ssq is None else ssq,
        out if locks is None else locks, sw if oscale is None else oscale,
        m, n_out, k, x.stride(0), residual.stride(0) if residual is not None else 0, n_out,
        cfg.split_k, eps, HAS_RES=residual is not None, SILU=silu_and_mul, OUT_FP8=fp8_out,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        SPLIT=ws is not None, UPCAST=cpu, X_ROWS=1 if m == 1 and one_row() else 16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl_args(x.device))
    return result, r
