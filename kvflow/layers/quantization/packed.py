"""The CPU fast paths: PyTorch's packed int4 and int8 weight-only matmuls, and the one
weight form every 4-bit and 8-bit block format is converted to at load.

``Int4Groups`` is that form: 4-bit values 0..15 and, per group of 32 along the input, a
scale and a zero with ``w = (v - 8) * scale + zero`` (the convention of
``aten._weight_int4pack_mm_for_cpu``). Affine 4-bit blocks (GGUF Q4_0, Q4_1, Q4_K's
sub-blocks, our int4) map onto it exactly. 8-bit blocks (Q8_0) map onto it as two nibbles
per value over a doubled input: ``w = hi_part + lo_part`` where the input is fed twice,
so one int4 GEMM of width 2K computes them both.

Both aten ops are fast only with bfloat16 activations on CPU (their float32 and float16
paths are scalar loops, 100x slower), so the fast path rounds the activations and the
scales to bfloat16 and returns to the model dtype after; docs/quantization.md shows
what that costs (KL divergence against the dense model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_ACT_DTYPE = torch.bfloat16


@dataclass
class Int4Groups:
    """Affine 4-bit weights in groups along the input (K) dimension."""

    values: torch.Tensor
    """uint8 [N, K2] in 0..15, one value per byte (K2 = K, or 2K when ``doubled``)."""
    scale: torch.Tensor
    """float32 [N, K2 // group]."""
    zero: torch.Tensor
    """float32 [N, K2 // group]."""
    group: int = 32
    doubled: bool = False
    """8-bit weights as [hi nibbles | lo nibbles]: w = part[:, :K] + part[:, K:]."""

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        k2 = self.values.shape[1]
        return k2 // 2 if self.doubled else k2

    def dequantize(self) -> torch.Tensor:
        """The reference weight: float32 [N, K]."""
        n, k2 = self.values.shape
        g = self.group
        v = self.values.float().view(n, k2 // g, g)
        w = ((v - 8.0) * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).view(n, k2)
        if self.doubled:
            k = k2 // 2
            w = w[:, :k] + w[:, k:]
        return w

    @staticmethod
    def cat(parts: list["Int4Groups"]) -> "Int4Groups":
        """Stack along the output dimension (merged q/k/v or gate/up shards)."""
        first = parts[0]
        return Int4Groups(torch.cat([p.values for p in parts]),
                          torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]), first.group, first.doubled)

    @staticmethod
    def from_int8_blocks(q: torch.Tensor, d: torch.Tensor, group: int = 32) -> "Int4Groups":
        """w = d * q for int8 q [N, K] and per-group scales d [N, K // group], exactly."""
        u = q.to(torch.int16) + 128  # 0..255
        hi, lo = (u >> 4).to(torch.uint8), (u & 15).to(torch.uint8)
        d = d.float()
        # hi part: (hi - 8) * 16d = 16 d hi - 128 d; lo part: (lo - 8) d + 8 d = d lo.
        return Int4Groups(torch.cat([hi, lo], dim=1), torch.cat([16 * d, d], dim=1),
                          torch.cat([torch.zeros_like(d), 8 * d], dim=1), group, True)


def quantize_int4(w: torch.Tensor, group: int, symmetric: bool) -> Int4Groups:
    """Round-to-nearest 4-bit quantization of a float weight [N, K] in groups along K."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    if symmetric:
        amax = wg.abs().amax(-1).clamp_min(1e-12)
        scale = amax / 7.0  # -7..7 used (plus -8), centered at 8
        v = torch.clamp(torch.round(wg / scale.unsqueeze(-1)), -8, 7) + 8
        zero = torch.zeros_like(scale)
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15.0).clamp_min(1e-12)
        v = torch.clamp(torch.round((wg - lo.unsqueeze(-1)) / scale.unsqueeze(-1)), 0, 15)
        zero = lo + 8.0 * scale  # so that (v - 8) * scale + zero = lo + v * scale
    return Int4Groups(v.to(torch.uint8).reshape(n, k), scale, zero, group)


def quantize_int8(w: torch.Tensor, amax: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 [N, K], scale float32 [N]). ``amax``
    [N]: each row's largest magnitude when ``w`` holds only part of the row (a
    tensor-parallel slice), so every slice uses the whole row's scale."""
    if amax is None:
        amax = w.float().abs().amax(-1)
    scale = (amax.float() / 127.0).clamp_min(1e-12)
    q = torch.clamp(torch.round(w.float() / scale.unsqueeze(-1)), -127, 127).to(torch.int8)
    return q, scale


