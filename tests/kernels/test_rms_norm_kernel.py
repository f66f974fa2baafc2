"""rms_norm / fused_add_rms_norm kernels vs rms_norm_ref (Hugging Face semantics)."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.rms_norm import fused_add_rms_norm, rms_norm
from kvflow.layers.norm import rms_norm_ref

# The reference rounds norm(x) to the dtype before the weight multiply; a one-ulp
# difference there (summation order, rsqrt) shows as up to ~2 ulps of the output.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _exact(device: torch.device, dtype: torch.dtype) -> dict:
    """Bit-exact, except that Triton's CPU interpreter truncates float32 -> bfloat16
    (the GPU rounds to nearest even): there, allow one bf16 ulp."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return dict(atol=1e-6, rtol=2 ** -7)
    return dict(atol=0, rtol=0)


def _inputs(shape, dtype, device, seed):
    torch.manual_seed(seed)
    x = torch.randn(shape, dtype=dtype, device=device) * 2
    w = (1 + 0.5 * torch.randn(shape[-1])).to(dtype).to(device)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 4096), (3, 4, 128), (17, 96), (2, 3, 2, 32)])
@pytest.mark.parametrize("seed", [0, 1])
def test_rms_norm(device, dtype, shape, seed):
    x, w = _inputs(shape, dtype, device, seed)
    out = rms_norm(x, w, EPS)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, w, EPS), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 4096), (3, 4, 128), (17, 96)])
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_add_rms_norm(device, dtype, shape, seed):
    x, w = _inputs(shape, dtype, device, seed)
    residual = torch.randn_like(x)
    out, res_out = fused_add_rms_norm(x, residual, w, EPS)
    r = x + residual  # in the input dtype, like the layer
    torch.testing.assert_close(res_out, r, **_exact(device, dtype))
    torch.testing.assert_close(out, rms_norm_ref(r, w, EPS), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_per_head_on_strided_view(device, dtype):
    """Qwen3's q/k norm: [T, H, D] heads sliced out of the fused qkv output, no copy."""
    torch.manual_seed(0)
    t, h, kvh, d = 6, 4, 2, 64
    qkv = torch.randn(t, (h + 2 * kvh) * d, dtype=dtype, device=device)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d: (h + kvh) * d].view(t, kvh, d)
    w = torch.rand(d, dtype=dtype, device=device) + 0.5
    for x in (q, k):
        assert not x.is_contiguous()
        torch.testing.assert_close(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), **TOL[dtype])


def test_fused_add_rms_norm_in_place(device):
    """out / residual_out may alias x / residual (vLLM-style in-place update)."""
    x, w = _inputs((9, 256), torch.float16, device, 3)
    residual = torch.randn_like(x)
    r = x + residual
    expected = rms_norm_ref(r, w, EPS)
    out, res_out = fused_add_rms_norm(x, residual, w, EPS, out=x, residual_out=residual)
    assert out is x and res_out is residual
    torch.testing.assert_close(residual, r, atol=0, rtol=0)
    torch.testing.assert_close(x, expected, **TOL[torch.float16])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 256, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_llama8b_gpu(num_tokens, dtype):
    x, w = _inputs((num_tokens, 4096), dtype, "cuda", 0)
    residual = torch.randn_like(x)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **TOL[dtype])
    out, res_out = fused_add_rms_norm(x, residual, w, 1e-5)
    r = x + residual
    torch.testing.assert_close(res_out, r, atol=0, rtol=0)
    torch.testing.assert_close(out, rms_norm_ref(r, w, 1e-5), **TOL[dtype])


@pytest.mark.gpu
@requires_cuda
def test_rms_norm_qwen3_per_head_gpu():
    torch.manual_seed(0)
    t, h, kvh, d = 256, 32, 8, 128
    qkv = torch.randn(t, (h + 2 * kvh) * d, dtype=torch.bfloat16, device="cuda")
    q = qkv[:, : h * d].view(t, h, d)
    w = torch.rand(d, dtype=torch.bfloat16, device="cuda") + 0.5
    torch.testing.assert_close(rms_norm(q, w, 1e-6), rms_norm_ref(q, w, 1e-6),
                               **TOL[torch.bfloat16])
