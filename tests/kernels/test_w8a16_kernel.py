"""w8a16_gemm (int8 weight-only GEMM) vs w8a16_ref (dequantize, then matmul)."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.w8a16_gemm import dequantize_int8, w8a16_gemm, w8a16_ref
from kvflow.kernels.woq_config import WoqConfig, choose_config

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _weights(n: int, k: int, group: int | None, symmetric: bool, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    if group is None:  # per output channel: float32 scale [N]
        return q.to(device), (torch.rand(n, generator=g) * 1e-3 + 1e-4).to(device), None
    scale = (torch.rand(n, k // group, generator=g) * 1e-3 + 1e-4).to(dtype)
    bias = None if symmetric else (torch.randn(n, k // group, generator=g) * 0.01).to(dtype)
    return q.to(device), scale.to(device), None if bias is None else bias.to(device)


def _check(y, x, q, s, b, group) -> None:
    """Within the weight's rounding to x's dtype (a whole ulp: the interpreter truncates)
    plus one ulp of the output."""
    ref = w8a16_ref(x, q, s, b, group)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    eps = torch.finfo(x.dtype).eps
    w = dequantize_int8(q, s, b, group)
    bound = eps * (x.float().abs() @ w.abs().t()) + eps * ref.float().abs() + 1e-6
    err = (y.float() - ref.float()).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("m", [1, 3, 8, 17])
@pytest.mark.parametrize("group,symmetric", [(None, True), (32, True), (64, False)])
def test_w8a16_default_config(device, m, group, symmetric):
    n, k = 56, 320  # neither a multiple of the tiles
    q, s, b = _weights(n, k, group, symmetric, torch.bfloat16, device, seed=m)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    _check(w8a16_gemm(x, q, s, b, group), x, q, s, b, group)


@pytest.mark.parametrize("cfg", [WoqConfig(16, 16, 32, split_k=4),
                                 WoqConfig(1, 16, 64, split_k=3, dot=False)])
@pytest.mark.parametrize("group", [None, 32])
def test_w8a16_configs(device, cfg, group):
    m = 6 if cfg.dot else 1
    q, s, b = _weights(24, 224, group, False, torch.float16, device, seed=2)
    x = torch.randn(m, 224, dtype=torch.float16, device=device)
    _check(w8a16_gemm(x, q, s, b, group, cfg), x, q, s, b, group)


def test_w8a16_per_channel_is_exact_on_integers(device):
    """Per channel, the dot sees the integers and the float32 sum is scaled once."""
    q = torch.randint(-4, 5, (8, 64), dtype=torch.int8, device=device)
    s = torch.full((8,), 0.5, device=device)
    x = torch.randint(-3, 4, (2, 64), device=device).to(torch.bfloat16)
    y = w8a16_gemm(x, q, s)
    assert torch.equal(y.float(), (x.float() @ q.float().t()) * 0.5)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 4, 8, 16, 256])
@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("group", [None, 32])
def test_w8a16_llama8b_gpu(m, n, k, group):
    q, s, b = _weights(n, k, group, True, torch.bfloat16, "cuda")
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    _check(w8a16_gemm(x, q, s, b, group), x, q, s, b, group)


@pytest.mark.gpu
@requires_cuda
def test_w8a16_cuda_graph_capture():
    q, s, b = _weights(4096, 4096, None, True, torch.bfloat16, "cuda")
    x = torch.randn(2, 4096, dtype=torch.bfloat16, device="cuda")
    assert choose_config(2, 4096, 4096, x.device, 8).split_k > 1
    w8a16_gemm(x, q, s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w8a16_gemm(x, q, s)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _check(y, x, q, s, None, None)
