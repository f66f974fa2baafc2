"""Decode GEMV with 8-bit weights and one scale per output channel: ``y = (x @ Q^T) *
scale[None, :]`` for x [M, K] bf16/fp16, M <= 8, Q [N, K] int8 (``--quantization int8``)
or float8_e4m3fn (``--quantization fp8``), ``scale`` float32 [N].

For FP8 this is the small-M path of W8A8 layers: at M <= 8 the activations stay in bf16
and only the weights are converted (weight-dequant, not W8A8 arithmetic), since the step
is a pure weight stream and quantizing x costs a launch and buys no bandwidth; the
W8A8 ``torch._scaled_mm`` path keeps every larger M. Both give float32 sums of exact
products up to the activations' rounding: the FP8 weight values are exact in bf16, the
int8 integers too.

As in the dense ``gemv``: grid ``(cdiv(N, ROWS), split_k)`` (ROWS: ``config.tile_rows``,
BLOCK_N or fewer for a grid balanced over the SMs, ``gemv.tile_rows``), the [BN, BK]
weight tile (BK bytes per row, 16 per thread) converted to x's dtype in registers and
used as the MMA's wide operand (``tl.dot(w, x^T)``, x padded to 16 rows), float32
accumulation, the scale applied once to the [BN, 16] sums, split-K summed in the launch
(``woq_config.store_output``). Configurations: ``woq_gemv_config``. Reference:
``gemv_w8_ref``.

Traffic: N K bytes of weight + 4 N of scales; Llama-3.1-8B gate_up at M = 1: 117 MB,
28 us at 4.2 TB/s (bf16: 235 MB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.woq_config import store_output
from kvflow.kernels.gemv import gemv_outputs, load_tiles, store_silu_pair, tile_rows

MAX_M = 16
# The PTX conversions below produce bf16 operands 2**-112 times the weight values (an
# f16's exponent field read as a bf16's); the float32 sums are scaled back once.
ASM_SCALE = 2.0 ** 112


@triton.jit
def _fp8_operand(q):
    """float8_e4m3fn [BN, BK] -> bf16 operands, 2**-112 times the values: one packed
    e4m3x2 -> f16x2 conversion per two weights (the only conversion-unit instruction;
    Triton's own e4m3 -> bf16 path does three, and that unit issues at a quarter of
    the ALU rate), then the f16 pair's bits moved to bf16's (a shift and two logic ops:
    sign kept, exponent and mantissa down 3, so the f16 exponent field reads as a bf16
    exponent 112 lower; exact, since e4m3 values have 4 significant bits and are normal
    f16 numbers or zero)."""
    # pack=2: two neighbouring weights (one 16-bit register) per instance, the pair the
    # MMA operand layout keeps in one 32-bit register.
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 a, t, s;
        cvt.rn.f16x2.e4m3x2 a, $1;
        shr.u32 t, a, 3;
        and.b32 s, a, 0x80008000;
        lop3.b32 $0, t, 0x0FFF0FFF, s, 0xEA;
        }
        """,
        constraints="=r,h", args=[q], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _int8_operand(q):
    """int8 [BN, BK] -> bf16 operands, 2**-112 times the values, with no conversion-unit
    instruction: b + 128 in the low byte of an f16 1024 (xor, prmt), minus 1152 (an
    exact f16x2 subtract) gives b as f16, whose bits move to bf16's as in
    ``_fp8_operand`` (|b| <= 128: at most 8 significant bits, exact)."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 w, u, c, a, t, s;
        cvt.u32.u16 w, $1;
        xor.b32 u, w, 0x8080;
        mov.b32 c, 0x64646464;
        prmt.b32 a, u, c, 0x4140;
        mov.b32 c, 0x64806480;
        sub.rn.f16x2 a, a, c;
        shr.u32 t, a, 3;
        and.b32 s, a, 0x80008000;
        lop3.b32 $0, t, 0x0FFF0FFF, s, 0xEA;
        }
        """,
        constraints="=r,h", args=[q], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _w8_partial(x_ptr, w_ptr, rows, n_ok, offs_m, m_ok, K, stride_xm, t_start, t_end,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                ASM: tl.constexpr, FP8: tl.constexpr, XA: tl.constexpr,
                UPCAST: tl.constexpr):
    """sum over the K tiles t_start .. t_end of Q[rows] . x -> [BN, 16] float32 (times
    2**-112 with ``ASM``). ``XA``: x is the MMA's first operand ([16, BK] x [BK, BN]:
    16 rows take mma.sync, whose operands come from registers with no warpgroup
    synchronisation) instead of the weight ([BN, BK] x [BK, 16], wgmma from BN = 64)."""
    BM: tl.constexpr = 16
    rows_w = rows.to(tl.int64)[:, None] * K  # [BN, 1]
    acc = tl.zeros((BLOCK_N, BM), dtype=tl.float32)
    acc_t = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    for t in range(t_start, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        q, x = load_tiles(w_ptr, rows_w, n_ok, x_ptr, offs_m, m_ok, stride_xm, offs_k, K,
                          EVEN_K)  # [BN, BK], [BM, BK]
        if UPCAST:  # CPU interpreter: its tl.dot multiplies bf16 as raw uint16
            w = q.to(tl.float32)
            xf = x.to(tl.float32)
            if XA:
                acc_t += tl.dot(xf, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(w, tl.trans(xf), input_precision="ieee")
        else:
            if ASM and FP8:
                w = _fp8_operand(q)  # [BN, BK] bf16
            elif ASM:
                w = _int8_operand(q)
            else:  # int8 and e4m3 values are exact in bf16 / fp16
                w = q.to(x.dtype)
            if XA:
                acc_t = tl.dot(x, tl.trans(w), acc_t)  # [BM, BK] @ [BK, BN]
            else:
                acc = tl.dot(w, tl.trans(x), acc)  # [BN, BK] @ [BK, BM]
    if XA:
        acc = tl.trans(acc_t)
    return acc


@triton.jit
def _gemv_w8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K, stride_xm,
                    stride_om, split_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                    FP8: tl.constexpr, SILU: tl.constexpr, XA: tl.constexpr,
                    UPCAST: tl.constexpr, ROWS: tl.constexpr):
    """N: the output width (SILU: the gate rows; the up rows follow them in the weight).
    ROWS <= BLOCK_N: the output rows this program owns (``gemv.tile_rows``; the lanes past
    them name row N, which every ``n_ok`` mask drops: weight, scale and output alike)."""
    BM: tl.constexpr = 16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BM)
    offs_n = tile_rows(pid_n, N, BLOCK_N, ROWS)  # [BN]
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)
    acc = _w8_partial(x_ptr, w_ptr, offs_n, n_ok, offs_m, m_ok, K, stride_xm, t_start, t_end,
                      BLOCK_N, BLOCK_K, EVEN_K, ASM, FP8, XA, UPCAST)
    s = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)  # [BN] float32
    if ASM:
        s = s * 5.192296858534828e33  # 2**112: the operands' scale (ASM_SCALE)
    if SILU:  # the matching up rows, then silu(gate) * up
        up = _w8_partial(x_ptr, w_ptr, offs_n + N, n_ok, offs_m, m_ok, K, stride_xm, t_start,
                         t_end, BLOCK_N, BLOCK_K, EVEN_K, ASM, FP8, XA, UPCAST)
        su = tl.load(s_ptr + N + offs_n, mask=n_ok, other=0.0)
        if ASM:
            su = su * 5.192296858534828e33
        store_silu_pair(tl.trans(acc * s[:, None]), tl.trans(up * su[:, None]), out_ptr,
                        ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_om, pid_n, pid_k,
                        split_k, SPLIT)
    else:
        store_output(tl.trans(acc * s[:, None]), out_ptr, ws_ptr, lock_ptr, offs_m, offs_n,
                     M, N, stride_om, pid_n, pid_k, split_k, SPLIT)


