"""fp8_quant and fp8_gemm (FP8 W8A8, per channel and block-wise) against their pure-torch
references; the interpreter on CPU, real Llama-3.1-8B shapes on an FP8 GPU."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.fp8_gemm import (SMALL_M, Fp8Config, choose_config, dequantize_fp8_weight,
                                     fp8_gemm, fp8_gemm_ref, fp8_linear)
from kvflow.kernels.fp8_quant import quantize_fp8, quantize_fp8_ref


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


requires_fp8_gpu = pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU with FP8 (8.9+)")


def _weights(n, k, block, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    wq = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    if block is None:
        sw = torch.rand(n, generator=g) * 1e-3 + 1e-4
    else:
        r, gk = block
        sw = torch.rand(-(-n // r), -(-k // gk), generator=g) * 1e-3 + 1e-4
    return wq.to(device), sw.to(device)


# FP8 tensor cores (sm_89+; Hopper's wgmma) do not sum in float32: their adder keeps about
# 13-14 bits below the largest addend (DeepSeek-V3 section 3.3.2), so no FP8 tensor-core
# GEMM meets the float32 bound above (on the H200 neither does cuBLAS's _scaled_mm: 1.4e-4
# to 7e-4 of max|ref| at the 8B shapes, fp8-gemm-precision-h200.json). With promotion
# every instruction (32 products) or every 128 (a K tile), what is left is a few
# truncations of 2^-13 of an instruction's largest term per instruction: measured at most
# 2^-15.2 (promote_k 32) and 2^-13.4 (once per tile) of sum_k |x_k w_k|; the bound below
# keeps a margin of 2^3 over the worse one.
TENSOR_CORE_REL = 2.0 ** -10


def _magnitude(xq, sx, wq, sw, block) -> torch.Tensor:
    """sum_k |x_k w_k| with the scales: the size of a sum's terms, per output."""
    def absq(q):
        return q.float().abs().to(torch.float8_e4m3fn)  # exact: fp8 values
    return fp8_gemm_ref(absq(xq), sx, absq(wq), sw, block, torch.float32)


def _close(y, ref, mag=None) -> None:
    """Float32 sums of exact products in another order: a few ulps of the sum's terms
    (plus the output's rounding); on FP8 tensor cores (``mag`` given, a CUDA output) the
    adder's precision, ``TENSOR_CORE_REL`` of the terms' magnitude, on top."""
    assert y.shape == ref.shape
    tol = 1e-5 * ref.float().abs().max() + torch.finfo(y.dtype).eps * ref.float().abs()
    if mag is not None and y.is_cuda:
        tol = tol + TENSOR_CORE_REL * mag.float()
    err = (y.float() - ref.float()).abs()
    assert (err <= tol + 1e-6).all(), f"max excess {(err - tol).max().item()}"


@pytest.mark.parametrize("group", [None, 32, 128])
def test_quantize_matches_reference_bytes(device, group):
    x = (torch.randn(5, 200) * 3).to(torch.bfloat16).to(device)
    x[1] = 0  # an all-zero row: scale 1, zeros
    x[2, 7] = 1e4  # saturates nothing: its own scale
    q, s = quantize_fp8(x, group)
    qr, sr = quantize_fp8_ref(x, group)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s, sr)


