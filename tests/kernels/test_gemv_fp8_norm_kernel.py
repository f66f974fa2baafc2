"""The FP8 W8A8 decode GEMV with the residual add, RMSNorm and the activation's per-tile FP8
quantization folded in (``gemv_fp8_rms_norm``) against its float32 reference
(``gemv_fp8_rms_norm_ref``: the same per-tile quantization); small shapes under the
interpreter (the kernel emulates round-to-nearest-even for its bf16 and e4m3 casts there,
so r and the quantized tiles have the GPU's bits; the epilogue helpers it shares with
``gemv_fp8`` keep the interpreter's truncating bf16 casts: one ulp)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels import gemv_fp8_norm
from kvflow.kernels.fp8_quant import quantize_fp8_ref
from kvflow.kernels.gemv_fp8_norm import gemv_fp8_rms_norm, gemv_fp8_rms_norm_ref
from kvflow.kernels.woq_gemv_config import WoqGemvConfig

EPS = 1e-5
U32 = 2.0 ** -24  # float32 unit roundoff
BF16 = torch.finfo(torch.bfloat16).eps  # one bf16 ulp relative (2^-7)


def _operands(m: int, n: int, k: int, residual: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    # a spread of magnitudes along K, so the per-tile scales differ from tile to tile
    x = (torch.randn(m, k, generator=g) * torch.linspace(0.2, 6, k)).to(torch.bfloat16)
    res = torch.randn(m, k, generator=g).to(torch.bfloat16) if residual else None
    nw = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16)
    wq, sw = quantize_fp8_ref(torch.randn(n, k, generator=g))
    return x, res, nw, wq, sw


def _magnitude(x, res, nw, wq, sw, group: int) -> torch.Tensor:
    """rstd * sum_t s_t sum |q| |w| * sw: the sum of |terms| behind each output [M, N]."""
    m, k = x.shape
    r = x if res is None else (x.float() + res.float()).to(torch.bfloat16)
    rf = r.float()
    q, s = quantize_fp8_ref((rf * nw.float()).to(torch.bfloat16), group=group)
    qs = q.float().abs() * s.repeat_interleave(group, dim=1)[:, :k]
    rstd = torch.rsqrt((rf * rf).mean(-1) + EPS)
    return (qs @ wq.float().abs().t()) * sw[None, :] * rstd[:, None]


def _sum_bound(mag: torch.Tensor, k: int, bk: int) -> torch.Tensor:
    """Kernel and reference both sum exact FP8 products in float32, in different orders:
    each within (BK + K / BK) u of the |terms| per tile and over the tiles, plus rstd from
    a K-term float32 sum of squares (K u / 2) and a few products (scales): twice that."""
    return 2 * (bk + -(-k // bk) + k + 8) * U32 * mag + 1e-30


def _check_r(r, x, res):
    if res is None:
        assert r is x  # the first layer: the residual is the input itself
    else:
        assert torch.equal(r, (x.float() + res.float()).to(torch.bfloat16))


@pytest.mark.parametrize("m,n,k,bn,bk,split,residual", [
    (1, 80, 320, 32, 128, 1, False),   # K = 2.5 tiles: masked tail; N = 2.5 tiles
    (3, 80, 384, 32, 256, 2, True),    # BK 256: a 128-wide masked tail, split-K
    (8, 96, 384, 64, 128, 3, True),    # every decode row, N not a multiple of BN, 3 splits
    (3, 100, 320, 32, 128, 2, False),  # splits of 2 tiles and 1 tile (the tail)
])
def test_gemv_fp8_rms_norm_matches_reference(device, m, n, k, bn, bk, split, residual):
    x, res, nw, wq, sw = _operands(m, n, k, residual, seed=m + k)
    x, nw, wq, sw = x.to(device), nw.to(device), wq.to(device), sw.to(device)
    res = res.to(device) if res is not None else None
    cfg = WoqGemvConfig(bn, bk, split, num_stages=2)
    y_ref, r_ref = gemv_fp8_rms_norm_ref(x.cpu(), None if res is None else res.cpu(),
                                         nw.cpu(), EPS, wq.cpu(), sw.cpu(), bk)
    bound = _sum_bound(_magnitude(x.cpu(), None if res is None else res.cpu(), nw.cpu(),
                                  wq.cpu(), sw.cpu(), bk), k, bk)
    # float32 output: the sums themselves (a single quantized byte off by one e4m3 step
    # would cost 1/16 of its term, far above this bound for all but the smallest terms)
    y32, r = gemv_fp8_rms_norm(x, res, nw, EPS, wq, sw, cfg, out_dtype=torch.float32)
    assert y32.shape == (m, n) and y32.dtype == torch.float32
    _check_r(r, x, res)
    assert torch.equal(r.cpu(), r_ref)
    err = (y32.cpu() - y_ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    # bf16 output: plus one bf16 ulp (rounding; the interpreter truncates)
    y, r = gemv_fp8_rms_norm(x, res, nw, EPS, wq, sw, cfg)
    assert y.dtype == torch.bfloat16
    _check_r(r, x, res)
    err = (y.float().cpu() - y_ref).abs()
    assert (err <= bound + BF16 * y_ref.abs()).all()


def _silu_bound(x, res, nw, wq, sw, bk: int, y_ref: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: gate and up within the sum bound of the reference's, then each of
    gate, up, silu(gate) and the product rounded to bf16 (kernel: up to one ulp, the
    interpreter truncating; reference: half an ulp); silu' <= 1.1."""
    m, k = x.shape
    full, _ = gemv_fp8_rms_norm_ref(x, res, nw, EPS, wq, sw, bk)
    d = full.shape[1] // 2
    mag = _magnitude(x, res, nw, wq, sw, bk)
    sb = _sum_bound(mag, k, bk)
    g, u = full[:, :d].abs(), full[:, d:].abs()
    dg, du = sb[:, :d] + 1.5 * BF16 * g, sb[:, d:] + 1.5 * BF16 * u
    act = F.silu(full[:, :d]).abs()
    return (1.1 * dg + 1.5 * BF16 * act) * (u + du) + act * du + 1.5 * BF16 * y_ref.abs()


