"""Residual add + RMSNorm folded into the decode GEMV that consumes the normed activations:
``r = x + residual``, ``y = rms_norm(r) @ W^T`` (optionally ``silu(gate) * up`` of it), in
one launch instead of the ``fused_add_rms_norm`` kernel and then the GEMV.

Why it works without a prologue pass: RMSNorm scales each row by one number, so
``rms_norm(r) W^T = rstd * ((r * w_norm) W^T)`` with ``rstd = rsqrt(mean(r^2) + eps)``.
Each program streams its K range of W as ``gemv`` does, builds the activation tile
``r * w_norm`` on the fly from the x and residual tiles (L2-resident, 16 rows at most),
and accumulates the row's sum of squares of r over the same K range beside the dot. The
epilogue (after the split-K sum, which adds the squares as well) multiplies by rstd. The
programs of the first column tile also write their K range of r: the new residual, so
the add costs no launch either (it is a fresh tensor; ``x``/``residual`` are read by
every program and cannot be overwritten in place).

Rounding: r is rounded to x's dtype (as ``fused_add_rms_norm``); the activation tile is
``r * w_norm`` rounded to the dtype and rstd applied to the float32 sums, where the
unfused path rounds ``r * rstd`` and then the product with w_norm: the same size of
error, in a different place (``gemv_rms_norm_ref`` is the unfused math in float32).

Traffic: the weight once (as ``gemv``), plus x and residual read by each program from
L2 (M * K * 2 * elem per program: 16 KB at M = 1, K = 4096: negligible next to a 32 KB
weight tile per step) and r written once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvflow.kernels.gemv import MAX_M, tile_rows
from kvflow.kernels.gemv_config import GemvConfig
from kvflow.kernels.woq_config import LOCK_SLOTS, split_buffers


@triton.jit
def _gemv_norm_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, wu_ptr, out_ptr, r_out_ptr, ws_ptr,
                      ssq_ptr, lock_ptr, M, N, K, stride_xm, stride_rm, stride_om, split_k,
                      eps, HAS_RES: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      SPLIT: tl.constexpr, UPCAST: tl.constexpr,
                      ROWS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile_rows(pid_n, N, BLOCK_N, ROWS)  # ROWS <= BLOCK_N
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_w = offs_n.to(tl.int64)[:, None] * K  # [BN, 1]
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    first_col = (offs_m * 0 + pid_n) == 0  # [BM]: this program writes r
    # The x side (x, residual, norm weight) does not feed tl.dot as loaded, so the
    # pipeliner leaves its loads synchronous: an L2 round trip per K step, exposed. It is
    # prefetched by hand one step ahead instead (registers: [BM, BK] each).
    ar_k = tl.arange(0, BLOCK_K)
    k_end = t_end * BLOCK_K
    x_nxt, res_nxt, nw_nxt = _load_x_side(x_ptr, res_ptr, nw_ptr, offs_m, m_ok,
                                          t_start * BLOCK_K + ar_k, K, k_end, stride_xm,
                                          stride_rm, HAS_RES)
    for t in range(t_start, t_end):
        offs_k = t * BLOCK_K + ar_k  # [BK]
        k_ok = offs_k < K
        if EVEN_K:
            w_mask = n_ok[:, None]
        else:
            w_mask = n_ok[:, None] & k_ok[None, :]
        x_mask = m_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + rows_w + offs_k[None, :], mask=w_mask, other=0.0,
                    eviction_policy="evict_first")  # [BN, BK]
        x, res, nw = x_nxt, res_nxt, nw_nxt  # [BM, BK], [BM, BK], [BK]
        x_nxt, res_nxt, nw_nxt = _load_x_side(x_ptr, res_ptr, nw_ptr, offs_m, m_ok,
                                              offs_k + BLOCK_K, K, k_end, stride_xm,
                                              stride_rm, HAS_RES)
        if HAS_RES:
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
            tl.store(r_out_ptr + offs_m[:, None] * K + offs_k[None, :], x,
                     mask=x_mask & first_col[:, None])
        xf = x.to(tl.float32)
        ssq += tl.sum(xf * xf, axis=1)
        a = (xf * nw.to(tl.float32)[None, :]).to(x.dtype)  # [BM, BK] activation, unscaled
        if UPCAST:  # CPU interpreter: its tl.dot multiplies bf16 as raw uint16
            acc += tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(w, tl.trans(a))
        if ACT:
            wu = tl.load(wu_ptr + rows_w + offs_k[None, :], mask=w_mask, other=0.0,
                         eviction_policy="evict_first")
            if UPCAST:
                acc_u += tl.dot(wu.to(tl.float32), tl.trans(a.to(tl.float32)),
                                input_precision="ieee")
            else:
                acc_u += tl.dot(wu, tl.trans(a))
    gate = tl.trans(acc)  # [BM, BN]
    up = tl.trans(acc_u)
    o_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:  # workspace [split_k, 2, M, N] (+ [split_k, M] sums of squares)
        ws = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws + pid_k * 2 * M * N, gate, mask=o_mask)
        if ACT:
            tl.store(ws + (pid_k * 2 + 1) * M * N, up, mask=o_mask)
        tl.store(ssq_ptr + (pid_n * split_k + pid_k) * BLOCK_M + offs_m, ssq)
        tl.debug_barrier()  # every thread's partials are written before the release
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            gate = tl.zeros_like(gate)
            up = tl.zeros_like(up)
            ssq = tl.zeros_like(ssq)
            for j in range(0, split_k):  # .cg: read at L2, where the other SMs wrote
                gate += tl.load(ws + j * 2 * M * N, mask=o_mask, other=0.0,
                                cache_modifier=".cg")
                if ACT:
                    up += tl.load(ws + (j * 2 + 1) * M * N, mask=o_mask, other=0.0,
                                  cache_modifier=".cg")
                ssq += tl.load(ssq_ptr + (pid_n * split_k + j) * BLOCK_M + offs_m,
                               cache_modifier=".cg")
            _epilogue(gate, up, ssq, K, eps, out_ptr, offs_m, offs_n, stride_om, o_mask, ACT)
            tl.atomic_xchg(lock_ptr + pid_n, 0)  # zero again for the next launch
    else:
        _epilogue(gate, up, ssq, K, eps, out_ptr, offs_m, offs_n, stride_om, o_mask, ACT)


@triton.jit
def _load_x_side(x_ptr, res_ptr, nw_ptr, offs_m, m_ok, offs_k, K, k_end, stride_xm,
                 stride_rm, HAS_RES: tl.constexpr):
    """x, residual [BM, BK] and norm weight [BK] at offs_k (zeros past K or this split)."""
    k_ok = (offs_k < K) & (offs_k < k_end)
    mask = m_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if HAS_RES:
        res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask,
                      other=0.0)
    else:
        res = x
    nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0)
    return x, res, nw


@triton.jit
def _epilogue(gate, up, ssq, K, eps, out_ptr, offs_m, offs_n, stride_om, o_mask,
              ACT: tl.constexpr):
    dt = out_ptr.dtype.element_ty
    rstd = tl.rsqrt(ssq / K + eps)[:, None]  # [BM, 1]
    ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if ACT:
        g = (gate * rstd).to(dt).to(tl.float32)  # as the unfused GEMM stores gate / up
        u = (up * rstd).to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu rounds to the dtype
        tl.store(ptrs, (act * u).to(dt), mask=o_mask)
    else:
        tl.store(ptrs, (gate * rstd).to(dt), mask=o_mask)


def gemv_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                      eps: float, weight: torch.Tensor, silu_and_mul: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: r = x (+ residual) rounded to x's dtype; y = rms_norm(r) @ W^T in float32
    (then silu(gate) * up when ``silu_and_mul``) -> (y, r)."""
    r = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    rf = r.float()
    normed = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = normed @ weight.float().t()
    if silu_and_mul:
        d = y.shape[-1] // 2
        y = F.silu(y[:, :d].to(x.dtype).float()) * y[:, d:].to(x.dtype).float()
    return y.to(x.dtype), r


