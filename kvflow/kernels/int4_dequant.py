"""Dequantize a packed int4 weight (``w4a16_gemm``'s nibble-plane layout) into a dense
[N, K] matrix in the activation dtype, for the int4 GEMM path at M > 8.

Why: above a handful of rows the product is no longer a weight stream but a GEMM, and
cuBLAS on the dense weight (about 580 TFLOP/s on the H200 at 8B shapes, M = 256)
outruns any Triton tile that unpacks nibbles between its ``tl.dot`` calls (the
dequantize-per-plane GEMM measured 0.28x bf16 cuBLAS at M = 256). Writing the dense
weight costs 2.5 bytes per weight of traffic (read 0.5, write 2), once per linear per
step, and the GEMM then runs at cuBLAS speed: for gate_up (N 28672, K 4096) about 294
MB, some 80 us at 3.5 TB/s, against cuBLAS's 104 us at M = 256 and its 57 us at M = 16.

Reference: ``int4_layout.dequantize_int4`` (float32), rounded to the output dtype.
Grid: (cdiv(N, BLOCK_N), 256-input tiles); each program unpacks one [BLOCK_N, 32] word
tile (16 bytes per thread) plane by plane and stores [BLOCK_N, 32] values per plane
(8 bytes per thread in bf16): no reductions and no layout changes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.int4_layout import PACK_K, PLANE, dequantize_int4, nibble_plane


@triton.jit
def _int4_dequant_kernel(qw_ptr, s_ptr, b_ptr, out_ptr, N, K, KW,
                         GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    PL: tl.constexpr = 32
    pid_n = tl.program_id(0)
    t = tl.program_id(1)  # 256-input tile
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_w = tl.arange(0, PL)  # [32]
    n_ok = offs_n < N
    kg = K // GROUP
    words = tl.load(qw_ptr + offs_n[:, None] * KW + t * PL + offs_w[None, :],
                    mask=n_ok[:, None], other=0)  # [BN, 32] int32
    hi = words >> 12
    for i in tl.static_range(8):
        k0 = t * (8 * PL) + i * PL  # first input of plane i
        g = tl.minimum(k0 // GROUP, kg - 1)
        s = tl.load(s_ptr + offs_n * kg + g, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n * kg + g, mask=n_ok, other=0.0).to(tl.float32)
        else:  # symmetric: w = (q - 8) s
            b = -8.0 * s
        q = nibble_plane(words, hi, i)  # [BN, 32] float32
        w = q * s[:, None] + b[:, None]
        k_ok = k0 + offs_w < K  # planes past K are padding
        tl.store(out_ptr + offs_n[:, None] * K + k0 + offs_w[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def int4_dequant_ref(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                     group: int, dtype: torch.dtype) -> torch.Tensor:
    """Reference: the float32 weight rounded to ``dtype``, [N, K]."""
    return dequantize_int4(qweight, scale, bias, group).to(dtype)


def int4_dequant(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 group: int, out: torch.Tensor | None = None,
                 block_n: int = 64) -> torch.Tensor:
    """int32 words [N, Kp / 8] + scale / bias [N, K / group] -> [N, K] in scale's dtype
    (into ``out`` when given)."""
    n, kw = qweight.shape
    k = scale.shape[1] * group
    assert group % PLANE == 0 and kw == triton.cdiv(k, PACK_K) * PACK_K // 8
    assert qweight.numel() * 8 < 2**31  # int32 offsets
    if out is None:
        out = torch.empty((n, k), dtype=scale.dtype, device=qweight.device)
    assert out.shape == (n, k) and out.is_contiguous()
    grid = (triton.cdiv(n, block_n), kw // PLANE)
    _int4_dequant_kernel[grid](qweight, scale, bias if bias is not None else scale, out,
                               n, k, kw, GROUP=group, HAS_BIAS=bias is not None,
                               BLOCK_N=block_n, num_warps=4)
    return out
