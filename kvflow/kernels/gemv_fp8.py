"""FP8 W8A8 decode GEMV on the FP8 tensor cores: ``y = (xq @ wq^T) * sx[:, None] *
sw[None, :]`` for xq [M, K] float8_e4m3fn activations already quantized per token (M <= 16,
scales ``sx`` float32 [M]) and wq [N, K] float8_e4m3fn weights with one scale per output
channel (``sw`` float32 [N]): the numbers of the W8A8 path at every other M
(``layers/quantization/fp8.py``: per-token quantization + ``torch._scaled_mm``).

Why a third form next to the weight-dequant GEMV (``gemv_w8.py``: bf16 activations, the FP8
weight widened to bf16 in registers): there the weight tile goes global -> shared memory
-> registers (conversion) -> the MMA, and that kernel read FP8 weights at 2.1-2.8 TB/s on
the H200 where the dense bf16 GEMV (``gemv.py``) streams at 3.3-4.2. Here both operands
are FP8, so the loop is the dense GEMV's: the [BLOCK_N, BLOCK_K] weight tile is the
wgmma's wide operand straight from the pipelined shared-memory stages, x^T [BLOCK_K, 16]
(rows >= M zero) its narrow one, float32 accumulation; nothing is converted. The
activations must arrive quantized: ``rms_norm.rms_norm_fp8`` writes them from the norm
that precedes qkv and gate/up (no extra launch), the SiLU form's FP8 output for down
(``fp8_out``, read as per-group scales: ``XGROUP``), ``fp8_quant.quantize_fp8`` for the
others (one small launch).

Hopper's FP8 MMA sums in reduced precision (about 13-14 mantissa bits); ``promote``
(``tl.dot``'s ``max_num_imprecise_acc``) sets how many inputs it sums before the partial
goes into the float32 accumulator; 0 (the compiler's default) never promotes in the
chained K loop, so the whole K is summed in reduced precision (measured 0.12-0.35 % of
the output's range on the H200); the tables use 128, as ``torch._scaled_mm`` does.

Grid ``(cdiv(N, ROWS), split_k)`` (ROWS: ``config.tile_rows``, BLOCK_N or fewer for a
grid balanced over the SMs, ``gemv.tile_rows``; not with ``fp8_out``, whose quantization
groups are whole BLOCK_N-wide tiles); split-K partials are summed in the launch
(``woq_config.store_output``); the SiLU form (``silu_and_mul``: a merged [gate; up]
weight) writes ``silu(gate) * up`` through ``gemv.store_silu_pair``. Configurations:
``woq_gemv_config`` (formats ``fp8a8``, ``fp8a8-silu``, ``fp8a8-siluq``, ``fp8a8-xg``).
Reference: ``gemv_fp8_ref`` (float32 products of the FP8 values, exact). Traffic at
M = 1: N K bytes of weight + K of activation + 4 (N + 1) of scales; gate_up of
Llama-3.1-8B 117 MB, 28 us at 4.2 TB/s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.fp8_quant import fp8_scale, fp8_values
from kvflow.kernels.gemv import (gemv_outputs, load_tiles, silu_mul_rounded, store_silu_pair,
                                 tile_rows)
from kvflow.kernels.woq_config import store_output

MAX_M = 16


@triton.jit
def _fp8_partial(xq_ptr, w_ptr, rows, n_ok, offs_m, m_ok, K, stride_xm, t_start, t_end,
                 sx_ptr, stride_sxm,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PROMOTE: tl.constexpr, UPCAST: tl.constexpr, XGROUP: tl.constexpr):
    """sum over the K tiles t_start .. t_end of Wq[rows] . xq -> [BN, 16] float32.
    ``XGROUP``: x carries one scale per row and K tile (``sx[m, t]``, BLOCK_K inputs per
    group): each tile's dot starts from zero and is scaled before it is added."""
    BM: tl.constexpr = 16
    rows_w = rows.to(tl.int64)[:, None] * K  # [BN, 1]
    acc = tl.zeros((BLOCK_N, BM), dtype=tl.float32)
    for t in range(t_start, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        w, x = load_tiles(w_ptr, rows_w, n_ok, xq_ptr, offs_m, m_ok, stride_xm, offs_k, K,
                          EVEN_K)  # [BN, BK], [BM, BK]
        if XGROUP:
            if UPCAST:
                part = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)),
                              input_precision="ieee")
            else:
                part = tl.dot(w, tl.trans(x))  # [BN, BM], one group: promoted once
            sxt = tl.load(sx_ptr + offs_m * stride_sxm + t, mask=m_ok, other=0.0)  # [BM]
            acc += part * sxt[None, :]
        elif UPCAST:  # CPU interpreter: FP8 values widened exactly, float32 products
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        elif PROMOTE > 0:
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
        else:
            acc = tl.dot(w, tl.trans(x), acc)  # [BN, BK] @ [BK, BM]
    return acc


