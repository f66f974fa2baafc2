"""The packed int4 layout every 4-bit weight format is repacked into on the GPU (described
in ``w4a16_gemm.py``'s docstring): packing and unpacking, the float32 weight it stands
for, and the in-register nibble-plane decode the int4 kernels share (``w4a16_gemm``,
``int4_dequant``, ``gemv_w4``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PACK_K = 256  # inputs per packed tile: 8 planes of 32
PLANE = PACK_K // 8


@triton.jit
def nibble_plane(words, hi, i: tl.constexpr):
    """Plane i of a word tile as exact float32 values 0..15 (same shape and layout as
    ``words``; ``hi`` = ``words >> 12``), with one logic op and one add per value and no
    conversion instruction: the nibble, masked in place at bit 4 j, is OR-ed into the
    mantissa of float32 2**(23 - 4 j), whose last place is then 2**-(4 j), so the
    float reads 2**(23 - 4 j) + q; subtracting 2**(23 - 4 j) leaves q. Nibbles above
    bit 19 would reach the exponent: planes 5..7 come from ``hi`` (nibbles 2..4)."""
    # Statement-level ifs on the constexpr plane index: resolved when the kernel is
    # compiled (a conditional expression would become a runtime select on Triton 3.6).
    if i < 5:
        bits = (words & (0xF << (4 * i))) | ((150 - 4 * i) << 23)
        q = bits.to(tl.float32, bitcast=True) - ((1 << (23 - 4 * i)) * 1.0)
    else:
        bits = (hi & (0xF << (4 * (i - 3)))) | ((150 - 4 * (i - 3)) << 23)
        q = bits.to(tl.float32, bitcast=True) - ((1 << (23 - 4 * (i - 3))) * 1.0)
    return q


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] (K a multiple of 8) -> int32 words [N, Kp / 8] in the
    nibble-plane layout (K zero-padded to a multiple of 256)."""
    n, k = values.shape
    kp = triton.cdiv(k, PACK_K) * PACK_K
    v = torch.zeros((n, kp), dtype=torch.int32, device=values.device)
    v[:, :k] = values.to(torch.int32)
    v = v.view(n, kp // PACK_K, 8, PLANE).transpose(2, 3)  # [N, T, w, i]: input 32 i + w
    shifts = torch.arange(8, dtype=torch.int32, device=values.device) * 4
    words = (v << shifts).sum(-1, dtype=torch.int32)  # disjoint bits: sum = or
    return words.reshape(n, kp // 8).contiguous()


def unpack_int4(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """int32 words [N, Kp / 8] -> int64 values 0..15 [N, k] (the layout's definition)."""
    n, kw = qweight.shape
    shifts = torch.arange(8, dtype=torch.int64, device=qweight.device) * 4
    v = (qweight.to(torch.int64).unsqueeze(-1) >> shifts) & 15  # [N, Kp/8, 8]: word, nibble
    v = v.view(n, kw // PLANE, PLANE, 8).transpose(2, 3)  # [N, T, i, w]
    return v.reshape(n, kw * 8)[:, :k]


def dequantize_int4(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    group: int) -> torch.Tensor:
    """The float32 weight [N, K] the packed tensors stand for (K = groups x group)."""
    k = scale.shape[1] * group
    q = unpack_int4(qweight, k).float()
    s = scale.float().repeat_interleave(group, dim=1)
    b = -8.0 * s if bias is None else bias.float().repeat_interleave(group, dim=1)
    return q * s + b
