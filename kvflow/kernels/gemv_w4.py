"""Decode GEMV with 4-bit weights on the tensor cores: ``y = x @ W^T`` for x [M, K], M <= 8,
W in ``w4a16_gemm``'s packed layout (int32 [N, Kp / 8], nibble planes; scales and biases
[N, K / G]), read as it is (no repack).

Why a second int4 decode kernel: the register GEMV in ``w4a16_gemm`` does per weight a
mask-or, an add and M float32 FMAs on the CUDA cores; at 8.4 G weights per ms (4.2 TB/s of
nibbles) that is more issue slots than the H200's 132 SMs have (it measured 1.0-1.5 TB/s
at M = 1 and 0.4 TB/s at M = 4). Here the multiply-adds go to the tensor cores, as in the
dense ``gemv``: the weight tile is the MMA's wide operand (``tl.dot(w, x^T)``, [BN, 32] x
[32, 16], x padded to 16 rows, rows >= M masked), so M = 1..8 cost the same, and the CUDA
cores only turn nibbles into bf16 operands:

* ``ASM`` (GPU): one ``prmt`` gathers byte p of two neighbouring words into the low
  bytes of the two halves of a register, and one ``lop3`` (and a shift for the high
  nibble) makes ``0x4300 | q`` in each half: the bf16 value ``128 + q``, exact, two per
  instruction. About one integer instruction per weight, no conversion instruction.
* otherwise (the interpreter, and an A/B check on the GPU): the same values with Triton
  integer ops and a float32 conversion.

So the dot yields ``sum_k x_k (128 + q_k)`` over each scale group's planes (float32 on the
tensor cores; the 128 costs at most a few float32 ulps of the group sum), and the
group's scale and bias are applied to that [BN, 16] partial: ``s * acc + (b - 128 s) *
sum(x)`` (symmetric weights: b = -8 s). No weight is rounded.

Grid ``(cdiv(N, ROWS), split_k)`` (ROWS: ``config.tile_rows``, BLOCK_N or fewer for a
grid balanced over the SMs, ``gemv.tile_rows``); each program walks its share of the
256-input tiles (one [BN, 32] word load per tile, ``num_stages`` in flight). Split-K
partials are summed in the launch by the tile's last program (``woq_config.store_output``),
as in ``gemv``. Configurations: ``woq_gemv_config``. Reference: ``gemv_w4_ref`` (=
``w4a16_ref``: dequantize in float32, float32 matmul).

Traffic: N K / 2 bytes of weight + 2 N K / G elem of scale and bias; Llama-3.1-8B gate_up
at G = 128, M = 1: 58.7 + 3.7 MB, 14.9 us at 4.2 TB/s (bf16: 235 MB, 56 us).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.woq_gemv_config import WoqGemvConfig
from kvflow.kernels.int4_layout import PACK_K, PLANE
from kvflow.kernels.w4a16_gemm import w4a16_ref
from kvflow.kernels.woq_config import store_output
from kvflow.kernels.gemv import gemv_outputs, store_silu_pair, tile_rows

MAX_M = 16  # x rows of one MMA tile


@triton.jit
def _planes_asm(words):
    """int32 words [BN, 32] -> the 8 nibble planes as bf16 ``128 + q`` (same shape)."""
    # pack=2: each asm instance takes two words a, b (two elements of the tensor; the same
    # two of every output) and writes one register per plane holding {plane(a), plane(b)}
    # (element a in the low half): prmt 0x5410 / 0x7632 put the low / high 16 bits of a
    # and b side by side, a shift brings nibble j of each half to bits 0-3, and lop3
    # (x & 0x000F000F) | 0x43004300 (LUT 0xEA = a & b | c) makes the two bf16 128 + q.
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 lo, hi, t;
        prmt.b32 lo, $8, $9, 0x5410;
        prmt.b32 hi, $8, $9, 0x7632;
        lop3.b32 $0, lo, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $4, hi, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 t, lo, 4;
        lop3.b32 $1, t, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 t, lo, 8;
        lop3.b32 $2, t, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 t, lo, 12;
        lop3.b32 $3, t, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 t, hi, 4;
        lop3.b32 $5, t, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 t, hi, 8;
        lop3.b32 $6, t, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 t, hi, 12;
        lop3.b32 $7, t, 0x000F000F, 0x43004300, 0xEA;
        }
        """,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r",
        args=[words],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
               tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _dequant_asm(q, s, b):
    """bf16 ``128 + q`` (packed pairs) -> ``(q) * s + b`` in bf16: an exact subtract and one
    rounding fma, two weights per instruction."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, c;
        mov.b32 c, 0x43004300;
        sub.rn.bf16x2 t, $1, c;
        fma.rn.bf16x2 $0, t, $2, $3;
        }
        """,
        constraints="=r,r,r,r", args=[q, s, b], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _dequant_plane(q, s, b, dt: tl.constexpr, ASM: tl.constexpr):
    """One plane [BN, 32] of ``128 + q`` -> the weights in ``dt`` (s, b: [BN] float32 of
    its group, as stored in ``dt``)."""
    if ASM:  # bf16 only
        w = _dequant_asm(q, s.to(tl.bfloat16)[:, None].broadcast_to(q.shape),
                         b.to(tl.bfloat16)[:, None].broadcast_to(q.shape))
    else:
        w = ((q.to(tl.float32) - 128.0) * s[:, None] + b[:, None]).to(dt)
    return w


