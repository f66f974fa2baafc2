"""Weight-only int4 GEMM for the GPU: ``y = x @ W^T`` with W kept in 4 bits.

Layout (``int4_layout.py``; written once at load by ``pack_int4``; every 4-bit format is
repacked into it):

- ``qweight`` int32 [N, Kp / 8], Kp = K rounded up to a multiple of ``PACK_K`` = 256
  (padding values are 0 with no scale, so they add nothing). Row n runs along K in
  tiles of 256 inputs = 32 words; inside a tile, **nibble i of word w holds input
  ``32 i + w``**: shifting a tile's [BN, 32] words right by 4 i gives the 32 contiguous
  inputs ``32 i .. 32 i + 31`` ("nibble planes"), so the kernel unpacks with one shift
  and mask per plane and never reorders registers. A tile row is 128 contiguous bytes:
  coalesced, 16 bytes per thread.
- ``scale`` and ``bias`` [N, K / G] in the activation dtype, one per group of G inputs
  (G = 32, 64, 128, ...; a multiple of 32, so a plane lies inside one group):
  ``w = q * scale + bias`` for q in 0..15. In the seam's ``Int4Groups`` form
  (``w = (v - 8) * s + z``) that is ``bias = z - 8 s``, which for GGUF Q4_1 and
  asymmetric round-to-nearest is exactly the group minimum. Symmetric weights store no
  bias (``bias=None``: w = (q - 8) * scale).

Reference: ``w4a16_ref`` (dequantize to float32, matmul in float32).

Algorithm: grid ``(cdiv(M, BM) * cdiv(N, BN), split_k)``. Each program walks its share
of the 256-input tiles. Per tile it loads the [BN, 32] words, and per plane i multiplies
the integers q_i (exact in bf16/fp16) with the activations x[:, 32 i : 32 i + 32] (a
``tl.dot`` into float32, or for one row a multiply and ``tl.sum``). For few rows
(decode) the plane's group scale and bias are applied to that float32 partial sum,
``s * (x . q) + b * sum(x)``: no weight is rounded and the per-weight work is shift,
mask and convert. For many rows that would cost more than the weights, so the plane is
dequantized in registers first (one FMA per weight, rounded to the activation dtype).
One split stores its tile in the output dtype; several add float32 partials to a
workspace whose last-arriving program adds them (``woq_config.store_output``).

Decode (M <= 8) takes ``_w4a16_gemv_kernel`` instead (``WoqConfig.dot`` False): the same
layout and split-K, all arithmetic on the loaded registers (see its docstring); the
``tl.dot`` form above is the GEMM for M > 8.

Traffic: N K / 2 bytes of weight + 2 N K / G * elem bytes of scales and biases + M K and
M N activations. Llama-3.1-8B down_proj (N 4096, K 14336, G 128, bf16) at M = 1: 29.4 MB
+ 1.8 MB, about 6.5 us at 4.8 TB/s, against 117 MB (24 us) for the bf16 weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.int4_layout import PACK_K, PLANE, dequantize_int4, nibble_plane
from kvflow.kernels.woq_config import (WoqConfig, choose_config, split_buffers,
                                      store_output)


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K, KW,
                  stride_xm, stride_om, split_k,
                  GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, SCALE_AFTER: tl.constexpr,
                  UPCAST: tl.constexpr):
    PL: tl.constexpr = 32  # inputs per nibble plane (PACK_K / 8)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_w = tl.arange(0, PL)  # [32] words of a tile, = inputs of a plane
    m_ok = offs_m < M
    n_ok = offs_n < N
    kg = K // GROUP  # groups per row
    w_ptrs = qw_ptr + offs_n[:, None] * KW + offs_w[None, :]  # [BN, 32]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_w[None, :]  # [BM, 32]
    g_ptrs = offs_n * kg  # [BN] row starts in scale / bias
    k_tiles = tl.cdiv(K, 8 * PL)
    per_split = tl.cdiv(k_tiles, split_k)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t_start, t_end):
        words = tl.load(w_ptrs + t * PL, mask=n_ok[:, None], other=0)  # [BN, 32] int32
        for i in tl.static_range(8):
            k0 = t * (8 * PL) + i * PL  # first input of plane i
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & (k0 + offs_w < K)[None, :],
                        other=0.0)  # [BM, 32]
            q = ((words >> (4 * i)) & 0xF).to(tl.float32)  # [BN, 32], inputs k0 + w
            # A plane past K (padding) has x = 0: any valid group's scale gives 0.
            g = tl.minimum(k0 // GROUP, kg - 1)
            s = tl.load(s_ptr + g_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
            if HAS_BIAS:
                b = tl.load(b_ptr + g_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)
            else:  # symmetric: w = (q - 8) s
                b = -8.0 * s
            if SCALE_AFTER:
                # Few rows: scale the plane's float32 partial sums, s (x . q) + b sum(x),
                # rather than every weight.
                if UPCAST:  # CPU interpreter: its tl.dot multiplies bf16 as raw uint16
                    part = tl.dot(x.to(tl.float32), tl.trans(q), input_precision="ieee")
                else:
                    part = tl.dot(x, tl.trans(q.to(x.dtype)))  # [BM, BN]; q exact in bf16
                xsum = tl.sum(x.to(tl.float32), axis=1)  # [BM]
                acc += part * s[None, :] + xsum[:, None] * b[None, :]
            else:
                # Many rows: dequantize the plane (one FMA per weight) and feed tl.dot.
                w = (q * s[:, None] + b[:, None]).to(x.dtype)  # [BN, 32]
                if UPCAST:
                    acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)),
                                  input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(w))
    store_output(acc, out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_om, pid, pid_k,
                 split_k, SPLIT)


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K, KW,
                       stride_xm, stride_om, split_k,
                       GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """Decode (M <= 8): the whole product in registers, no tensor cores, no layout change.

    Each thread keeps the [BN, 32] word tile as loaded (4 words = 16 bytes per load) and
    gets plane i's 32 weights in place as floats with a mask, an OR and an add
    (``nibble_plane``: no shift per plane and no conversion instruction, which issues at
    a quarter of the FMA rate). The products with the
    matching activations (broadcast along BN) accumulate in float32 over the planes of
    one scale group, and only then are reduced over the 32 words and scaled,
    ``s (x . q) + b sum(x)``: per weight a logic op, an add and M FMAs."""
    PL: tl.constexpr = 32  # inputs per nibble plane
    SPAN: tl.constexpr = (GROUP if GROUP < 8 * PL else 8 * PL) // PL  # planes per scale
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_w = tl.arange(0, PL)  # [32]
    n_ok = offs_n < N
    kg = K // GROUP
    w_ptrs = qw_ptr + offs_n[:, None] * KW + offs_w[None, :]  # [BN, 32]
    g_ptrs = offs_n * kg  # [BN]
    k_tiles = tl.cdiv(K, 8 * PL)
    per_split = tl.cdiv(k_tiles, split_k)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)
    # Each row's sums go to column r of a [BN, BM] accumulator so that every tensor in
    # the loop keeps the word tile's register layout (a [BM, BN, 32] product would get a
    # layout of its own and a shared-memory conversion per plane).
    cols = tl.arange(0, BLOCK_M)  # [BM]
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # [BN, BM]
    # The next tile's load is issued before this tile's arithmetic (two tiles in flight
    # per program; Triton's pipeliner only stages loads that feed tl.dot).
    zero_w = offs_w * 0  # [32]: scalar conditions as tensors (the interpreter's masks)
    nxt = tl.load(w_ptrs + t_start * PL, mask=n_ok[:, None] & (zero_w + t_start < t_end)[None, :],
                  other=0)
    for t in range(t_start, t_end):
        words = nxt  # [BN, 32] int32
        hi = words >> 12  # planes 5..7 at nibbles 2..4 (nibble_plane)
        nxt = tl.load(w_ptrs + (t + 1) * PL,
                      mask=n_ok[:, None] & (zero_w + t + 1 < t_end)[None, :], other=0)
        for j in tl.static_range(8 // SPAN):  # the scale groups (or group part) of the tile
            # planes past K (padding) have x = 0: any valid group's scale gives 0
            g = tl.minimum((t * (8 * PL) + j * SPAN * PL) // GROUP, kg - 1)
            s = tl.load(s_ptr + g_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
            if HAS_BIAS:
                b = tl.load(b_ptr + g_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)
            else:  # symmetric: w = (q - 8) s
                b = -8.0 * s
            for r in tl.static_range(BLOCK_M):
                row = pid_m * BLOCK_M + r
                part = tl.zeros((BLOCK_N, PL), dtype=tl.float32)
                xs = tl.zeros((PL,), dtype=tl.float32)
                for p in tl.static_range(SPAN):
                    i = j * SPAN + p
                    k0 = t * (8 * PL) + i * PL  # first input of plane i
                    x = tl.load(x_ptr + row * stride_xm + k0 + offs_w,
                                mask=(zero_w + row < M) & (k0 + offs_w < K), other=0.0
                                ).to(tl.float32)  # [32]
                    # the same for every row: computed once (CSE), kept for the rows
                    q = nibble_plane(words, hi, i)  # [BN, 32] float32, exact
                    part += q * x[None, :]
                    xs += x
                y = tl.sum(part, axis=1) * s + tl.sum(xs, axis=0) * b  # [BN]
                acc_t += tl.where(cols[None, :] == r, y[:, None], 0.0)
    acc = tl.trans(acc_t)  # [BM, BN]
    store_output(acc, out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_om, pid, pid_k,
                 split_k, SPLIT)


def w4a16_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """Reference: x [M, K] @ dequantize(W)^T in float32 -> [M, N] in x's dtype."""
    return (x.float() @ dequantize_int4(qweight, scale, bias, group).t()).to(x.dtype)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, group: int, config: WoqConfig | None = None
               ) -> torch.Tensor:
    """x [M, K] (bf16/fp16, unit stride along K) @ W^T -> [M, N] in x's dtype.

    ``qweight`` int32 [N, Kp / 8] (``pack_int4``), ``scale``/``bias`` [N, K / group] in
    x's dtype (``bias`` None: symmetric). ``config`` overrides the launch heuristic
    (benchmarks, tests; its block_k is ignored: tiles are the packing's 256 inputs)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert k % group == 0 and group % PLANE == 0 and x.stride(1) == 1
    assert qweight.shape == (n, triton.cdiv(k, PACK_K) * PACK_K // 8)
    assert scale.shape == (n, k // group) and scale.dtype == x.dtype
    assert max(qweight.numel(), x.numel(), m * n) < 2**31  # int32 offsets in the kernel
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or choose_config(m, n, k, x.device, bits=4)
    if cfg.dequant:  # many rows: the dense weight (one pass) and cuBLAS
        from kvflow.kernels.int4_dequant import int4_dequant

        return torch.nn.functional.linear(x, int4_dequant(qweight, scale, bias, group))
    ws, locks = split_buffers(cfg, m, n, x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    args = (x, qweight, scale, bias if bias is not None else scale, out,
            out if ws is None else ws, out if locks is None else locks, m, n, k,
            qweight.shape[1], x.stride(0), n, cfg.split_k)
    common = dict(GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, SPLIT=ws is not None, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    if cfg.dot:
        _w4a16_kernel[grid](*args, SCALE_AFTER=cfg.scale_after,
                            UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16,
                            **common)
    else:
        _w4a16_gemv_kernel[grid](*args, **common)
    return out
