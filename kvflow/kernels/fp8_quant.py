"""Dynamic FP8 (E4M3) quantization of activations: x [M, K] -> xq float8_e4m3fn [M, K]
and float32 scales, one per token (``group=None``: [M]) or one per 1 x ``group`` slice
along K (DeepSeek-style block FP8: [M, ceil(K / group)]).

``s = max|x| * (1 / 448)`` over the token (or group), ``q = rne(clamp(x / s, +-448))``;
an all-zero token or group gets ``s = 1``. The reference is ``quantize_fp8_ref``; the
kernel gives the same bytes on every device (the scale is a multiplication by the
float32 1/448, because torch divides a CUDA tensor by a Python number as exactly that
and by true division on CPU; ``x / s`` is IEEE division everywhere; the cast rounds to
nearest even).

One launch replaces the five elementwise kernels (abs, amax, div, clamp, cast) of the
torch version, which cost more than the FP8 GEMM saves at small M. The GEMM kernel
(``fp8_gemm``) quantizes inside its own loop for small M; this kernel serves the large
M path (``torch._scaled_mm`` and the block GEMM), where re-quantizing the activation
tile in every output-column program would cost more than one pass over x.

The interpreter's float32 -> e4m3 cast does not round to nearest even (it rounds half
up and drops carries into the exponent), so under ``TRITON_INTERPRET`` the value is
rounded onto the e4m3 grid in float32 first (``round_e4m3``) and the cast is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
INV_FP8_MAX = 1.0 / FP8_MAX  # as float32: what torch multiplies by for `cuda_tensor / 448`
F8MAX = tl.constexpr(448.0)  # as the kernels may read a global
F8INV = tl.constexpr(1.0 / 448.0)
_ONE_PASS_MAX = 16384  # per-token rows up to this wide are quantized in one pass


def interpreting(device: torch.device) -> bool:
    """Tensors on the CPU reach Triton kernels only through its interpreter."""
    return torch.device(device).type == "cpu"


@triton.jit
def round_e4m3(v):
    """v (float32, |v| <= 448) rounded to nearest even on the e4m3 grid, in float32:
    adding c = 2^23 ulp (ulp: e4m3's step in v's binade, 2^-9 below 2^-6) makes the
    float32 sum round at that step; subtracting c again is exact."""
    a = tl.abs(v)
    e = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 121)  # 121: 2^-6, the smallest normal
    c = ((e + 20) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127 - 3 + 23)
    r = (a + c) - c
    return tl.where(v < 0, -r, r)


@triton.jit
def fp8_scale(amax):
    """max|x| of a token or group (float32) -> its scale: ``amax * (1 / 448)`` (the float32
    multiplication torch does), 1 where the values are all zero."""
    s = amax * F8INV
    return tl.where(s > 0, s, 1.0)


@triton.jit
def fp8_values(x, s, EMULATE: tl.constexpr):
    """x / s (float32, broadcast) saturated to +-448 and cast to E4M3, round to nearest
    even: the bytes of ``quantize_fp8_ref`` (``EMULATE``: under the interpreter, whose
    cast does not round so, rounded onto the e4m3 grid first)."""
    v = tl.clamp(tl.math.div_rn(x, s), -F8MAX, F8MAX)
    if EMULATE:
        v = round_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                  GROUP: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    """One program per (row, group) with BLOCK = GROUP, or per token (GROUP 0, one group
    of the whole row): a group of at most BLOCK inputs is read once; a longer token in
    BLOCK-wide passes twice (the max, then the values; the row is in L1/L2 the second
    time)."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    if GROUP == 0 and BLOCK < K:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = fp8_scale(tl.max(amax, axis=0))
        tl.store(s_ptr + row * stride_sm, s)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            tl.store(q_row + offs, fp8_values(x, s, EMULATE), mask=offs < K)
    else:  # the group (or the whole token) in registers: one pass
        g = tl.program_id(1)
        offs = g * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        s = fp8_scale(tl.max(tl.abs(x), axis=0))
        tl.store(s_ptr + row * stride_sm + g, s)
        tl.store(q_row + offs, fp8_values(x, s, EMULATE), mask=offs < K)


def quantize_fp8_ref(x: torch.Tensor, group: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: x [M, K] -> (float8_e4m3fn [M, K], float32 [M] per token or
    [M, ceil(K / group)] per group)."""
    m, k = x.shape
    xf = x.float()
    if group is None:
        s = xf.abs().amax(dim=-1) * INV_FP8_MAX  # [M]
        s = torch.where(s > 0, s, torch.ones_like(s))
        return (xf / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s
    kg = -(-k // group)
    xp = torch.nn.functional.pad(xf, (0, kg * group - k)).view(m, kg, group)
    s = xp.abs().amax(dim=-1) * INV_FP8_MAX  # [M, Kg]
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (xp / s[..., None]).clamp_(-FP8_MAX, FP8_MAX).view(m, kg * group)[:, :k]
    return q.to(torch.float8_e4m3fn), s


def quantize_fp8(x: torch.Tensor, group: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8_ref`` in one launch. x [M, K] bf16/fp16/fp32, unit stride along K;
    ``group`` a power of two (the block FP8 kernel's 128)."""
    m, k = x.shape
    assert x.stride(1) == 1 and (group is None or group & (group - 1) == 0)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    kg = 1 if group is None else triton.cdiv(k, group)
    s = torch.empty((m, kg), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s if group else s.view(m)
    # Per token: a row of up to 16K inputs in one pass from registers (decode rows: the
    # input of an FP8 GEMV, where a 14336-wide row took 9.3 us in two 4096-wide passes on
    # the H200 against ~3 for a 4096-wide one); longer rows in two passes.
    block = group or min(triton.next_power_of_2(k), _ONE_PASS_MAX)
    warps = 1 if group is not None else max(4, min(16, block // 1024))
    _quant_kernel[(m, kg)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
                           GROUP=group or 0, BLOCK=block, EMULATE=interpreting(x.device),
                           num_warps=warps)
    return q, (s if group else s.view(m))
