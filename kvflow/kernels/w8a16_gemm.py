"""Weight-only int8 GEMM for the GPU: ``y = x @ W^T`` with W kept in 8 bits.

Layout (written once at load; int8 round-to-nearest, GGUF Q8_0 and GPTQ / compressed-
tensors 8-bit are all repacked into it):

- ``qweight`` int8 [N, K], rows along K: a [BLOCK_N, BLOCK_K] tile is BLOCK_N contiguous
  runs of BLOCK_K bytes (128 bytes at BLOCK_K 128), 16 bytes per thread.
- **per output channel** (``group=None``): ``scale`` float32 [N], ``w = q * scale[n]``;
  the scale multiplies the float32 accumulator once at the end, so the dot sees the
  integers themselves (exact in bf16/fp16).
- **group-wise** (``group`` = G, e.g. Q8_0's 32): ``scale`` and ``bias`` [N, K / G] in the
  activation dtype, ``w = q * scale + bias`` (``bias`` None for symmetric formats).

Reference: ``w8a16_ref``. Algorithm, grid and split-K as in ``w4a16_gemm`` (shared
configuration in ``woq_config``), without the unpacking.

Traffic: N K bytes of weight (+ 2 N K / G * elem for group-wise scales). Llama-3.1-8B
gate_up (N 28672, K 4096) at M = 1: 117 MB, about 24 us at 4.8 TB/s (bf16: 235 MB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.woq_config import (WoqConfig, choose_config, split_buffers,
                                      store_output)


@triton.jit
def _w8a16_kernel(x_ptr, qw_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K,
                  stride_xm, stride_om, split_k,
                  GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr):
    GPT: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1  # groups per K tile
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
    kg = K // GROUP
    rows_w = offs_n[:, None] * K  # [BN, 1]
    rows_g = offs_n[:, None] * kg
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t_start, t_end):
        k0 = t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = offs_k < K
        q = tl.load(qw_ptr + rows_w + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0)  # [BN, BK] int8
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        if PER_CHANNEL:
            w = q.to(tl.float32)  # integers: exact in the activation dtype
        else:
            offs_g = k0 // GROUP + tl.arange(0, GPT)  # [GPT]
            g_mask = n_ok[:, None] & (offs_g < kg)[None, :]
            s = tl.load(s_ptr + rows_g + offs_g[None, :], mask=g_mask, other=0.0)
            w = tl.reshape(q.to(tl.float32), (BLOCK_N, GPT, GL)) * s.to(tl.float32)[:, :, None]
            if HAS_BIAS:
                b = tl.load(b_ptr + rows_g + offs_g[None, :], mask=g_mask, other=0.0)
                w += b.to(tl.float32)[:, :, None]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        w = w.to(x.dtype)  # (float32 math above: the interpreter's bf16 arithmetic is wrong)
        if DOT and UPCAST:  # CPU interpreter: its tl.dot multiplies bf16 as raw uint16
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif DOT:
            acc += tl.dot(x, tl.trans(w))
        else:  # one row: [1, 1, BK] * [1, BN, BK] summed over K
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :],
                          axis=2)
    if PER_CHANNEL:
        acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    store_output(acc, out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_om, pid, pid_k,
                 split_k, SPLIT)


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    group: int | None) -> torch.Tensor:
    """The float32 weight [N, K] the int8 tensors stand for."""
    q = qweight.float()
    if group is None:
        return q * scale.float()[:, None]
    w = q * scale.float().repeat_interleave(group, dim=1)
    return w if bias is None else w + bias.float().repeat_interleave(group, dim=1)


def w8a16_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None, group: int | None) -> torch.Tensor:
    """Reference: x [M, K] @ W^T in float32 -> [M, N] in x's dtype; a group-wise weight
    is rounded to x's dtype first (as the kernel's tile is), a per-channel one is not
    (the kernel scales the float32 sum)."""
    if group is None:
        y = (x.float() @ qweight.float().t()) * scale.float()[None, :]
    else:
        y = x.float() @ dequantize_int8(qweight, scale, bias, group).to(x.dtype).float().t()
    return y.to(x.dtype)


def w8a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None, group: int | None = None,
               config: WoqConfig | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16, unit stride along K) @ W^T -> [M, N] in x's dtype.

    ``qweight`` int8 [N, K]; per channel (``group`` None): ``scale`` float32 [N];
    group-wise: ``scale``/``bias`` [N, K / group] in x's dtype (``bias`` None:
    symmetric)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.shape == (n, k) and qweight.dtype == torch.int8 and x.stride(1) == 1
    if group is None:
        assert scale.shape == (n,) and scale.dtype == torch.float32 and bias is None
    else:
        assert k % group == 0 and scale.shape == (n, k // group) and scale.dtype == x.dtype
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or choose_config(m, n, k, x.device, bits=8)
    ws, locks = split_buffers(cfg, m, n, x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    _w8a16_kernel[grid](
        x, qweight, scale, bias if bias is not None else scale, out,
        out if ws is None else ws, out if locks is None else locks, m, n, k, x.stride(0), n,
        cfg.split_k,
        GROUP=group or cfg.block_k, PER_CHANNEL=group is None, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT=ws is not None, DOT=cfg.dot,
        UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