class PackedInt4:
    """``Int4Groups`` repacked for ``aten._weight_int4pack_mm_for_cpu``."""

    def __init__(self, w: Int4Groups) -> None:
        self.group = w.group
        self.doubled = w.doubled
        self.out_features = w.out_features
        # [N, K2 / 2] uint8 in the op's own nibble order.
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            w.values.to(torch.int32).contiguous(), 1)
        # [K2 / group, N, 2]: (scale, zero) per group, as the op wants them.
        self.scale_zero = torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(
            CPU_ACT_DTYPE).contiguous()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.packed, "scales_and_zeros": self.scale_zero}


def gemv_layout(w: Int4Groups) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``w`` in the layout of the C++ step's 4-bit GEMV (kvflow/cpu/int4.cpp):
    (values int32 [N, K2 / 8], scale_bias float32 [N, K2 / group, 2]). Per block of 64
    inputs, word i holds input 8j + i in bits 4j..4j+3; the weight is ``v * scale + bias``
    (bias = zero - 8 scale). None when the group is not a multiple of 32 or K2 not of 64
    (the GEMV reads whole blocks)."""
    n, k2 = w.values.shape
    if w.group % 32 or k2 % w.group or k2 % 64:
        return None
    # int32 all the way (int64 temporaries made this most of a GGUF model's load time):
    # the nibbles are disjoint, so OR-ing them in is their sum, and bit 31 wraps to the
    # word's sign as the C++ side reads it
    v = w.values.to(torch.int32).view(n, k2 // 64, 8, 8)  # [N, blocks, j, i]
    words = v[:, :, 0]
    for j in range(1, 8):
        words = words | (v[:, :, j] << (4 * j))
    q = words.reshape(n, k2 // 8)
    scale = w.scale.float()
    sb = torch.stack([scale, w.zero.float() - 8.0 * scale], dim=-1).contiguous()
    return q.contiguous(), sb


def q8_layout(q: torch.Tensor, sb: torch.Tensor, group: int, doubled: bool
              ) -> tuple[torch.Tensor, int] | None:
    """``gemv_layout``'s (values, scale_bias) converted for the C++ step's int8-activation
    GEMV (``q8_gemv`` in kvflow/cpu/int4.cpp): (blocks uint8 [N, K / 64 * B], bits).
    Per block of 64 inputs, B bytes: the values, then (scale, bias) of its two halves of
    32 in float16 (w = u * scale + bias). 4-bit (B = 40): byte i holds value i (low
    nibble) and i + 32 (high); a doubled 8-bit weight whose high half's scales are 16x
    its low half's (Q8_0, ``Int4Groups.from_int8_blocks``) becomes one byte per input
    u = 16 hi + lo (B = 72), and so do 4-bit shards widened into it (u = lo). Float16 holds GGUF's Q4_0 / Q4_1 / Q8_0 scales and mins
    exactly (the file stores them so); others round (relative 2^-11, far below the int8
    activations' rounding). None when the weight has no such form (a doubled weight of
    other scales, K not a multiple of 64)."""
    n, k2 = q.shape[0], q.shape[1] * 8
    words = q.view(n, k2 // 64, 1, 8)  # [N, blocks, 1, i] int32
    shifts = (4 * torch.arange(8, dtype=torch.int32)).view(1, 1, 8, 1)
    # input 8j + i of a block, 0..15 (the mask drops the sign bits of >>): [N, K2] uint8
    v = ((words >> shifts) & 15).to(torch.uint8).reshape(n, k2)
    per32 = sb.view(n, k2 // group, 2).repeat_interleave(group // 32, dim=1)  # [N, K2/32, 2]
    if not doubled:
        k, u, out_sb, bits = k2, v, per32, 4
    else:
        k = k2 // 2
        hi, lo = per32[:, :k // 32], per32[:, k // 32:]
        # Per block: 8-bit (high scale 16x the low one), or a 4-bit shard widened into
        # a doubled layer (high scale 0: its high half adds only its bias).
        wide = hi[..., 0] == 0
        if not bool(((hi[..., 0] == 16 * lo[..., 0]) | wide).all()):
            return None
        hv = v[:, :k] * (~wide).repeat_interleave(32, dim=1)
        u = 16 * hv + v[:, k:]
        out_sb = torch.stack([lo[..., 0], (hi[..., 1].double() + lo[..., 1].double()).float()],
                             dim=-1)
        bits = 8
    if k % 64:
        return None
    blocks = k // 64
    if bits == 4:
        half = u.view(n, blocks, 2, 32)  # [N, blocks, half, i]
        vals = (half[:, :, 0] | (half[:, :, 1] << 4)).to(torch.uint8)  # [N, blocks, 32]
    else:
        vals = u.to(torch.uint8).view(n, blocks, 64)
    scales = out_sb.to(torch.float16).reshape(n, blocks, 4).view(torch.uint8)  # 8 bytes
    return torch.cat([vals, scales], dim=-1).reshape(n, -1).contiguous(), bits


def q8_dequantize(w: torch.Tensor, bits: int) -> torch.Tensor:
    """The float32 weight [N, K] of a ``q8_layout`` (tests and the step's self-check)."""
    bb = 40 if bits == 4 else 72
    n, blocks = w.shape[0], w.shape[1] // bb
    blk = w.view(n, blocks, bb)
    if bits == 4:
        p = blk[:, :, :32]
        u = torch.stack([p & 15, p >> 4], dim=2).reshape(n, blocks, 64)
    else:
        u = blk[:, :, :64]
    sb = blk[:, :, bb - 8:].contiguous().view(torch.float16).float().view(n, blocks, 2, 2)
    uf = u.float().view(n, blocks, 2, 32)
    return (uf * sb[..., :1] + sb[..., 1:]).reshape(n, blocks * 64)


def q8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What ``q8_gemv`` computes, in float64: x [M, K] rounded per row and block of 32 to
    int8 (scale max|x| / 127, half to even) and dequantized, times the float weight
    w [N, K]."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    # A true division (``127.0 / amax`` would be amax.reciprocal() * 127, another rounding).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.clamp(torch.round(xb * inv), -127, 127)
    xd = (q.double() * (amax / 127.0).double()).view(m, k)
    return xd @ w.double().t()


# Up to this many rows the packed ops run on one thread. They split every call across the
# intra-op threads, and on a shared (oversubscribed) machine each split waits for a
# descheduled thread: measured on the 2-core dev machine at load 20, a 30-layer SmolLM2
# decode step's GEMMs took 14 ms on one thread and 260 ms on two (float32 F.linear: 99 ms
# and 131 ms). A decode-sized GEMM is memory-bound, so one core loses little on a quiet
# machine either (benchmarks/cpu_quant_linears.py).
SINGLE_THREAD_ROWS = 16


def _run(op, x: torch.Tensor, *args) -> torch.Tensor:
    if x.shape[0] > SINGLE_THREAD_ROWS or x.device.type != "cpu":
        return op(x, *args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # about 0.1 us; the thread pool is kept
    try:
        return op(x, *args)
    finally:
        torch.set_num_threads(threads)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int,
            doubled: bool) -> torch.Tensor:
    """x [M, K] (any float dtype) @ W^T -> [M, N] in x's dtype."""
    xb = x.to(CPU_ACT_DTYPE)
    if doubled:
        xb = torch.cat([xb, xb], dim=-1)  # [M, 2K]: one GEMM does both nibble halves
    y = _run(torch.ops.aten._weight_int4pack_mm_for_cpu, xb, packed, group, scale_zero)
    return y.to(x.dtype)


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (scale[:, None] * q)^T -> [M, N] in x's dtype; q int8 [N, K]."""
    y = _run(torch.ops.aten._weight_int8pack_mm, x.to(CPU_ACT_DTYPE), q, scale)
    return y.to(x.dtype)


def refine_top_logits(x: torch.Tensor, y: torch.Tensor, rows, k: int = 32) -> torch.Tensor:
    """Recompute the ``k`` largest logits of each row of ``y`` [M, V] in float32.

    The bfloat16 output of the packed ops has 8 significant bits: logits near 16 come out
    in steps of 1/16, enough to tie or swap the top two tokens of a confident model. The
    tokens that sampling can pick are among the largest few, so those are recomputed
    exactly from their weight rows (``rows(ids) -> float32 [len(ids), K]``): a few dozen
    rows per token instead of the whole table."""
    k = min(k, y.shape[-1])
    top = y.topk(k, dim=-1).indices  # [M, k]
    w = rows(top.reshape(-1)).view(*top.shape, -1)  # [M, k, K]
    exact = torch.einsum("mk,mjk->mj", x.float(), w)
    return y.scatter(-1, top, exact.to(y.dtype))


def flatten_tokens(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The aten ops take 2-D inputs; [..., K] -> [M, K] and the leading shape."""
    lead = x.shape[:-1]
    return x.reshape(-1, x.shape[-1]), tuple(lead)
