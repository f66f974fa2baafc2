"""FP8 (E4M3) W8A8 GEMM for the GPU: ``y = dequant(xq) @ dequant(wq)^T`` with FP8
operands on the tensor cores and float32 sums, in two scale layouts:

- **per channel** (``block=None``): ``w_scale`` float32 [N], one activation scale per
  token; ``y = (xq @ wq^T) * sx[:, None] * sw[None, :]`` (the ``--quantization fp8``
  layout; ``torch._scaled_mm`` computes the same for large M).
- **block-wise** (``block`` = (R, G), DeepSeek-style (128, 128)): ``w_scale`` float32
  [ceil(N / R), ceil(K / G)], one scale per R x G weight block (R = 1 when a merged
  layer's shards do not fall on block boundaries: each row then carries its block's
  scale), and one activation scale per 1 x G slice of a token. BLOCK_K = G, so
  each K step multiplies one group: ``acc += (xq_t @ wq_t^T) * sx[:, t] * sw[n // R, t]``.

Activations arrive in two forms (``xq``):

- **bf16/fp16/fp32** (decode, small M): the kernel quantizes them itself, so a linear
  is one launch. Per group, each K tile's max gives its scale; per token, a prologue
  reads the program's rows once for their max (at M <= 8 a row is 8-28 KB, from L2
  after the first program). Every output-column program repeats this work, which is
  nothing next to its weight tile when M is small.
- **pre-quantized** float8 + scales from ``fp8_quant.quantize_fp8`` (large M: one pass
  over x instead of one per column tile).

Decode (M <= ``SMALL_M``) splits K over programs as the weight-only GEMV does
(``woq_config``: about 4 programs per SM, deterministic split-K reduction in the same
launch); the weight tile goes to the tensor cores as FP8, without conversion.
``swap_ab`` computes ``(wq_t @ xq_t^T)^T`` instead, so the weight tile is the dot's
M operand (64+ rows: Hopper's wgmma) and the padded token rows its N (8+).

Reference: ``fp8_gemm_ref``. Traffic at M = 1: N K bytes of weight, half of bf16.
Under the interpreter (CPU) the FP8 tiles are widened to float32 for the dot (its dot
multiplies raw bytes otherwise) and the quantization rounds as ``round_e4m3`` says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvflow.kernels.fp8_quant import fp8_scale, fp8_values, interpreting, quantize_fp8
from kvflow.kernels.woq_config import _sms, split_buffers, store_output

SMALL_M = 16  # up to here the kernel quantizes x itself and splits K


@dataclass(frozen=True)
class Fp8Config:
    """Tile sizes of one fp8_gemm launch."""

    block_m: int
    """Token rows per program (>= 16: the dot's minimum)."""
    block_n: int
    """Output columns per program."""
    block_k: int
    """Inputs per K step; in block mode the group size, or a divisor of it when x comes
    quantized (one wgmma instruction's 32: no tensor-core sum spans two of them)."""
    split_k: int = 1
    """Programs sharing one output tile's K loop."""
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    """Multiply weight tile x token tile (the weight as the dot's M operand)."""
    promote_k: int = 32
    """Inputs the tensor cores sum before their partial goes into the float32 accumulator
    (``tl.dot``'s ``max_num_imprecise_acc``, capped at ``block_k``). Hopper's FP8 wgmma adds
    in reduced precision (about 13-14 mantissa bits, DeepSeek-V3 3.3.2). 0: the compiler's
    default (on sm_90 never inside a dot; each K tile's dot starts from zero and is added
    in float32, so once per ``block_k``: the error of cuBLAS's _scaled_mm). 32, one wgmma
    instruction's K: every instruction starts from zero, 3-4x less error on the H200
    (fp8-gemm-precision-h200.json), at the cost of a second accumulator in registers.
    Other targets and the interpreter ignore it."""

    def __post_init__(self) -> None:
        for v in (self.block_m, self.block_n, self.block_k):
            if v & (v - 1) or v < 16:
                raise ValueError(f"tile sizes must be powers of two >= 16: {self}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1: {self}")
        if self.promote_k < 0:
            raise ValueError(f"promote_k must be >= 0: {self}")


def choose_config(m: int, n: int, k: int, group: int | None, device: torch.device,
                  sms: int | None = None) -> Fp8Config:
    """The launch configuration for x [m, k] @ wq[n, k]^T (``group``: block mode).

    Decode: 16 x 64 x 128 tiles, ~4 programs per SM, the weight as the dot's M operand
    (``swap_ab``: Hopper's wgmma reads the FP8 tile as it is; without it the M = 16 dot
    is an mma.sync that widens every weight to fp16 first) with 8 warps: the best tiles
    of the H200 sweep at M = 1 and 8 (fp8-bench-h200.json, o and gate_up, per channel
    and block). Every wgmma instruction's partial is promoted to float32 there (0.5-3%
    of the time, 3-4x less error: fp8-gemm-precision-h200.json).

    Larger M: 64-128 x 128 tiles. Where those leave SMs idle (fewer tiles than SMs: o,
    qkv and down at M <= 256), 64 columns per tile with the promotion every instruction
    (as fast as the 128-wide tiles without it, or faster; the split-K stays the one of
    the 128-wide tiles, as measured). Otherwise (gate_up, long prefills: compute bound)
    128-wide tiles promoted once per 128-wide K tile (DeepGEMM's interval, the precision
    of cuBLAS's _scaled_mm): with a second accumulator the 128 x 128 tile spills and
    the promotion costs 15-47% there."""
    sms = sms or _sms(device)
    bk = group or 128
    swap = False
    promote = 32
    if m <= SMALL_M:
        bm, bn, warps, stages, swap = 16, 64, 8, 3, True
        target = 4 * sms
    elif m <= 64:
        bm, bn, warps, stages = 64, 128, 4, 3
        target = sms
    else:
        bm, bn, warps, stages = 128, 128, 8, 3
        target = sms
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    k_tiles = triton.cdiv(k, bk)
    split = 1
    if tiles < target:
        split = max(1, min(triton.cdiv(target, tiles), k_tiles // 2, 16))
        split = triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))  # no split left empty
    if m > SMALL_M:
        if tiles < sms:
            bn = 64
        else:
            promote = 0
    return Fp8Config(bm, bn, bk, split, warps, stages, swap, promote)


@triton.jit
def _fp8_gemm_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K,
                     stride_xm, stride_sxm, stride_swn, stride_om, split_k,
                     QUANT_X: tl.constexpr, GROUP: tl.constexpr, W_ROWS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRO_M: tl.constexpr, PRO_K: tl.constexpr, SWAP: tl.constexpr,
                     SPLIT: tl.constexpr, EMULATE: tl.constexpr, PROMOTE_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_w = offs_n[:, None].to(tl.int64) * K  # [BN, 1]
    rows_x = offs_m[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)

    # Per token: the scale of each row (from the prologue, or the given scales).
    sx = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    if GROUP == 0:
        if QUANT_X:
            offs_p = pid_m * BLOCK_M + tl.arange(0, PRO_M)  # the rows that exist, padded
            amax = tl.zeros((PRO_M, PRO_K), dtype=tl.float32)
            for k0 in range(0, K, PRO_K):
                offs = k0 + tl.arange(0, PRO_K)
                xx = tl.load(x_ptr + offs_p[:, None].to(tl.int64) * stride_xm + offs[None, :],
                             mask=(offs_p < M)[:, None] & (offs < K)[None, :], other=0.0)
                amax = tl.maximum(amax, tl.abs(xx.to(tl.float32)))
            sp = fp8_scale(tl.max(amax, axis=1))  # [PRO_M], as quantize_fp8_ref
            # into the [BM] vector of the main loop (rows past PRO_M are padding: scale 1)
            sx = tl.max(tl.where(tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, PRO_M)[None, :],
                                 sp[None, :], 0.0), axis=1)
            sx = tl.where(sx > 0, sx, 1.0)
        else:
            sx = tl.load(sx_ptr + offs_m, mask=m_ok, other=1.0)

    if SWAP:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t_start, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        g = t  # the tile's group in block mode (BLOCK_K divides GROUP)
        if GROUP > 0:
            g = (t * BLOCK_K) // GROUP
        k_ok = offs_k < K
        w = tl.load(w_ptr + rows_w + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BN, BK] fp8
        x_mask = m_ok[:, None] & k_ok[None, :]
        s_t = sx
        if QUANT_X:
            x = tl.load(x_ptr + rows_x + offs_k[None, :], mask=x_mask, other=0.0)
            x = x.to(tl.float32)  # [BM, BK]
            if GROUP > 0:  # this tile is one group: its own scale per row
                s_t = fp8_scale(tl.max(tl.abs(x), axis=1))
            xq = fp8_values(x, s_t[:, None], EMULATE)
        else:
            xq = tl.load(x_ptr + rows_x + offs_k[None, :], mask=x_mask, other=0.0)
            if GROUP > 0:
                s_t = tl.load(sx_ptr + offs_m * stride_sxm + g, mask=m_ok, other=1.0)
        if GROUP > 0:
            sw_t = tl.load(sw_ptr + (offs_n // W_ROWS) * stride_swn + g, mask=n_ok, other=0.0)
        if SWAP:  # [BN, BK] @ [BK, BM]
            if EMULATE:
                part_t = tl.dot(w.to(tl.float32), tl.trans(xq.to(tl.float32)),
                                input_precision="ieee")
            elif PROMOTE_K > 0:
                part_t = tl.dot(w, tl.trans(xq), max_num_imprecise_acc=PROMOTE_K)
            else:
                part_t = tl.dot(w, tl.trans(xq))
            if GROUP > 0:
                acc_t += part_t * sw_t[:, None] * s_t[None, :]
            else:
                acc_t += part_t
        else:  # [BM, BK] @ [BK, BN]
            if EMULATE:
                part = tl.dot(xq.to(tl.float32), tl.trans(w.to(tl.float32)),
                              input_precision="ieee")
            elif PROMOTE_K > 0:
                part = tl.dot(xq, tl.trans(w), max_num_imprecise_acc=PROMOTE_K)
            else:
                part = tl.dot(xq, tl.trans(w))
            if GROUP > 0:
                acc += part * s_t[:, None] * sw_t[None, :]
            else:
                acc += part
    if SWAP:
        acc = tl.trans(acc_t)
    if GROUP == 0:
        sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=0.0)
        acc = acc * sx[:, None] * sw[None, :]
    store_output(acc, out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_om, pid, pid_k,
                 split_k, SPLIT)


def dequantize_fp8_weight(wq: torch.Tensor, w_scale: torch.Tensor,
                          block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 weight [N, K] that ``wq`` and its scales stand for."""
    n, k = wq.shape
    if block is None:
        return wq.float() * w_scale.float()[:, None]
    r, g = block
    s = w_scale.float().repeat_interleave(r, 0)[:n].repeat_interleave(g, 1)[:, :k]
    return wq.float() * s


def fp8_gemm_ref(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                 w_scale: torch.Tensor, block: tuple[int, int] | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Reference: quantized x [M, K] (scales [M] or [M, Kb]) times wq [N, K] -> [M, N].
    ``block`` (R, G): w_scale [ceil(N / R), ceil(K / G)]; None: per channel [N]. Each
    fp8 x fp8 product is exact in float32; block mode sums each group, scales it and
    adds the groups (as the kernel's K loop does)."""
    m, k = xq.shape
    n = wq.shape[0]
    if block is None:
        acc = xq.float() @ wq.float().t()  # [M, N]
        return (acc * x_scale.float()[:, None] * w_scale.float()[None, :]).to(out_dtype)
    r, group = block
    kb = -(-k // group)
    pad = kb * group - k
    xg = torch.nn.functional.pad(xq.float(), (0, pad)).view(m, kb, group).transpose(0, 1)
    wg = torch.nn.functional.pad(wq.float(), (0, pad)).view(n, kb, group).permute(1, 2, 0)
    part = torch.bmm(xg, wg)  # [Kb, M, N]: one product per group
    sw = w_scale.float().repeat_interleave(r, 0)[:n]  # [N, Kb]
    scaled = part * x_scale.float().t()[:, :, None] * sw.t()[:, None, :]
    return scaled.sum(0).to(out_dtype)


def fp8_gemm(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             block: tuple[int, int] | None = None, x_scale: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None, config: Fp8Config | None = None
             ) -> torch.Tensor:
    """x [M, K] @ dequant(wq [N, K])^T -> [M, N].

    ``x``: the activations in a float dtype (quantized here: per token, or per 1 x group
    slice in block mode), or already float8_e4m3fn with ``x_scale`` ([M] or [M, Kb]).
    ``w_scale``: float32 [N] (``block`` None) or [ceil(N / R), ceil(K / G)] for
    ``block`` = (R, G)."""
    m, k = x.shape
    n = wq.shape[0]
    assert wq.shape == (n, k) and wq.dtype == torch.float8_e4m3fn and x.stride(1) == 1
    quant_x = x.dtype != torch.float8_e4m3fn
    assert quant_x == (x_scale is None)
    out_dtype = out_dtype or (x.dtype if quant_x else torch.bfloat16)
    w_rows, group = block or (1, None)
    if group is None:
        assert w_scale.shape == (n,) and w_scale.dtype == torch.float32
    else:
        assert w_scale.shape == (triton.cdiv(n, w_rows), triton.cdiv(k, group))
        assert w_scale.dtype == torch.float32
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    if not quant_x and x_scale.dim() == 1:
        x_scale = x_scale.contiguous()
    cfg = config or choose_config(m, n, k, group, x.device)
    # block mode: a K tile is one group, or (given quantized x) a slice of one
    assert group is None or cfg.block_k == group or (
        not quant_x and cfg.block_k < group and group % cfg.block_k == 0), (cfg, group)
    pro_m = min(cfg.block_m, triton.next_power_of_2(m))
    pro_k = max(16, min(triton.next_power_of_2(k), 8192 // pro_m))
    ws, locks = split_buffers(cfg, m, n, x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    sx = x_scale if x_scale is not None else w_scale  # unused when quantizing here
    _fp8_gemm_kernel[grid](
        x, sx, wq, w_scale, out, out if ws is None else ws, out if locks is None else locks,
        m, n, k, x.stride(0), sx.stride(0) if sx.dim() == 2 else 1,
        w_scale.stride(0) if group else 1, n, cfg.split_k,
        QUANT_X=quant_x, GROUP=group or 0, W_ROWS=w_rows, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRO_M=pro_m, PRO_K=pro_k,
        SWAP=cfg.swap_ab, SPLIT=ws is not None, EMULATE=interpreting(x.device),
        PROMOTE_K=min(cfg.promote_k, cfg.block_k), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               block: tuple[int, int] | None) -> torch.Tensor:
    """What a linear layer calls: small M quantizes inside the GEMM (one launch); large
    M quantizes x once (``quantize_fp8``), then the GEMM."""
    if x.shape[0] <= SMALL_M:
        return fp8_gemm(x, wq, w_scale, block)
    xq, sx = quantize_fp8(x, block[1] if block else None)
    return fp8_gemm(xq, wq, w_scale, block, x_scale=sx, out_dtype=x.dtype)
