"""Batch-invariant dense matmul: ``y = x W^T (+ b)`` whose row r is the same bits whatever
the other rows of ``x`` are, and however many there are (``--deterministic``,
docs/determinism.md).

Reference: ``torch.nn.functional.linear`` (same math, rounded once from float32; cuBLAS
picks its algorithm, tiles and split-K by M, so its rows change with the batch).

Layouts: x [M, K] (any strides), weight [N, K] (a linear layer's, any strides), bias [N]
or None -> y [M, N] in x's dtype.

Why the rows cannot move: each output element y[m, n] is summed by one program, in float32,
over K in BLOCK_K chunks from k = 0 upward (``acc = tl.dot(a, w, acc)``; inside a chunk the
tensor-core instruction's own k-steps). BLOCK_K and the dtype's instruction are the same
for every M; no split-K, no atomics, no stream-K. BLOCK_M and BLOCK_N only choose which
program owns an element, not the order of its sum, so they may follow M: decode-sized
batches (M <= 64) take 64 x 64 tiles (more programs over N where M gives none),
larger ones 128 x 128. Both are multiples of 64 rows, so on Hopper both run wgmma (one
warpgroup per 64 rows); a smaller BLOCK_M would switch bf16 to mma.sync, a different
instruction, which is why there is none (tests/test_batch_invariant_gpu.py checks rows
across M on the GPU; tests/kernels/test_batch_invariant_kernel.py the loop in the
interpreter). Rows past M and columns past N read clamped (valid) addresses and are not
stored; a K tail is loaded as zeros, which add exactly nothing.

Tiles (bf16 / fp16): M <= 64: 64 x 64 x 64, 4 warps, 4 stages (64 KB of shared memory);
M > 64: 128 x 128 x 64, 8 warps, 3 stages (96 KB); grouped program order (GROUP_M = 8)
for L2 reuse of W. float32: BLOCK_K = 32, IEEE products.

Expected traffic: W once per BLOCK_M rows (N*K*elem per 64 or 128 rows of x), x once
per BLOCK_N columns. At decode sizes the whole cost is reading W, over N / 64 programs
(Llama-3.1-8B o_proj, N = 4096: 64 programs on a 132-SM GPU, so below the HBM roofline
that cuBLAS's split-K reaches: the price of the fixed order, measured by the
``deterministic`` stage of benchmarks/gpu/run.sh).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_SMALL_M = 64  # batches up to this many rows take the small tiles


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int  # the reduction order: the same for every M of a dtype
    num_warps: int
    num_stages: int


def block_k(dtype: torch.dtype) -> int:
    """The K chunk of ``dtype``'s products, fixed whatever M is."""
    return 32 if dtype == torch.float32 else 64


def matmul_config(m: int, dtype: torch.dtype) -> MatmulConfig:
    """Launch shape for an M-row product; only BLOCK_M / BLOCK_N and the launch follow M."""
    bk = block_k(dtype)
    if m <= _SMALL_M:
        return MatmulConfig(64, 64, bk, 4, 4 if bk == 64 else 3)
    return MatmulConfig(128, 128, bk, 8, 3 if bk == 64 else 2)


@triton.jit
def _bi_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_xk, stride_wn,
                      stride_wk, stride_ym, stride_yn,
                      HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles walk N together (W tiles reused from L2)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows / columns read row M-1 / column N-1 again (never stored).
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
    w_ptrs = w_ptr + rn[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # k = 0 upward, one chunk at a time: the fixed order
        if EVEN_K:
            a = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            # CPU interpreter: its tl.dot is numpy's matmul, whose per-element order
            # depends on where a row sits in the tile (and bf16 it multiplies as raw
            # uint16); this chunk product sums each element's K chunk the same way for
            # every row, so the tests see the loop's own order.
            prod = a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=1)
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym \
        + offs_n.to(tl.int64)[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: MatmulConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with rows independent of the batch: x [..., K],
    weight [N, K], bias [N] -> [..., N] in x's dtype. ``config`` overrides the launch
    shape (tests; BLOCK_K must stay ``block_k(dtype)`` for the guarantee)."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert weight.shape[1] == k and x.dtype == weight.dtype, (x.shape, weight.shape)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*x.shape[:-1], n)
    if k == 0:
        y.zero_()
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], n)
    cfg = config or matmul_config(m, x.dtype)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _bi_matmul_kernel[grid](
        x2, weight, bias if bias is not None else weight, y, m, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0),
        y.stride(1), HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=x.device.type == "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.reshape(*x.shape[:-1], n)


__all__ = ["MatmulConfig", "block_k", "matmul", "matmul_config"]