@pytest.mark.parametrize("m,d,k,bn,bk,split,residual", [
    (1, 64, 384, 32, 128, 1, True),
    (5, 48, 320, 32, 128, 3, False),  # d not a multiple of BN, split over a masked tail
    (8, 64, 384, 32, 256, 2, True),
])
def test_gemv_fp8_rms_norm_silu(device, m, d, k, bn, bk, split, residual):
    x, res, nw, wq, sw = _operands(m, 2 * d, k, residual, seed=10 + m)
    y, r = gemv_fp8_rms_norm(x.to(device), None if res is None else res.to(device),
                             nw.to(device), EPS, wq.to(device), sw.to(device),
                             WoqGemvConfig(bn, bk, split, num_stages=2), silu_and_mul=True)
    y_ref, r_ref = gemv_fp8_rms_norm_ref(x, res, nw, EPS, wq, sw, bk, silu_and_mul=True)
    assert y.shape == (m, d) and y.dtype == torch.bfloat16
    assert torch.equal(r.cpu(), r_ref)
    bound = _silu_bound(x, res, nw, wq, sw, bk, y_ref)
    err = (y.float().cpu() - y_ref.float()).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("m,residual", [(1, False), (3, True)])
def test_gemv_fp8_rms_norm_silu_fp8_output(device, m, residual):
    """fp8_out: the bytes and scales of ``quantize_fp8_ref(., group=block_n)`` on the bf16
    SiLU product this kernel writes without fp8_out (same sums, same roundings)."""
    d, k, bn, bk = 128, 320, 64, 128
    x, res, nw, wq, sw = _operands(m, 2 * d, k, residual, seed=20 + m)
    args = (x.to(device), None if res is None else res.to(device), nw.to(device), EPS,
            wq.to(device), sw.to(device), WoqGemvConfig(bn, bk, 1, num_stages=2))
    (hq, hs), r = gemv_fp8_rms_norm(*args, silu_and_mul=True, fp8_out=True)
    h, _ = gemv_fp8_rms_norm(*args, silu_and_mul=True)
    assert hq.shape == (m, d) and hq.dtype == torch.float8_e4m3fn
    assert hs.shape == (m, d // bn) and hs.dtype == torch.float32
    _check_r(r, args[0], args[1])
    q_ref, s_ref = quantize_fp8_ref(h.cpu(), group=bn)
    assert torch.equal(hs.cpu(), s_ref)
    assert torch.equal(hq.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    with pytest.raises(AssertionError):  # the FP8 epilogue runs without split-K
        gemv_fp8_rms_norm(*args[:-1], WoqGemvConfig(bn, bk, 2), silu_and_mul=True,
                          fp8_out=True)


@pytest.mark.parametrize("silu,split", [(False, 2), (True, 1)])
def test_gemv_fp8_rms_norm_one_row(device, monkeypatch, silu, split):
    """The M = 1 form with the x side on one row (``gemv_norm.one_row``): the same sums."""
    monkeypatch.setattr(gemv_fp8_norm, "one_row", lambda: True)
    d, k, bk = 64, 320, 128
    x, res, nw, wq, sw = _operands(1, 2 * d if silu else d, k, True, seed=30)
    out_dtype = torch.bfloat16 if silu else torch.float32
    y, r = gemv_fp8_rms_norm(x.to(device), res.to(device), nw.to(device), EPS, wq.to(device),
                             sw.to(device), WoqGemvConfig(32, bk, split, num_stages=2),
                             silu_and_mul=silu, out_dtype=out_dtype)
    y_ref, r_ref = gemv_fp8_rms_norm_ref(x, res, nw, EPS, wq, sw, bk, silu_and_mul=silu)
    assert torch.equal(r.cpu(), r_ref)
    if silu:
        bound = _silu_bound(x, res, nw, wq, sw, bk, y_ref)
        y_ref = y_ref.float()
    else:
        bound = _sum_bound(_magnitude(x, res, nw, wq, sw, bk), k, bk)
    err = (y.float().cpu() - y_ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def test_gemv_fp8_rms_norm_zero_rows_and_bad_operands():
    x, res, nw, wq, sw = _operands(2, 64, 128, True, seed=40)
    cfg = WoqGemvConfig(32, 64)
    y, r = gemv_fp8_rms_norm(x[:0], res[:0], nw, EPS, wq, sw, cfg)
    assert y.shape == (0, 64) and r.shape == (0, 128)
    with pytest.raises(AssertionError):  # more rows than a decode step
        gemv_fp8_rms_norm(torch.zeros(9, 128, dtype=torch.bfloat16), None, nw, EPS, wq, sw,
                          cfg)
    with pytest.raises(AssertionError):  # bf16 weights: that is gemv_norm's kernel
        gemv_fp8_rms_norm(x, res, nw, EPS, wq.float().to(torch.bfloat16), sw, cfg)
    with pytest.raises(AssertionError):  # one scale per output channel
        gemv_fp8_rms_norm(x, res, nw, EPS, wq, sw[:32], cfg)
    with pytest.raises(AssertionError):  # fp8_out only for the SiLU form
        gemv_fp8_rms_norm(x, res, nw, EPS, wq, sw, cfg, fp8_out=True)