@triton.jit
def _dot_acc(w, x_ptrs, k0, m_ok, offs_w, K, acc, UPCAST: tl.constexpr,
             EVEN_K: tl.constexpr):
    """acc + w [BN, 32] . x[:, k0 : k0 + 32]^T -> [BN, 16] float32."""
    x = _x_plane(x_ptrs, k0, m_ok, offs_w, K, EVEN_K)
    if UPCAST:
        acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    return acc


@triton.jit
def _group_sb(s_ptr, b_ptr, g_ptrs, g, n_ok, HAS_BIAS: tl.constexpr):
    s = tl.load(s_ptr + g_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
    if HAS_BIAS:
        b = tl.load(b_ptr + g_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)
    else:  # symmetric: w = (q - 8) s
        b = -8.0 * s
    return s, b


@triton.jit
def _plane_ops(words, i: tl.constexpr, dt: tl.constexpr):
    """Plane i of ``words`` as ``128 + q`` in ``dt`` with plain Triton ops."""
    return (((words >> (4 * i)) & 0xF) + 128).to(tl.float32).to(dt)


@triton.jit
def _x_plane(x_ptrs, k0, m_ok, offs_w, K, EVEN_K: tl.constexpr):
    """x[:, k0 : k0 + 32] as [16, 32] (rows >= M and inputs >= K read as 0)."""
    if EVEN_K:
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
    else:
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & (k0 + offs_w < K)[None, :], other=0.0)
    return x