@triton.jit
def _gemv_fp8_kernel(xq_ptr, sx_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K,
                     stride_xm, stride_om, split_k, stride_sxm, oscale_ptr,
                     BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
                     SILU: tl.constexpr, PROMOTE: tl.constexpr, UPCAST: tl.constexpr,
                     ROWS: tl.constexpr, XGROUP: tl.constexpr = False,
                     OUT_FP8: tl.constexpr = False):
    """N: the output width (SILU: the gate rows; the up rows follow them in the weight).
    ROWS <= BLOCK_N: the output rows this program owns (``gemv.tile_rows``; the lanes past
    them name row N, which every ``n_ok`` mask drops: weight, scale and output alike).
    ``XGROUP``: per-(row, K tile) activation scales ``sx [M, K / BLOCK_K]`` (K-indexed:
    any ROWS). ``OUT_FP8`` (SILU, no split-K, ROWS = BLOCK_N): ``silu(gate) * up``
    quantized to FP8 per row and BLOCK_N-wide group, scales into ``oscale [M, N /
    BLOCK_N]`` (the next GEMV's XGROUP input)."""
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
    acc = _fp8_partial(xq_ptr, w_ptr, offs_n, n_ok, offs_m, m_ok, K, stride_xm, t_start,
                       t_end, sx_ptr, stride_sxm, BLOCK_N, BLOCK_K, EVEN_K, PROMOTE, UPCAST,
                       XGROUP)
    if XGROUP:  # the activation scales are in the sums already
        sx = tl.full((BM,), 1.0, tl.float32)
    else:
        sx = tl.load(sx_ptr + offs_m, mask=m_ok, other=0.0)  # [BM] float32
    sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=0.0)  # [BN] float32
    y = tl.trans(acc * sw[:, None]) * sx[:, None]  # [BM, BN], as fp8_mm_ref scales
    if SILU:  # the matching up rows, then silu(gate) * up
        up = _fp8_partial(xq_ptr, w_ptr, offs_n + N, n_ok, offs_m, m_ok, K, stride_xm,
                          t_start, t_end, sx_ptr, stride_sxm, BLOCK_N, BLOCK_K, EVEN_K,
                          PROMOTE, UPCAST, XGROUP)
        su = tl.load(sw_ptr + N + offs_n, mask=n_ok, other=0.0)
        u = tl.trans(up * su[:, None]) * sx[:, None]
        if OUT_FP8:
            # program pid_n's columns are scale group pid_n: only whole tiles are groups
            tl.static_assert(ROWS == BLOCK_N, "OUT_FP8 quantizes whole BLOCK_N tiles")
            _store_silu_mul_fp8(y, u, out_ptr, oscale_ptr, offs_m, offs_n, M, N, stride_om,
                                pid_n, BLOCK_N, UPCAST)
        else:
            store_silu_pair(y, u, out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N,
                            stride_om, pid_n, pid_k, split_k, SPLIT)
    else:
        store_output(y, out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_om, pid_n,
                     pid_k, split_k, SPLIT)


