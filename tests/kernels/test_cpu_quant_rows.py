"""The C++ per-token int8 quantization of decode activations (cpu/kernels/quant_rows.cpp)
gives the torch reference's bytes and scales exactly, and the W8A8 path takes it for a
few float32 rows only."""

from __future__ import annotations

import pytest
import torch

from kvflow.cpu.kernels import quant_rows
from kvflow.layers.quantization import int8_gemm

needs_kernel = pytest.mark.skipif(not quant_rows.available(), reason="no C++ compiler")


@needs_kernel
@pytest.mark.parametrize("m,k", [(1, 576), (2, 64), (4, 1536), (7, 100), (16, 576)])
def test_same_bytes_and_scales_as_the_torch_ops(m, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10
    x[0, 3] = 300.0  # an outlier
    if m > 2:
        x[1] = 0.0  # an all-zero row: scale 1, zeros
        x[2, :5] = torch.tensor([0.5, -0.5, 1.5, -2.5, 127.0]) * float(x[2].abs().max()) / 127
    want_q, want_s = int8_gemm.quantize_int8_rows_ref(x)
    q, s = quant_rows.quantize_int8_rows(x)
    assert torch.equal(q, want_q)
    assert torch.equal(s, want_s)
    # A row-strided view (a slice of a wider activation) reads the same values.
    wide = torch.cat([x, torch.randn(m, 8, generator=g)], dim=1)[:, :k]
    q2, s2 = quant_rows.quantize_int8_rows(wide)
    assert torch.equal(q2, want_q) and torch.equal(s2, want_s)


@needs_kernel
def test_the_w8a8_path_takes_it_for_few_float32_rows(monkeypatch):
    calls = []
    real = quant_rows.quantize_int8_rows
    monkeypatch.setattr(quant_rows, "quantize_int8_rows",
                        lambda x: calls.append(x.shape) or real(x))
    x = torch.randn(3, 64)
    q, s = int8_gemm.quantize_int8_rows(x)
    assert calls == [(3, 64)]
    int8_gemm.quantize_int8_rows(torch.randn(17, 64))  # many rows: the torch ops
    int8_gemm.quantize_int8_rows(torch.randn(2, 64, dtype=torch.bfloat16))
    assert calls == [(3, 64)]
    ref_q, ref_s = int8_gemm.quantize_int8_rows_ref(x)
    assert torch.equal(q, ref_q) and torch.equal(s, ref_s)


def test_switched_off_keeps_the_torch_ops(monkeypatch):
    monkeypatch.setattr(quant_rows, "available", lambda: False)
    x = torch.randn(2, 64)
    q, s = int8_gemm.quantize_int8_rows(x)
    ref_q, ref_s = int8_gemm.quantize_int8_rows_ref(x)
    assert torch.equal(q, ref_q) and torch.equal(s, ref_s)
