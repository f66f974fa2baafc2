"""RMSNorm, and residual-add + RMSNorm, over the last dim of ``[..., hidden]``.

Reference: ``kvflow.layers.norm.rms_norm_ref`` (Hugging Face semantics: normalise in
float32, round to the input dtype, multiply by the weight in the weight/input dtype).
The fused form computes ``r = x + residual`` rounded to the input dtype, then
``norm(r)``, and returns ``(norm(r), r)``.

Algorithm: one pass. Rows are tiled ``[ROWS, BLOCK_N]`` with ``BLOCK_N =
next_pow2(hidden)`` and ``ROWS`` chosen so a program holds ~4096 elements: one row per
program at hidden 4096 (Llama), 32 rows at hidden 128 (Qwen3's per-head q/k norm on
[T, H, D]). Each program loads its rows once, reduces the sum of squares in float32 and
writes the result; grid ``(cdiv(rows, ROWS),)``. ``x`` may be a strided 3-D view
(e.g. per-head q sliced out of the fused qkv output) without a copy.

Traffic (memory-bound): rms_norm moves ``rows * hidden * 2 * elem`` bytes (+ weight);
the fused form ``rows * hidden * 4 * elem`` (read x, residual; write out, r). Llama-3.1-8B
at 8192 tokens, bf16: 268 MB fused, ~64 us at 4.2 TB/s (134 MB, ~32 us unfused).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.fp8_quant import fp8_scale, fp8_values, interpreting

_TILE_ELEMS = 4096  # elements a program holds; 16 per thread at 8 warps


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, n_inner, hidden,
                     stride_xa, stride_xb, eps, scale_ptr,
                     HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                     FP8_OUT: tl.constexpr = False,
                     EMULATE: tl.constexpr = False):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < hidden)[None, :]
    rows64 = rows.to(tl.int64)
    # x viewed as [A, B, hidden] with strides (stride_xa, stride_xb, 1).
    x_off = (rows64 // n_inner) * stride_xa + (rows64 % n_inner) * stride_xb
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    dense = rows64[:, None] * hidden + cols[None, :]  # residual / outputs are contiguous
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + dense, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + dense, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / hidden + eps)  # [ROWS]
    normed = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    y = normed * w[None, :]
    if FP8_OUT:
        # Rounded to the model dtype as the norm alone would store it, then quantized per
        # row to FP8 E4M3 as fp8_quant.quantize_fp8 does: the bytes and scales of that
        # kernel run on the stored norm output, one launch fewer.
        yf = y.to(x.dtype).to(tl.float32)
        s = fp8_scale(tl.max(tl.abs(yf), axis=1))  # [ROWS]
        tl.store(scale_ptr + rows64, s, mask=row_ok)
        tl.store(out_ptr + dense, fp8_values(yf, s[:, None], EMULATE), mask=mask)
    else:
        tl.store(out_ptr + dense, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> [A, B, hidden] with unit stride on hidden (a view when possible)."""
    if x.dim() > 3:
        x = x.flatten(0, -3)
    while x.dim() < 3:
        x = x.unsqueeze(0)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, residual_out: torch.Tensor | None,
            scale: torch.Tensor | None = None) -> None:
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous()
    x3 = _as_3d(x)
    n_rows = x3.shape[0] * x3.shape[1]
    if n_rows == 0:
        return
    block_n = triton.next_power_of_2(hidden)
    rows = max(1, min(64, _TILE_ELEMS // block_n))
    num_warps = 4 if rows * block_n <= 2048 else (8 if rows * block_n <= 8192 else 16)
    grid = (triton.cdiv(n_rows, rows),)
    _rms_norm_kernel[grid](
        x3, residual if residual is not None else x3, weight, out,
        residual_out if residual_out is not None else out,
        n_rows, x3.shape[1], hidden, x3.stride(0), x3.stride(1), eps,
        scale if scale is not None else out,
        HAS_RESIDUAL=residual is not None, ROWS=rows, BLOCK_N=block_n, num_warps=num_warps,
        **({"FP8_OUT": True, "EMULATE": interpreting(x.device)} if scale is not None
           else {}))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim: x [..., hidden], weight [hidden] -> [..., hidden].

    ``out`` (contiguous) is written when given; it may be ``x`` itself if x is contiguous.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                          device=x.device)
    assert out.is_contiguous() and out.shape == x.shape
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, out: torch.Tensor | None = None,
                       residual_out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual``; returns ``(rms_norm(r), r)``, both [..., hidden].

    ``out`` / ``residual_out`` (contiguous) are written when given; they may alias
    ``x`` / ``residual`` (each element is read before it is overwritten).
    """
    assert residual.shape == x.shape and residual.dtype == x.dtype
    if not residual.is_contiguous():
        residual = residual.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                          device=x.device)
    if residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.is_contiguous() and out.shape == x.shape
    assert residual_out.is_contiguous() and residual_out.shape == x.shape
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The norm (with ``residual``: of ``r = x + residual``) quantized per row to FP8 in
    the same launch: ``(xq float8_e4m3fn [T, hidden], scales float32 [T], r)`` with the
    bytes of ``quantize_fp8(norm)`` (``r = x`` without a residual). x [T, hidden]: the
    input of an FP8 W8A8 decode GEMV (``kvflow/kernels/gemv_fp8.py``)."""
    assert x.dim() == 2 and x.stride(-1) == 1
    t, hidden = x.shape
    xq = torch.empty((t, hidden), dtype=torch.float8_e4m3fn, device=x.device)
    sx = torch.empty((t,), dtype=torch.float32, device=x.device)
    if residual is None:
        _launch(x, None, weight, eps, xq, None, sx)
        return xq, sx, x
    assert residual.shape == x.shape and residual.dtype == x.dtype
    if not residual.is_contiguous():
        residual = residual.contiguous()
    r = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, xq, r, sx)
    return xq, sx, r