def gemv_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                  eps: float, weight: torch.Tensor, config: GemvConfig,
                  silu_and_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (+ residual [M, K]) -> (rms_norm(r) @ W^T, r); with ``silu_and_mul`` the
    weight is [gate; up] [2d, K] and the first output silu(gate) * up [M, d]. Without a
    residual, r is x itself (the first layer's embedding)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_and_mul else weight.shape[0]
    assert weight.shape[1] == k and weight.is_contiguous() and weight.dtype == x.dtype
    assert x.stride(1) == 1 and norm_weight.shape == (k,) and norm_weight.is_contiguous()
    assert config.dot and m <= MAX_M, f"GEMV config {config} cannot take {m} rows"
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    r_out = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if m == 0:
        return out, r_out
    cfg = config
    tiles = triton.cdiv(n, cfg.tile_rows)
    ws = ssq = locks = None
    if cfg.split_k > 1:
        assert tiles <= LOCK_SLOTS, f"{tiles} output tiles for split-K (at most {LOCK_SLOTS})"
        # [split_k, 2, M, N]: the up slot stays unused without silu_and_mul
        ws = torch.empty((cfg.split_k, 2, m, n), dtype=torch.float32, device=x.device)
        ssq = torch.empty((tiles, cfg.split_k, cfg.block_m), dtype=torch.float32,
                          device=x.device)
        locks = split_buffers(cfg, m, n, x.device)[1]
    _gemv_norm_kernel[(tiles, cfg.split_k)](
        x, residual if residual is not None else x, norm_weight, weight,
        weight[n:] if silu_and_mul else weight, out, r_out,
        out if ws is None else ws, out if ssq is None else ssq,
        out if locks is None else locks, m, n, k, x.stride(0),
        residual.stride(0) if residual is not None else 0, n, cfg.split_k, eps,
        HAS_RES=residual is not None, ACT=silu_and_mul, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        SPLIT=ws is not None, UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16,
        ROWS=cfg.tile_rows, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, r_out