@triton.jit
def _store_silu_mul_fp8(gate, up, out_ptr, oscale_ptr, offs_m, offs_n, M, N, stride_om,
                        group, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr):
    """gate, up [BM, BN] float32 -> h = silu(gate) * up rounded as the unfused path rounds
    it (``gemv.silu_mul_rounded``), then quantized to FP8 per row over these BN columns
    as ``quantize_fp8(h, group=BN)`` does: the bytes into out [M, N] (float8) and the
    scale into oscale [M, N / BN] at column ``group``."""
    o_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    h = tl.where(o_mask, silu_mul_rounded(gate, up, tl.bfloat16).to(tl.float32), 0.0)
    s = fp8_scale(tl.max(tl.abs(h), axis=1))  # [BM]
    n_groups = tl.cdiv(N, BLOCK_N)
    tl.store(oscale_ptr + offs_m * n_groups + group, s, mask=offs_m < M)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             fp8_values(h, s[:, None], EMULATE), mask=o_mask)


def gemv_fp8_ref(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Reference: (xq @ wq^T) * sx[:, None] * sw[None, :] in float32 -> [M, N] in
    ``out_dtype`` (the products of two FP8 values are exact in float32)."""
    acc = xq.float() @ wq.float().t()
    return (acc * sw.float()[None, :] * sx.float()[:, None]).to(out_dtype)


def gemv_fp8(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
             config, out_dtype: torch.dtype = torch.bfloat16, silu_and_mul: bool = False,
             fp8_out: bool = False):
    """xq [M, K] float8_e4m3fn (M <= 16, unit stride along K) with per-row scales sx [M],
    or per row and ``config.block_k``-wide K group sx [M, cdiv(K, block_k)] (as
    ``quantize_fp8(x, group=block_k)`` and ``fp8_out`` write them), times wq [N, K]
    float8_e4m3fn with per-channel scales sw [N] -> [M, N] in ``out_dtype``.
    ``silu_and_mul``: wq = [gate; up] (N = 2d rows) -> silu(gate) * up [M, d];
    with ``fp8_out`` (no split-K) that product quantized per row and ``block_n``-wide
    group -> (float8 [M, d], float32 scales [M, d / block_n]); each program's tile is one
    group there, so balanced rows (``config.rows`` < ``block_n``) are refused with it.
    ``config``: a ``woq_gemv_config.WoqGemvConfig`` (``promote`` and ``rows`` included)."""
    m, k = xq.shape
    n = wq.shape[0]
    assert m <= MAX_M and wq.shape == (n, k) and wq.is_contiguous() and xq.stride(1) == 1
    assert xq.dtype == torch.float8_e4m3fn and wq.dtype == torch.float8_e4m3fn
    x_group = sx.dim() == 2
    assert sx.dtype == torch.float32 and sx.shape == (
        (m, triton.cdiv(k, config.block_k)) if x_group else (m,))
    assert sw.shape == (n,) and sw.dtype == torch.float32
    oscale = None
    if fp8_out:
        d = n // 2
        assert silu_and_mul and config.split_k == 1 and d % config.block_n == 0
        # oscale [m, d / block_n]: scale group g = program g's block_n columns; a program
        # owning fewer rows would quantize groups of another width at other offsets than
        # the XGROUP reader's K steps
        assert config.tile_rows == config.block_n, (
            f"fp8_out quantizes whole {config.block_n}-row tiles: no balanced rows "
            f"(rows={config.rows}) with it")
        assert out_dtype == torch.bfloat16, "the SiLU product is rounded to bf16 first"
        out = torch.empty((m, d), dtype=torch.float8_e4m3fn, device=xq.device)
        oscale = torch.empty((m, d // config.block_n), dtype=torch.float32, device=xq.device)
        ws = locks = None
    else:
        out, ws, locks = gemv_outputs(xq, config, n, silu_and_mul, out_dtype)
    if m == 0:
        return (out, oscale) if fp8_out else out
    n_out = out.shape[1]
    grid = (triton.cdiv(n_out, config.tile_rows), config.split_k)
    _gemv_fp8_kernel[grid](
        xq, sx, wq, sw, out, out if ws is None else ws, out if locks is None else locks,
        m, n_out, k, xq.stride(0), n_out, config.split_k, sx.stride(0),
        sx if oscale is None else oscale, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0, SPLIT=ws is not None,
        SILU=silu_and_mul, PROMOTE=config.promote, UPCAST=xq.device.type == "cpu",
        ROWS=config.tile_rows, XGROUP=x_group, OUT_FP8=fp8_out,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return (out, oscale) if fp8_out else out
