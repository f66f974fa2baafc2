"""Per-token int8 quantization of a few float32 activation rows in one C call
(``quant_rows.cpp``): the same bytes and scales as the torch reference
``kvflow.layers.quantization.int8_gemm.quantize_int8_rows_ref``, without its nine op
dispatches per linear layer (most of a decode-size call's time)."""

from __future__ import annotations

import ctypes

import torch

from kvflow.cpu.kernels import build

MAX_ROWS = 16  # beyond, torch's vectorized ops cost about the same as one call here

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64


def _library() -> ctypes.CDLL | None:
    return build.load("quant_rows", {"kvflow_quantize_int8_rows": (
        [_ptr, _i64, _i64, _i64, _ptr, _ptr], None)})


def available() -> bool:
    """Whether the kernel is built and loadable here (builds it on first call)."""
    return _library() is not None


def supports(x: torch.Tensor) -> bool:
    """float32 rows on CPU, at most MAX_ROWS of them, unit stride along a row."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and available())


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 (``supports(x)``) -> (int8 [M, K], float32 scales [M])."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the C++ int8 row quantization is not available "
                           "(check cpu.kernels.quant_rows.supports() first)")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    s = torch.empty(m, dtype=torch.float32)
    if m:
        lib.kvflow_quantize_int8_rows(x.data_ptr(), m, k, x.stride(0) if m > 1 else k,
                                      q.data_ptr(), s.data_ptr())
    return q, s
