"""Weight-only int4 GEMM for the GPU: ``y = x @ W^T`` with W kept in 4 bits.

Layout (written once at load by ``pack_int4``; every 4-bit format is repacked into it):

- ``qweight`` int32 [N, K / 8]: row n holds W[n, :] with 8 values per word along K,
  value k in nibble ``k % 8`` (bits ``4 (k % 8)`` ..) of word ``k // 8``. Rows run along K,
  so a program's weight tile [BLOCK_N, BLOCK_K / 8] words is BLOCK_N contiguous runs of
  BLOCK_K / 2 bytes (64 bytes at BLOCK_K 128): coalesced, 16 bytes per thread.
- ``scale`` [N, K / G] and ``bias`` [N, K / G] in the activation dtype (bf16/fp16), one
  per group of G inputs (G = 32, 64, 128, ...): ``w = q * scale + bias`` for q in 0..15.
  In the seam's ``Int4Groups`` form (``w = (v - 8) * s + z``) that is ``bias = z - 8 s``,
  which for GGUF Q4_1 and asymmetric round-to-nearest is exactly the group minimum.
  Symmetric weights store no bias (``bias=None``: w = (q - 8) * scale).

Reference: ``w4a16_ref`` (dequantize to float32, matmul, round to x's dtype).

Algorithm: grid ``(cdiv(M, BM) * cdiv(N, BN), split_k)``. Each program walks its share
of the K tiles; per tile it loads the packed words, unpacks them with shifts into
[BN, BK / 8, 8], views that as [BN, groups-in-tile, G] to apply each group's scale and
bias with one FMA per weight in the activation dtype, and multiplies with the
activation tile [BM, BK] (``tl.dot`` into float32, or for one row a multiply and
``tl.sum``). One split stores its tile in the output dtype; several add float32 partials
atomically into a zeroed workspace that is cast after (``woq_config``).

Traffic: N K / 2 bytes of weight + 2 N K / G * elem bytes of scales and biases + M K and
M N activations. Llama-3.1-8B down_proj (N 4096, K 14336, G 128, bf16) at M = 1: 29.4 MB
+ 1.8 MB, about 6.5 us at 4.8 TB/s, against 117 MB (24 us) for the bf16 weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.woq_config import WoqConfig, choose_config, finish_split


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                  split_k,
                  GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
                  DOT: tl.constexpr, UPCAST: tl.constexpr):
    # Groups of GROUP inputs inside one K tile (1 when the tile is inside one group).
    GPT: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1
    GL: tl.constexpr = BLOCK_K // GPT
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_ok = offs_m < M
    n_ok = offs_n < N
    kw = K // 8  # words per row
    kg = K // GROUP  # groups per row
    rows_w = offs_n.to(tl.int64)[:, None] * kw  # [BN, 1]
    rows_g = offs_n.to(tl.int64)[:, None] * kg
    shifts = (tl.arange(0, 8) * 4)[None, None, :]  # [1, 1, 8]
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t_start, t_end):
        k0 = t * BLOCK_K
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK / 8] word indices
        words = tl.load(qw_ptr + rows_w + offs_w[None, :],
                        mask=n_ok[:, None] & (offs_w < kw)[None, :], other=0)
        q = (words[:, :, None] >> shifts) & 0xF  # [BN, BK / 8, 8], value k0 + 8 w + i
        q = tl.reshape(q, (BLOCK_N, GPT, GL))  # [BN, GPT, GL], in k order
        offs_g = k0 // GROUP + tl.arange(0, GPT)  # [GPT]
        g_mask = n_ok[:, None] & (offs_g < kg)[None, :]
        s = tl.load(s_ptr + rows_g + offs_g[None, :], mask=g_mask, other=0.0)  # [BN, GPT]
        if HAS_BIAS:
            b = tl.load(b_ptr + rows_g + offs_g[None, :], mask=g_mask, other=0.0)
        else:
            b = s.to(tl.float32) * -8.0
        # Dequantize in float32 (one FMA per weight), then round to the activation dtype
        # for the dot. (Triton's CPU interpreter computes bf16 arithmetic on raw bits.)
        w = q.to(tl.float32) * s.to(tl.float32)[:, :, None] + b.to(tl.float32)[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)  # [BM, BK]
        w = w.to(x.dtype)  # the weight as the dense model would hold it
        if DOT and UPCAST:  # CPU interpreter: its tl.dot multiplies bf16 as raw uint16
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif DOT:
            acc += tl.dot(x, tl.trans(w))
        else:  # one row: [1, 1, BK] * [1, BN, BK] summed over K
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :],
                          axis=2)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    o_mask = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:  # split-K: float32 partial sums into the zeroed workspace
        tl.atomic_add(o_ptrs, acc, mask=o_mask)
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] (K a multiple of 8) -> int32 words [N, K / 8]."""
    n, k = values.shape
    v = values.to(torch.int32).view(n, k // 8, 8)
    shifts = torch.arange(8, dtype=torch.int32, device=values.device) * 4
    return (v << shifts).sum(-1, dtype=torch.int32).contiguous()  # disjoint bits: sum = or


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 words [N, K / 8] -> int64 values 0..15 [N, K] (the layout's definition)."""
    shifts = torch.arange(8, dtype=torch.int64, device=qweight.device) * 4
    return ((qweight.to(torch.int64).unsqueeze(-1) >> shifts) & 15).flatten(1)


def dequantize_int4(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    group: int) -> torch.Tensor:
    """The float32 weight [N, K] the packed tensors stand for."""
    q = unpack_int4(qweight).float()
    s = scale.float().repeat_interleave(group, dim=1)
    b = -8.0 * s if bias is None else bias.float().repeat_interleave(group, dim=1)
    return q * s + b


def w4a16_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """Reference: the weight dequantized and rounded to x's dtype (as a dense model holds
    it), x [M, K] @ W^T in float32 -> [M, N] in x's dtype."""
    w = dequantize_int4(qweight, scale, bias, group).to(x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, group: int, config: WoqConfig | None = None
               ) -> torch.Tensor:
    """x [M, K] (bf16/fp16, unit stride along K) @ W^T -> [M, N] in x's dtype.

    ``qweight`` int32 [N, K / 8], ``scale``/``bias`` [N, K / group] in x's dtype
    (``bias`` None: symmetric). ``config`` overrides the launch heuristic (benchmarks,
    tests)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.shape == (n, k // 8) and k % group == 0 and x.stride(1) == 1
    assert scale.shape == (n, k // group) and scale.dtype == x.dtype
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or choose_config(m, n, k, x.device, bits=4)
    acc = None if cfg.split_k == 1 else torch.zeros((m, n), dtype=torch.float32,
                                                    device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    _w4a16_kernel[grid](
        x, qweight, scale, bias if bias is not None else scale,
        out if acc is None else acc, m, n, k, x.stride(0), n, cfg.split_k,
        GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, ATOMIC=acc is not None, DOT=cfg.dot,
        UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return finish_split(acc, out)
