"""silu_and_mul kernel vs silu_and_mul_ref."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.silu_and_mul import silu_and_mul
from kvflow.layers.activation import silu_and_mul_ref

# silu(gate) is rounded to the dtype before the multiply (as in the reference), so one
# ulp of difference there can become ~2 ulps of the product.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (7, 2 * 300), (2, 3, 2 * 1100)])
@pytest.mark.parametrize("seed", [0, 1])
def test_silu_and_mul(device, dtype, shape, seed):
    torch.manual_seed(seed)
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_strided_rows_and_out(device, dtype):
    torch.manual_seed(0)
    big = torch.randn(6, 2 * 200 + 10, dtype=dtype, device=device)
    x = big[:, :400]  # row stride 410, unit stride on the last dim
    out = torch.full((6, 200), float("nan"), dtype=dtype, device=device)
    res = silu_and_mul(x, out=out)
    assert res is out
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOL[dtype])


def test_silu_and_mul_empty(device):
    x = torch.randn(0, 64, device=device)
    assert silu_and_mul(x).shape == (0, 32)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 256, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_llama8b_gpu(num_tokens, dtype):
    torch.manual_seed(0)
    x = torch.randn(num_tokens, 2 * 14336, dtype=dtype, device="cuda")
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOL[dtype])