def gemv_w8_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference: (x @ Q^T) * scale in float32 -> [M, N] in x's dtype."""
    return ((x.float() @ qweight.float().t()) * scale.float()[None, :]).to(x.dtype)


def use_asm(x: torch.Tensor) -> bool:
    """The PTX operand conversions: bf16 activations on CUDA (the interpreter runs no PTX;
    e4m3x2 -> f16x2 needs sm_89+, which FP8 layers need anyway, and int8's is plain
    sm_80 PTX)."""
    return x.device.type == "cuda" and x.dtype == torch.bfloat16


def gemv_w8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, config,
            asm: bool | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 16, unit stride along K) @ (Q * scale[:, None])^T -> [M, N] in x's
    dtype; Q int8 or float8_e4m3fn [N, K] contiguous, ``scale`` float32 [N].
    ``silu_and_mul``: Q = [gate; up] (N = 2d rows) -> silu(x gate^T) * (x up^T) [M, d]."""
    m, k = x.shape
    n = qweight.shape[0]
    assert m <= MAX_M and qweight.shape == (n, k) and qweight.is_contiguous()
    assert qweight.dtype in (torch.int8, torch.float8_e4m3fn) and x.stride(1) == 1
    assert scale.shape == (n,) and scale.dtype == torch.float32
    out, ws, locks = gemv_outputs(x, config, n, silu_and_mul)
    if m == 0:
        return out
    n_out = out.shape[1]
    grid = (triton.cdiv(n_out, config.tile_rows), config.split_k)
    _gemv_w8_kernel[grid](
        x, qweight, scale, out, out if ws is None else ws, out if locks is None else locks,
        m, n_out, k, x.stride(0), n_out, config.split_k, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0, SPLIT=ws is not None,
        ASM=use_asm(x) if asm is None else asm, FP8=qweight.dtype == torch.float8_e4m3fn,
        SILU=silu_and_mul, XA=config.xa, UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16,
        ROWS=config.tile_rows, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