@triton.jit
def _group_dot(p0, p1, p2, p3, x_ptrs, k0, m_ok, offs_w, K, SPAN: tl.constexpr,
               UPCAST: tl.constexpr, EVEN_K: tl.constexpr):
    """sum over SPAN planes (starting at input k0) of plane . x -> [BN, 16] float32, and the
    [16] float32 sums of x over those planes. Inputs past K (the packing's zero padding,
    whole planes since K is a multiple of 32) load x = 0 and add nothing."""
    PL: tl.constexpr = 32
    x = _x_plane(x_ptrs, k0, m_ok, offs_w, K, EVEN_K)  # [BM, 32]
    if UPCAST:  # CPU interpreter: its tl.dot multiplies bf16 as raw uint16
        acc = tl.dot(p0.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(p0, tl.trans(x))  # [BN, BM]
    xv = x.to(tl.float32)  # [BM, 32]: summed over the planes, reduced across threads once
    if SPAN > 1:
        x = _x_plane(x_ptrs, k0 + PL, m_ok, offs_w, K, EVEN_K)
        if UPCAST:
            acc += tl.dot(p1.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(p1, tl.trans(x), acc)
        xv += x.to(tl.float32)
    if SPAN > 2:
        x = _x_plane(x_ptrs, k0 + 2 * PL, m_ok, offs_w, K, EVEN_K)
        if UPCAST:
            acc += tl.dot(p2.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(p2, tl.trans(x), acc)
        xv += x.to(tl.float32)
        x = _x_plane(x_ptrs, k0 + 3 * PL, m_ok, offs_w, K, EVEN_K)
        if UPCAST:
            acc += tl.dot(p3.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(p3, tl.trans(x), acc)
        xv += x.to(tl.float32)
    return acc, tl.sum(xv, axis=1)


@triton.jit
def _scaled(acc, xs, s_ptr, b_ptr, g_ptrs, g, n_ok, HAS_BIAS: tl.constexpr):
    """A group's [BN, BM] partial scaled: s * acc + (b - 128 s) * sum(x)."""
    s = tl.load(s_ptr + g_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
    if HAS_BIAS:
        b = tl.load(b_ptr + g_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)
    else:  # symmetric: w = (q - 8) s
        b = -8.0 * s
    return acc * s[:, None] + (b - 128.0 * s)[:, None] * xs[None, :]


@triton.jit
def _w4_partial(x_ptrs, qw_ptr, s_ptr, b_ptr, rows, n_ok, m_ok, offs_w, K, KW, t_start, t_end,
                dt: tl.constexpr, GROUP: tl.constexpr, SPAN: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
                DEQ: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """sum over the 256-input tiles t_start .. t_end of W[rows] . x -> [BN, 16] float32."""
    PL: tl.constexpr = 32  # inputs per nibble plane
    BM: tl.constexpr = 16
    kg = K // GROUP
    w_ptrs = qw_ptr + rows[:, None] * KW + offs_w[None, :]  # [BN, 32]
    g_ptrs = rows * kg  # [BN] row starts in scale / bias
    acc = tl.zeros((BLOCK_N, BM), dtype=tl.float32)
    for t in range(t_start, t_end):
        words = tl.load(w_ptrs + t * PL, mask=n_ok[:, None], other=0,
                        eviction_policy="evict_first")  # [BN, 32] int32, streamed once
        if ASM:
            q0, q1, q2, q3, q4, q5, q6, q7 = _planes_asm(words)
        else:
            q0 = _plane_ops(words, 0, dt)
            q1 = _plane_ops(words, 1, dt)
            q2 = _plane_ops(words, 2, dt)
            q3 = _plane_ops(words, 3, dt)
            q4 = _plane_ops(words, 4, dt)
            q5 = _plane_ops(words, 5, dt)
            q6 = _plane_ops(words, 6, dt)
            q7 = _plane_ops(words, 7, dt)
        k0 = t * (8 * PL)
        if DEQ:  # bf16 weights (one rounding each), one accumulator chain, no sums of x
            s, b = _group_sb(s_ptr, b_ptr, g_ptrs, tl.minimum(k0 // GROUP, kg - 1), n_ok, HAS_BIAS)
            acc = _dot_acc(_dequant_plane(q0, s, b, dt, ASM), x_ptrs, k0, m_ok, offs_w, K, acc, UPCAST, EVEN_K)
            if GROUP == 32:
                s, b = _group_sb(s_ptr, b_ptr, g_ptrs, tl.minimum((k0 + PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            acc = _dot_acc(_dequant_plane(q1, s, b, dt, ASM), x_ptrs, k0 + PL, m_ok, offs_w, K, acc, UPCAST, EVEN_K)
            if GROUP <= 64:
                s, b = _group_sb(s_ptr, b_ptr, g_ptrs, tl.minimum((k0 + 2 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            acc = _dot_acc(_dequant_plane(q2, s, b, dt, ASM), x_ptrs, k0 + 2 * PL, m_ok, offs_w, K, acc, UPCAST, EVEN_K)
            if GROUP == 32:
                s, b = _group_sb(s_ptr, b_ptr, g_ptrs, tl.minimum((k0 + 3 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            acc = _dot_acc(_dequant_plane(q3, s, b, dt, ASM), x_ptrs, k0 + 3 * PL, m_ok, offs_w, K, acc, UPCAST, EVEN_K)
            if GROUP <= 128:
                s, b = _group_sb(s_ptr, b_ptr, g_ptrs, tl.minimum((k0 + 4 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            acc = _dot_acc(_dequant_plane(q4, s, b, dt, ASM), x_ptrs, k0 + 4 * PL, m_ok, offs_w, K, acc, UPCAST, EVEN_K)
            if GROUP == 32:
                s, b = _group_sb(s_ptr, b_ptr, g_ptrs, tl.minimum((k0 + 5 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            acc = _dot_acc(_dequant_plane(q5, s, b, dt, ASM), x_ptrs, k0 + 5 * PL, m_ok, offs_w, K, acc, UPCAST, EVEN_K)
            if GROUP <= 64:
                s, b = _group_sb(s_ptr, b_ptr, g_ptrs, tl.minimum((k0 + 6 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            acc = _dot_acc(_dequant_plane(q6, s, b, dt, ASM), x_ptrs, k0 + 6 * PL, m_ok, offs_w, K, acc, UPCAST, EVEN_K)
            if GROUP == 32:
                s, b = _group_sb(s_ptr, b_ptr, g_ptrs, tl.minimum((k0 + 7 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            acc = _dot_acc(_dequant_plane(q7, s, b, dt, ASM), x_ptrs, k0 + 7 * PL, m_ok, offs_w, K, acc, UPCAST, EVEN_K)
        elif SPAN == 8:
            a, xs = _group_dot(q0, q1, q2, q3, x_ptrs, k0, m_ok, offs_w, K, 4, UPCAST, EVEN_K)
            a2, xs2 = _group_dot(q4, q5, q6, q7, x_ptrs, k0 + 4 * PL, m_ok, offs_w, K, 4, UPCAST, EVEN_K)
            g = tl.minimum(k0 // GROUP, kg - 1)
            acc += _scaled(a + a2, xs + xs2, s_ptr, b_ptr, g_ptrs, g, n_ok, HAS_BIAS)
        elif SPAN == 4:
            a, xs = _group_dot(q0, q1, q2, q3, x_ptrs, k0, m_ok, offs_w, K, 4, UPCAST, EVEN_K)
            g = tl.minimum(k0 // GROUP, kg - 1)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs, g, n_ok, HAS_BIAS)
            a, xs = _group_dot(q4, q5, q6, q7, x_ptrs, k0 + 4 * PL, m_ok, offs_w, K, 4, UPCAST, EVEN_K)
            g = tl.minimum((k0 + 4 * PL) // GROUP, kg - 1)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs, g, n_ok, HAS_BIAS)
        elif SPAN == 2:
            a, xs = _group_dot(q0, q1, q0, q0, x_ptrs, k0, m_ok, offs_w, K, 2, UPCAST, EVEN_K)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs, tl.minimum(k0 // GROUP, kg - 1),
                           n_ok, HAS_BIAS)
            a, xs = _group_dot(q2, q3, q0, q0, x_ptrs, k0 + 2 * PL, m_ok, offs_w, K, 2, UPCAST, EVEN_K)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs,
                           tl.minimum((k0 + 2 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            a, xs = _group_dot(q4, q5, q0, q0, x_ptrs, k0 + 4 * PL, m_ok, offs_w, K, 2, UPCAST, EVEN_K)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs,
                           tl.minimum((k0 + 4 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            a, xs = _group_dot(q6, q7, q0, q0, x_ptrs, k0 + 6 * PL, m_ok, offs_w, K, 2, UPCAST, EVEN_K)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs,
                           tl.minimum((k0 + 6 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
        else:  # G = 32: a scale per plane
            a, xs = _group_dot(q0, q0, q0, q0, x_ptrs, k0, m_ok, offs_w, K, 1, UPCAST, EVEN_K)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs, tl.minimum(k0 // GROUP, kg - 1),
                           n_ok, HAS_BIAS)
            a, xs = _group_dot(q1, q0, q0, q0, x_ptrs, k0 + PL, m_ok, offs_w, K, 1, UPCAST, EVEN_K)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs,
                           tl.minimum((k0 + PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            a, xs = _group_dot(q2, q0, q0, q0, x_ptrs, k0 + 2 * PL, m_ok, offs_w, K, 1, UPCAST, EVEN_K)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs,
                           tl.minimum((k0 + 2 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            a, xs = _group_dot(q3, q0, q0, q0, x_ptrs, k0 + 3 * PL, m_ok, offs_w, K, 1, UPCAST, EVEN_K)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs,
                           tl.minimum((k0 + 3 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            a, xs = _group_dot(q4, q0, q0, q0, x_ptrs, k0 + 4 * PL, m_ok, offs_w, K, 1, UPCAST, EVEN_K)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs,
                           tl.minimum((k0 + 4 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            a, xs = _group_dot(q5, q0, q0, q0, x_ptrs, k0 + 5 * PL, m_ok, offs_w, K, 1, UPCAST, EVEN_K)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs,
                           tl.minimum((k0 + 5 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            a, xs = _group_dot(q6, q0, q0, q0, x_ptrs, k0 + 6 * PL, m_ok, offs_w, K, 1, UPCAST, EVEN_K)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs,
                           tl.minimum((k0 + 6 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
            a, xs = _group_dot(q7, q0, q0, q0, x_ptrs, k0 + 7 * PL, m_ok, offs_w, K, 1, UPCAST, EVEN_K)
            acc += _scaled(a, xs, s_ptr, b_ptr, g_ptrs,
                           tl.minimum((k0 + 7 * PL) // GROUP, kg - 1), n_ok, HAS_BIAS)
    return acc


@triton.jit
def _gemv_w4_kernel(x_ptr, qw_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K, KW,
                    stride_xm, stride_om, split_k,
                    GROUP: tl.constexpr, SPAN: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                    DEQ: tl.constexpr, SILU: tl.constexpr,
                    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, ROWS: tl.constexpr):
    """N: the output width (SILU: the gate rows; the up rows follow them in the weight).
    ROWS <= BLOCK_N: the output rows this program owns (``gemv.tile_rows``; the lanes past
    them name row N, which every ``n_ok`` mask drops, the up rows' 2N included)."""
    PL: tl.constexpr = 32
    BM: tl.constexpr = 16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BM)
    offs_n = tile_rows(pid_n, N, BLOCK_N, ROWS)  # [BN]
    offs_w = tl.arange(0, PL)  # [32]
    n_ok = offs_n < N
    m_ok = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_w[None, :]  # [BM, 32]
    k_tiles = tl.cdiv(K, 8 * PL)
    per_split = tl.cdiv(k_tiles, split_k)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)
    dt = x_ptr.dtype.element_ty
    acc = _w4_partial(x_ptrs, qw_ptr, s_ptr, b_ptr, offs_n, n_ok, m_ok, offs_w, K, KW,
                      t_start, t_end, dt, GROUP, SPAN, HAS_BIAS, BLOCK_N, ASM, DEQ, EVEN_K,
                      UPCAST)
    if SILU:  # the matching up rows, then silu(gate) * up
        up = _w4_partial(x_ptrs, qw_ptr, s_ptr, b_ptr, offs_n + N, n_ok, m_ok, offs_w, K, KW,
                         t_start, t_end, dt, GROUP, SPAN, HAS_BIAS, BLOCK_N, ASM, DEQ, EVEN_K,
                         UPCAST)
        store_silu_pair(tl.trans(acc), tl.trans(up), out_ptr, ws_ptr, lock_ptr, offs_m,
                        offs_n, M, N, stride_om, pid_n, pid_k, split_k, SPLIT)
    else:
        store_output(tl.trans(acc), out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N,
                     stride_om, pid_n, pid_k, split_k, SPLIT)


def gemv_w4_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """Reference: x [M, K] @ dequantize(W)^T in float32 -> [M, N] in x's dtype."""
    return w4a16_ref(x, qweight, scale, bias, group)


def use_asm(x: torch.Tensor) -> bool:
    """The inline-PTX conversion: bf16 on CUDA (the interpreter runs no PTX; the magic
    number is bf16's)."""
    return x.device.type == "cuda" and x.dtype == torch.bfloat16


def gemv_w4(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
            bias: torch.Tensor | None, group: int, config: WoqGemvConfig,
            asm: bool | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 16, bf16/fp16, unit stride along K) @ W^T -> [M, N] in x's dtype;
    ``silu_and_mul``: W = [gate; up] (N = 2d rows) -> silu(x gate^T) * (x up^T) [M, d].

    ``qweight``/``scale``/``bias`` as ``w4a16_gemm`` takes them; ``config.block_k`` is
    ignored (tiles are the packing's 256 inputs). ``asm`` None: the PTX conversion
    where ``use_asm``."""
    m, k = x.shape
    n = qweight.shape[0]
    assert m <= MAX_M, f"gemv_w4 takes at most {MAX_M} rows"
    assert k % group == 0 and group % PLANE == 0 and x.stride(1) == 1
    assert (group & (group - 1)) == 0, "group sizes are powers of two"
    assert qweight.shape == (n, triton.cdiv(k, PACK_K) * PACK_K // 8)
    assert scale.shape == (n, k // group) and scale.dtype == x.dtype
    assert max(qweight.numel(), x.numel(), m * n) < 2**31  # int32 offsets in the kernel
    out, ws, locks = gemv_outputs(x, config, n, silu_and_mul)
    if m == 0:
        return out
    n_out = out.shape[1]
    grid = (triton.cdiv(n_out, config.tile_rows), config.split_k)
    asm = use_asm(x) if asm is None else asm
    _gemv_w4_kernel[grid](
        x, qweight, scale, bias if bias is not None else scale, out,
        out if ws is None else ws, out if locks is None else locks, m, n_out, k,
        qweight.shape[1], x.stride(0), n_out, config.split_k,
        # planes per scale group inside one 256-input tile (4 at G = 128; 8 at G >= 256),
        # computed here: a conditional expression on constexprs in the kernel is one of
        # the constructs Triton 3.6 compiles into a runtime value
        GROUP=group, SPAN=min(group, PACK_K) // PLANE, HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n, SPLIT=ws is not None, ASM=asm, DEQ=config.deq,
        SILU=silu_and_mul, EVEN_K=k % PACK_K == 0,
        UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16, ROWS=config.tile_rows,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
