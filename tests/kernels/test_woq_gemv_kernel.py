"""The low-bit decode GEMVs (gemv_w4: int4 groups; gemv_w8: int8 / FP8 per channel) vs
their pure-torch references, at small shapes (the interpreter on CPU) and at Llama-3.1-8B
shapes (gpu)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvflow.kernels.gemv_w4 import gemv_w4, gemv_w4_ref
from kvflow.kernels.gemv_w8 import gemv_w8, gemv_w8_ref
from kvflow.kernels.int4_layout import dequantize_int4, pack_int4
from kvflow.kernels.woq_gemv_config import WoqGemvConfig, default_config

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _w4(n: int, k: int, group: int, symmetric: bool, dtype, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.05 + 0.005).to(dtype)
    bias = None if symmetric else (torch.randn(n, k // group, generator=g) * 0.1).to(dtype)
    return (pack_int4(q).to(device), scale.to(device),
            None if bias is None else bias.to(device))


def _check_w4(y, x, qw, s, b, group, deq: bool) -> None:
    """Within float32-sum rounding of the reference, plus (deq) one bf16 rounding per
    weight, plus an ulp of the output."""
    ref = gemv_w4_ref(x, qw, s, b, group)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    eps = torch.finfo(x.dtype).eps
    w = dequantize_int4(qw, s, b, group)
    mag = x.float().abs() @ w.abs().t()
    bound = (eps if deq else 1e-4) * mag + eps * ref.float().abs() + 1e-5
    err = (y.float() - ref.float()).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


# rows > 0: balanced grids (WoqGemvConfig.rows), programs owning fewer rows than a tile,
# N not a multiple of them (100 rows as 7 x 13 + 9; 96 as 4 x 23 + 4 split three ways;
# 70 as 7 x 9 + 7 with a scale per plane)
@pytest.mark.parametrize("m,n,k,group,symmetric,deq,split,rows", [
    (1, 64, 512, 128, False, False, 1, 0),
    (3, 96, 768, 128, False, True, 2, 0),   # N not a multiple of BN, K tiles split 2 ways
    (8, 64, 320, 32, True, False, 1, 0),    # K padded to 512, a scale per plane
    (2, 32, 512, 64, False, True, 1, 0),
    (5, 64, 512, 256, False, False, 2, 0),
    (3, 100, 512, 128, False, False, 1, 13),
    (5, 96, 768, 128, True, True, 3, 23),
    (2, 70, 512, 32, False, False, 2, 9),
])
def test_gemv_w4_matches_reference(device, m, n, k, group, symmetric, deq, split, rows):
    qw, s, b = _w4(n, k, group, symmetric, torch.bfloat16, device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x = x.to(device)
    cfg = WoqGemvConfig(block_n=32 if n <= 32 else 64, split_k=split, deq=deq, num_stages=2,
                        rows=rows)
    y = gemv_w4(x, qw, s, b, group, cfg)
    _check_w4(y, x, qw, s, b, group, deq)


def test_gemv_w4_strided_rows(device):
    """x may be a row slice of a wider buffer (stride along M > K)."""
    qw, s, b = _w4(64, 256, 128, False, torch.bfloat16, device)
    big = torch.randn(4, 512).to(torch.bfloat16).to(device)
    x = big[:, :256]
    y = gemv_w4(x, qw, s, b, 128, WoqGemvConfig(64, num_stages=2))
    _check_w4(y, x.contiguous(), qw, s, b, 128, False)


def _w8(n: int, k: int, fp8: bool, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    scale = w.abs().amax(1) / (448.0 if fp8 else 127.0)
    q = (w / scale[:, None])
    q = q.to(torch.float8_e4m3fn) if fp8 else q.round().clamp(-127, 127).to(torch.int8)
    return q.to(device), scale.float().to(device)


@pytest.mark.parametrize("m,n,k,fp8,bk,split,xa,rows", [
    (1, 64, 512, False, 256, 1, False, 0),
    (4, 80, 384, True, 128, 2, False, 0),   # K not a multiple of BK, N of BN
    (8, 64, 256, True, 64, 1, True, 0),     # x as the first MMA operand
    (2, 128, 512, False, 128, 4, True, 0),
    (3, 90, 384, False, 128, 1, False, 29),  # balanced rows: 90 as 3 x 29 + 3
    (5, 100, 512, True, 128, 2, True, 17),   # 100 as 5 x 17 + 15, split, x first
    (1, 80, 384, True, 128, 3, False, 47),   # 80 as 47 + 33 (the qkv tile's rows)
])
def test_gemv_w8_matches_reference(device, m, n, k, fp8, bk, split, xa, rows):
    q, s = _w8(n, k, fp8, device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x = x.to(device)
    y = gemv_w8(x, q, s, WoqGemvConfig(64, bk, split, num_stages=2, xa=xa, rows=rows))
    ref = gemv_w8_ref(x, q, s)
    mag = (x.float().abs() @ q.float().abs().t()) * s[None, :]
    bound = 1e-4 * mag + torch.finfo(x.dtype).eps * ref.float().abs() + 1e-5
    assert ((y.float() - ref.float()).abs() <= bound).all()


def _silu_ref(y: torch.Tensor) -> torch.Tensor:
    """The unfused path: [gate; up] product rounded to the dtype, silu, times up."""
    d = y.shape[1] // 2
    return torch.nn.functional.silu(y[:, :d]) * y[:, d:]


# rows > 0: balanced grids; the lanes past them must drop the up rows (d + ...) too
@pytest.mark.parametrize("m,d,split,deq,rows", [(1, 64, 1, False, 0), (3, 96, 2, True, 0),
                                               (8, 32, 2, False, 0), (2, 40, 1, False, 11),
                                               (4, 72, 2, True, 10)])
def test_gemv_w4_silu_and_mul(device, m, d, split, deq, rows):
    qw, s, b = _w4(2 * d, 512, 128, False, torch.bfloat16, device)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x = x.to(device)
    cfg = WoqGemvConfig(32, split_k=split, deq=deq, num_stages=2, rows=rows)
    y = gemv_w4(x, qw, s, b, 128, cfg, silu_and_mul=True)
    ref = _silu_ref(gemv_w4_ref(x, qw, s, b, 128))
    assert y.shape == (m, d)
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2 * float(ref.abs().max()),
                               rtol=2e-2)


@pytest.mark.parametrize("fp8,split,rows", [(False, 1, 0), (True, 2, 0), (False, 2, 7),
                                            (True, 1, 30)])  # d = 64 as 9 x 7 + 1, 2 x 30 + 4
def test_gemv_w8_silu_and_mul(device, fp8, split, rows):
    q, s = _w8(128, 256, fp8, device)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x = x.to(device)
    y = gemv_w8(x, q, s, WoqGemvConfig(32, 128, split, num_stages=2, xa=fp8, rows=rows),
                silu_and_mul=True)
    ref = _silu_ref(gemv_w8_ref(x, q, s))
    assert y.shape == (2, 64)
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2 * float(ref.abs().max()),
                               rtol=2e-2)


def test_default_config_splits_small_layers():
    cfg = default_config("w4g128", 1, 4096, 4096, torch.device("cpu"), sms=132)
    assert cfg.block_n == 64 and cfg.split_k > 1 and cfg.block_k == 256
    big = default_config("fp8", 1, 128256, 4096, torch.device("cpu"), sms=132)
    assert big.split_k == 1
    with pytest.raises(ValueError):
        WoqGemvConfig(48)
    with pytest.raises(ValueError):
        WoqGemvConfig(32, rows=33)  # more rows than the tile holds
    assert WoqGemvConfig(64).tile_rows == 64 and WoqGemvConfig(64, rows=47).tile_rows == 47
    # rows is the last field: the positional forms (the tables' _c) keep their meaning
    cfg = WoqGemvConfig(64, 256, 4, 4, 3, True, False, 0, 47)
    assert (cfg.deq, cfg.promote, cfg.rows) == (True, 0, 47)
    # the -silu and fp8a8 defaults derive from a base config field by field: none balanced
    for fmt in ("w4g128-silu", "fp8-silu", "fp8a8", "fp8a8-siluq"):
        assert default_config(fmt, 1, 6144, 4096, torch.device("cpu"), sms=132).rows == 0


SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_w4_real_shapes(n, k, m):
    dev = torch.device("cuda")
    qw, s, b = _w4(n, k, 128, False, torch.bfloat16, dev)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    for deq in (False, True):
        cfg = dataclasses.replace(default_config("w4g128", m, n, k, dev), deq=deq)
        _check_w4(gemv_w4(x, qw, s, b, 128, cfg), x, qw, s, b, 128, deq)
        # the PTX conversion and the plain-Triton one agree
        y_ops = gemv_w4(x, qw, s, b, 128, cfg, asm=False)
        _check_w4(y_ops, x, qw, s, b, 128, deq)
    if n == 28672:  # gate_up: the SiLU epilogue
        cfg = default_config("w4g128", m, n // 2, k, dev)
        y = gemv_w4(x, qw, s, b, 128, cfg, silu_and_mul=True)
        ref = _silu_ref(gemv_w4_ref(x, qw, s, b, 128))
        torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2,
                                   atol=2e-2 * float(ref.abs().max()))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("fp8", [False, True])
def test_gemv_w8_real_shapes(n, k, fp8):
    dev = torch.device("cuda")
    q, s = _w8(n, k, fp8, dev)
    for m in (1, 8):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = gemv_w8_ref(x, q, s)
        cfg = default_config("fp8" if fp8 else "int8", m, n, k, dev)
        for asm, xa in ((True, False), (False, False), (True, True)):
            # the PTX operand conversion and Triton's own; x as the first operand
            c = dataclasses.replace(cfg, deq=False, xa=xa)
            y = gemv_w8(x, q, s, c, asm=asm)
            torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2,
                                       atol=1e-2 * ref.abs().max().item())
        if n == 28672:  # gate_up: the SiLU epilogue
            cfg = default_config("fp8" if fp8 else "int8", m, n // 2, k, dev)
            y = gemv_w8(x, q, s, cfg, silu_and_mul=True)
            sref = _silu_ref(ref)
            torch.testing.assert_close(y.float(), sref.float(), rtol=2e-2,
                                       atol=2e-2 * float(sref.abs().max()))