@pytest.mark.parametrize("m,block,cfg", [
    (1, None, None),  # decode: quantized in the kernel, split-K
    (3, (32, 32), None),  # block scales on block rows
    (3, (1, 32), None),  # block scales per row (merged shards off the blocks)
    (5, (24, 32), None),  # block rows not a power of two
    (7, None, Fp8Config(16, 16, 32, split_k=3)),
    (7, (1, 32), Fp8Config(16, 16, 32, split_k=3, swap_ab=True)),
    (2, None, Fp8Config(16, 32, 64, swap_ab=True)),
    (20, (64, 64), None),  # past SMALL_M: the GEMM tiles
    (20, (64, 64), Fp8Config(16, 32, 32, split_k=2)),  # K tiles of half a group (x given)
])
def test_fp8_gemm_matches_reference(device, m, block, cfg):
    n, k = 56, 320 if block is None or block[1] != 64 else 200  # not multiples of the tiles
    wq, sw = _weights(n, k, block, device, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m)).to(torch.bfloat16)
    x = x.to(device)
    x[0, 3] = 30.0  # an outlier: its token's (group's) scale absorbs it
    group = None if block is None else block[1]
    xq, sx = quantize_fp8_ref(x, group)
    ref = fp8_gemm_ref(xq, sx, wq, sw, block, torch.float32)
    mag = _magnitude(xq, sx, wq, sw, block)
    # activations quantized in the kernel (a K tile per group), and given quantized
    if cfg is None or group is None or cfg.block_k == group:
        _close(fp8_gemm(x, wq, sw, block, out_dtype=torch.float32, config=cfg), ref, mag)
    _close(fp8_gemm(xq, wq, sw, block, x_scale=sx, out_dtype=torch.float32, config=cfg), ref,
           mag)
    # the reference itself: the dequantized operands' product
    dense = (xq.float() * (sx[:, None] if block is None else sx.repeat_interleave(
        group, 1)[:, :k])) @ dequantize_fp8_weight(wq, sw, block).t()
    torch.testing.assert_close(ref, dense, rtol=1e-5, atol=1e-5 * float(dense.abs().max()))


def test_fp8_linear_both_paths(device):
    wq, sw = _weights(48, 128, (32, 32), device, seed=3)
    for m in (SMALL_M, SMALL_M + 1):  # in-kernel quantization, then quantize_fp8 + GEMM
        x = torch.randn(m, 128, dtype=torch.bfloat16, device=device)
        xq, sx = quantize_fp8_ref(x, 32)
        ref = fp8_gemm_ref(xq, sx, wq, sw, (32, 32), torch.float32)
        y = fp8_linear(x, wq, sw, (32, 32))
        assert y.dtype == torch.bfloat16
        _close(y, ref.to(torch.bfloat16), _magnitude(xq, sx, wq, sw, (32, 32)))


def test_configs():
    assert choose_config(1, 4096, 4096, None, torch.device("cpu"), sms=132).split_k > 1
    big = choose_config(4096, 4096, 4096, 128, torch.device("cpu"), sms=132)
    assert big.block_k == 128 and big.split_k == 1
    with pytest.raises(ValueError):
        Fp8Config(8, 64, 128)
    with pytest.raises(ValueError):
        Fp8Config(16, 64, 128, promote_k=-1)
    cpu = torch.device("cpu")
    # every wgmma instruction's partial goes into the float32 sum at decode, and where 64-wide
    # tiles fill the SMs; the compute-bound 128 x 128 tiles promote once per K tile
    for m in (1, 8):
        assert choose_config(m, 28672, 4096, 128, cpu, sms=132).promote_k == 32
    for m in (64, 256):
        cfg = choose_config(m, 4096, 14336, 128, cpu, sms=132)
        assert (cfg.block_n, cfg.promote_k) == (64, 32) and cfg.split_k > 1
        cfg = choose_config(m, 28672, 4096, 128, cpu, sms=132)
        assert (cfg.block_n, cfg.promote_k) == (128, 0)


@pytest.mark.gpu
@requires_fp8_gpu
@pytest.mark.parametrize("m", [1, 4, 8, 16, 64, 256])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fp8_gemm_llama8b_gpu(m, n, k, block):
    wq, sw = _weights(n, k, block, "cuda")
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    group = None if block is None else block[1]
    xq, sx = quantize_fp8_ref(x, group)
    ref = fp8_gemm_ref(xq, sx, wq, sw, block, torch.float32)
    q2, s2 = quantize_fp8(x, group)
    assert torch.equal(q2.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(s2, sx)
    y = fp8_linear(x, wq, sw, block) if block else fp8_gemm(x, wq, sw)
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


@pytest.mark.gpu
@requires_fp8_gpu
def test_fp8_gemm_cuda_graph_capture():
    wq, sw = _weights(4096, 4096, None, "cuda")
    x = torch.randn(2, 4096, dtype=torch.bfloat16, device="cuda")
    want = fp8_gemm(x, wq, sw)  # warm-up (compiles, allocates the split-K counters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm(x, wq, sw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
