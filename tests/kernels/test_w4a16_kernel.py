"""w4a16_gemm (int4 weight-only GEMM) vs w4a16_ref (dequantize, then matmul)."""

from __future__ import annotations

import pytest
import torch
import triton

from kvflow.kernels.int4_dequant import int4_dequant, int4_dequant_ref
from kvflow.kernels.int4_layout import dequantize_int4, pack_int4, unpack_int4
from kvflow.kernels.w4a16_gemm import w4a16_gemm, w4a16_ref
from kvflow.kernels.woq_config import WoqConfig, choose_config

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(y: torch.Tensor, x: torch.Tensor, qw, s, b, group: int) -> None:
    """y within the rounding of the weight to x's dtype (the interpreter truncates
    float32 -> bf16 rather than rounding, so allow a whole ulp per weight) plus one ulp of
    the output, of the reference."""
    ref = w4a16_ref(x, qw, s, b, group)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    eps = torch.finfo(x.dtype).eps  # 2^-7 bf16, 2^-10 fp16
    w = dequantize_int4(qw, s, b, group)
    bound = eps * (x.float().abs() @ w.abs().t()) + eps * ref.float().abs() + 1e-6
    err = (y.float() - ref.float()).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def _weights(n: int, k: int, group: int, symmetric: bool, dtype, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.05 + 0.005).to(dtype)
    bias = None if symmetric else (torch.randn(n, k // group, generator=g) * 0.1).to(dtype)
    return (q.to(device), pack_int4(q).to(device), scale.to(device),
            None if bias is None else bias.to(device))


def test_pack_layout_roundtrip():
    q = torch.randint(0, 16, (5, 320), dtype=torch.uint8)
    words = pack_int4(q)
    # K padded to 512 = two tiles of 256 inputs, 32 words each
    assert words.shape == (5, 64) and words.dtype == torch.int32
    assert torch.equal(unpack_int4(words, 320), q.long())
    # nibble plane i of word w (tile t) holds input 256 t + 32 i + w
    w = int(words[1, 3])
    assert [(w >> 4 * i) & 15 for i in range(8)] == [int(q[1, 32 * i + 3]) for i in range(8)]
    assert int(words[1, 32]) & 15 == int(q[1, 256])
    assert (int(words[1, 32 + 31]) >> 28) & 15 == 0  # padding beyond K


def test_dequantize_matches_int4groups_convention():
    """bias = z - 8 s turns the seam's (v - 8) s + z into q s + bias."""
    q = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    s, z = torch.rand(4, 2) + 0.1, torch.randn(4, 2)
    seam = (q.float().view(4, 2, 32) - 8) * s[..., None] + z[..., None]
    ours = dequantize_int4(pack_int4(q), s, z - 8 * s, 32)
    torch.testing.assert_close(ours, seam.view(4, 64))


@pytest.mark.parametrize("m", [1, 3, 8, 17])
@pytest.mark.parametrize("group,symmetric", [(32, False), (64, True), (128, False)])
def test_w4a16_default_config(device, m, group, symmetric):
    # N and K are not multiples of the tiles (K = 3 groups of 128, or 6 of 64, ...)
    n, k = 72, 384
    dtype = torch.bfloat16
    _, qw, s, b = _weights(n, k, group, symmetric, dtype, device, seed=m)
    x = torch.randn(m, k, dtype=dtype, device=device)
    _check(w4a16_gemm(x, qw, s, b, group), x, qw, s, b, group)


@pytest.mark.parametrize("cfg", [
    WoqConfig(16, 16, 32, split_k=3),  # three splits of two 256-input tiles (one empty)
    WoqConfig(32, 32, 128, split_k=1),  # partial sums scaled per plane
    WoqConfig(16, 32, 256, split_k=2, scale_after=False),  # planes dequantized, then dot
    WoqConfig(1, 32, 64, split_k=2, dot=False),  # the register GEMV path, one row
    WoqConfig(4, 16, 64, split_k=3, dot=False),  # GEMV, two row blocks of 4 (M = 5)
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_configs(device, cfg, dtype):
    m = 1 if cfg.block_m == 1 else 5
    # K = 320: one whole 256-input tile and a partial one (planes past K are padding)
    n, k, group = 40, 320, 64  # 5 groups: K not a multiple of any tile
    _, qw, s, b = _weights(n, k, group, False, dtype, device, seed=1)
    x = torch.randn(m, k, dtype=dtype, device=device)
    _check(w4a16_gemm(x, qw, s, b, group, cfg), x, qw, s, b, group)


@pytest.mark.parametrize("m,group", [(1, 512), (2, 32)])
def test_w4a16_gemv_groups(device, m, group):
    """The GEMV scales per group: groups spanning two 256-input tiles (merged GPTQ
    groups), and groups of one plane, symmetric."""
    n, k = 24, 1024
    _, qw, s, b = _weights(n, k, group, group == 32, torch.bfloat16, device, seed=group)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    cfg = WoqConfig(triton.next_power_of_2(m), 16, 256, split_k=2, dot=False)
    _check(w4a16_gemm(x, qw, s, b, group, cfg), x, qw, s, b, group)


def test_w4a16_strided_rows_and_empty(device):
    dtype = torch.float16
    _, qw, s, b = _weights(24, 128, 32, False, dtype, device)
    big = torch.randn(3, 200, dtype=dtype, device=device)
    x = big[:, :128]  # row stride 200
    _check(w4a16_gemm(x, qw, s, b, 32), x, qw, s, b, 32)
    assert w4a16_gemm(x[:0], qw, s, b, 32).shape == (0, 24)


def test_choose_config_paths():
    cuda = torch.device("cpu")
    dec = choose_config(1, 4096, 4096, cuda, 4)
    assert dec.block_m == 1 and not dec.dot and dec.split_k >= 1  # the register GEMV
    assert choose_config(6, 4096, 4096, cuda, 4).block_m == 8
    big = choose_config(4096, 4096, 4096, cuda, 4)
    assert big.block_m == 128 and big.split_k == 1 and big.dequant  # dense weight + cuBLAS
    assert not choose_config(4096, 4096, 4096, cuda, 8).dequant


@pytest.mark.parametrize("group,symmetric,dtype", [(32, False, torch.bfloat16),
                                                   (128, True, torch.float16)])
def test_int4_dequant_kernel(device, group, symmetric, dtype):
    """The dense weight of the M > 8 path: the reference's float32 weight rounded to the
    dtype (within one ulp: the interpreter truncates instead of rounding); K = 384 ends
    in a partial 256-input tile."""
    n, k = 72, 384
    _, qw, s, b = _weights(n, k, group, symmetric, dtype, device, seed=group)
    w = int4_dequant(qw, s, b, group, block_n=32)
    ref = int4_dequant_ref(qw, s, b, group, dtype)
    assert w.shape == (n, k) and w.dtype == dtype
    eps = torch.finfo(dtype).eps
    exact = dequantize_int4(qw, s, b, group)
    assert ((w.float() - exact).abs() <= eps * exact.abs() + 1e-6).all()
    assert ((w.float() - ref.float()).abs() <= eps * ref.float().abs() + 1e-6).all()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 4, 8, 16, 256])
@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("group,symmetric", [(128, False), (32, True)])
def test_w4a16_llama8b_gpu(m, n, k, group, symmetric):
    _, qw, s, b = _weights(n, k, group, symmetric, torch.bfloat16, "cuda")
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    _check(w4a16_gemm(x, qw, s, b, group), x, qw, s, b, group)


@pytest.mark.gpu
@requires_cuda
def test_w4a16_cuda_graph_capture():
    """The launch (split-K workspace included) captures and replays in a CUDA graph."""
    _, qw, s, b = _weights(4096, 4096, 128, False, torch.bfloat16, "cuda")
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    assert choose_config(1, 4096, 4096, x.device, 4).split_k > 1
    w4a16_gemm(x, qw, s, b, 128)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16_gemm(x, qw, s, b, 128)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _check(y, x, qw, s, b, 128)


def test_split_k_counters_reset_and_repeat(device):
    """Each split-K launch leaves its arrival counters at zero for the next one."""
    from kvflow.kernels import woq_config

    _, qw, s, b = _weights(40, 512, 32, False, torch.float16, device)
    x = torch.randn(2, 512, dtype=torch.float16, device=device)
    cfg = WoqConfig(16, 16, 256, split_k=2)
    first = w4a16_gemm(x, qw, s, b, 32, cfg)
    assert not woq_config._locks[x.device].any()
    assert torch.equal(w4a16_gemm(x, qw, s, b, 32, cfg), first)  # deterministic order
    _check(first, x, qw, s, b, 32)
