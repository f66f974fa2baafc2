"""The int8 x int8 GEMM of the W8A8 methods (w8a8-int8, SmoothQuant checkpoints, the
int8 part of llm-int8), and its pure-torch reference.

Activations are quantized dynamically, one symmetric scale per token
(``sx = max|x_row| / 127``); weights carry one symmetric scale per output channel. The
product is exact in int32 and scaled once: ``y = (xq @ wq^T) * sx[:, None] * sw[None, :]``.

``torch._int_mm`` does the int32 product on CPU (oneDNN) and CUDA (cuBLASLt). CUDA needs
more than 16 rows and both K and N multiples of 8: the weight is padded once at load
(``prepare_weight``) and the activation rows per call, with zeros, which add nothing to
the sums; the padding is sliced off the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.errors import ModelLoadError

INT8_MAX = 127.0
_CUDA_MIN_ROWS = 17  # torch._int_mm on CUDA: M > 16
_CUDA_ALIGN = 8  # ... and K, N multiples of 8


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M]): one symmetric scale per row (a
    weight's output channel, an activation's token), round to nearest even. A few
    float32 rows on CPU (decode activations) take one C call
    (``cpu/kernels/quant_rows.cpp``, the same bytes); the rest the torch ops below."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] <= 16:
        from kvflow.cpu.kernels import quant_rows

        if quant_rows.supports(x):
            return quant_rows.quantize_int8_rows(x)
    return quantize_int8_rows_ref(x)


def quantize_int8_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int8_rows`` in torch ops (any device and size: the reference)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [M, 1]
    # An all-zero row gets scale 1 (and zeros). Multiplying by 127 / amax instead of
    # dividing by the scale saves a pass per call (decode: this is half the op's time).
    inv = torch.where(amax > 0, INT8_MAX / amax, torch.ones_like(amax))
    q = (xf * inv).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, (1.0 / inv).squeeze(1)


def int8_mm_ref(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """The reference: xq [M, K], wq [N, K] int8, sx [M], sw [N] -> [M, N]; the int32 sums
    computed in int64 (no overflow, no float rounding), then scaled in float32."""
    acc = xq.long() @ wq.long().t()  # [M, N], exact
    return (acc.float() * sx[:, None] * sw[None, :]).to(out_dtype)


@dataclass
class Int8Weight:
    """A per-channel int8 weight laid out for ``torch._int_mm``."""

    wt: torch.Tensor
    """int8 [Kp, Np]: the transposed weight (K, N padded to multiples of 8 on CUDA)."""
    scale: torch.Tensor
    """float32 [N]."""
    n: int
    k: int


def prepare_weight(wq: torch.Tensor, scale: torch.Tensor, what: str) -> Int8Weight:
    """int8 [N, K] and float32 [N] -> the GEMM's layout. CPU keeps ``wq^T`` as a strided
    view of the row-major [N, K] weight (oneDNN reads it as a column-major B without a
    copy; benchmarks/results/cpu-int8-gemm.json compares the layouts); CUDA pads."""
    n, k = wq.shape
    if wq.dtype != torch.int8:
        raise ModelLoadError(f"{what}: int8 weight has dtype {wq.dtype}")
    if tuple(scale.shape) != (n,):
        raise ModelLoadError(f"{what}: weight scale has shape {tuple(scale.shape)}, the "
                             f"weight needs one per output channel ({n},)")
    scale = scale.float().contiguous()
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise ModelLoadError(f"{what}: weight scales must be positive and finite")
    if wq.device.type == "cuda":
        kp, np_ = -(-k // _CUDA_ALIGN) * _CUDA_ALIGN, -(-n // _CUDA_ALIGN) * _CUDA_ALIGN
        if (kp, np_) != (k, n):
            wq = torch.nn.functional.pad(wq, (0, kp - k, 0, np_ - n))  # zeros
        # cuBLASLt's int8 kernels want B column-major: [Kp, Np] with stride (1, Kp).
        return Int8Weight(wq.contiguous().t(), scale, n, k)
    return Int8Weight(wq.contiguous().t(), scale, n, k)


def int8_mm(xq: torch.Tensor, sx: torch.Tensor, w: Int8Weight,
            out_dtype: torch.dtype) -> torch.Tensor:
    """``int8_mm_ref`` through ``torch._int_mm``: xq [M, K] int8, sx [M] -> [M, N]."""
    m = xq.shape[0]
    if xq.device.type == "cuda":
        kp = w.wt.shape[0]
        rows = max(m, _CUDA_MIN_ROWS)
        rows = -(-rows // _CUDA_ALIGN) * _CUDA_ALIGN
        if (rows, kp) != (m, w.k):  # zero rows / columns add nothing
            xq = torch.nn.functional.pad(xq, (0, kp - w.k, 0, rows - m))
        acc = torch._int_mm(xq, w.wt)[:m, :w.n]  # int32 [M, N]
    else:
        acc = torch._int_mm(xq.contiguous(), w.wt)  # int32 [M, N]
    y = (acc * sx[:, None]).mul_(w.scale)  # int32 * float32 -> float32 [M, N]
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def w8a8_apply(x2: torch.Tensor, w: Int8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """x2 [M, K] float -> [M, N]: quantize per token, int8 GEMM, scale."""
    xq, sx = quantize_int8_rows(x2)
    return int8_mm(xq, sx, w, out_dtype)
