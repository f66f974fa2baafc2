"""The FP8 W8A8 decode GEMV (``gemv_fp8``: FP8 activations x FP8 weights on the tensor
cores) against its float32 reference, the RMSNorm kernel's FP8 output against the
unfused norm + ``quantize_fp8``, and the one-pass per-token quantization; small shapes
under the interpreter, Llama-3.1-8B shapes on a GPU (``gpu``)."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.fp8_quant import quantize_fp8, quantize_fp8_ref
from kvflow.kernels.gemv_fp8 import gemv_fp8, gemv_fp8_ref
from kvflow.kernels.rms_norm import fused_add_rms_norm, rms_norm, rms_norm_fp8
from kvflow.kernels.woq_gemv_config import WoqGemvConfig, default_config

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _operands(m: int, n: int, k: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    wq, sw = quantize_fp8_ref(torch.randn(n, k, generator=g))
    xq, sx = quantize_fp8_ref(torch.randn(m, k, generator=g).to(torch.bfloat16))
    return xq.to(device), sx.to(device), wq.to(device), sw.to(device)


def _bound(xq, sx, wq, sw, ref, promote: bool):
    """float32 sums of exact products (interpreter: 1e-5 of the magnitudes; the H200's
    FP8 MMA sums up to ``promote`` inputs in about 13 bits: 2**-12), plus an ulp of the
    bf16 output."""
    mag = (xq.float().abs() @ wq.float().abs().t()) * sw[None, :] * sx[:, None]
    rel = 2.0 ** -12 if promote else 1e-5
    return rel * mag + torch.finfo(torch.bfloat16).eps * ref.float().abs() + 1e-5


@pytest.mark.parametrize("m,n,k,bn,bk,split,rows", [
    (1, 64, 512, 64, 256, 1, 0),
    (3, 80, 384, 32, 128, 2, 0),    # K not a multiple of BK, N not of BN, split-K
    (8, 128, 256, 64, 64, 4, 0),
    (16, 64, 512, 32, 128, 1, 0),   # every row of the MMA tile used
    # balanced grids (WoqGemvConfig.rows): 100 rows as 2 x 47 + 6, 80 as 11 x 7 + 3
    # split two ways, 128 as 3 x 33 + 29 split four ways
    (1, 100, 512, 64, 256, 1, 47),
    (3, 80, 384, 32, 128, 2, 7),
    (8, 128, 256, 64, 64, 4, 33),
])
def test_gemv_fp8_matches_reference(device, m, n, k, bn, bk, split, rows):
    xq, sx, wq, sw = _operands(m, n, k, device)
    cfg = WoqGemvConfig(bn, bk, split, num_stages=2, promote=min(128, bk), rows=rows)
    y = gemv_fp8(xq, sx, wq, sw, cfg)
    ref = gemv_fp8_ref(xq, sx, wq, sw, torch.bfloat16)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    err = (y.float() - ref.float()).abs()
    assert (err <= _bound(xq, sx, wq, sw, ref, device.type == "cuda")).all()


def test_gemv_fp8_strided_rows_and_float32_output(device):
    xq, sx, wq, sw = _operands(4, 64, 256, device, seed=1)
    big = torch.zeros(4, 512, dtype=torch.float8_e4m3fn, device=device)
    big[:, :256] = xq
    y = gemv_fp8(big[:, :256], sx, wq, sw, WoqGemvConfig(32, 128, num_stages=2),
                 out_dtype=torch.float32)
    ref = gemv_fp8_ref(xq, sx, wq, sw, torch.float32)
    torch.testing.assert_close(y, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))


# rows > 0: balanced grids (d = 64 as 4 x 13 + 12, split; as 3 x 20 + 4)
@pytest.mark.parametrize("m,split,rows", [(1, 1, 0), (5, 2, 0), (5, 2, 13), (1, 1, 20)])
def test_gemv_fp8_silu_and_mul(device, m, split, rows):
    xq, sx, wq, sw = _operands(m, 128, 256, device, seed=2)
    y = gemv_fp8(xq, sx, wq, sw, WoqGemvConfig(32, 128, split, num_stages=2, promote=128,
                                               rows=rows), silu_and_mul=True)
    full = gemv_fp8_ref(xq, sx, wq, sw, torch.bfloat16)
    ref = torch.nn.functional.silu(full[:, :64]) * full[:, 64:]
    assert y.shape == (m, 64)
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2 * float(ref.abs().max()),
                               rtol=2e-2)


def test_gemv_fp8_rejects_bad_operands():
    xq, sx, wq, sw = _operands(2, 64, 128, "cpu")
    cfg = WoqGemvConfig(32, 64)
    with pytest.raises(AssertionError):
        gemv_fp8(xq.float().to(torch.bfloat16), sx, wq, sw, cfg)  # not FP8 activations
    with pytest.raises(AssertionError):
        gemv_fp8(xq, sx[:1], wq, sw, cfg)  # one scale per row
    with pytest.raises(AssertionError):
        gemv_fp8(xq, sx, wq, sw[:32], cfg)  # one scale per output channel


@pytest.mark.parametrize("t,hidden,residual", [(1, 256, True), (3, 300, True), (2, 64, False)])
def test_rms_norm_fp8_is_the_norm_then_quantize(device, t, hidden, residual):
    """Same bytes, scales and residual as the norm kernel followed by ``quantize_fp8``."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(t, hidden, generator=g) * 3).to(torch.bfloat16).to(device)
    res = torch.randn(t, hidden, generator=g).to(torch.bfloat16).to(device) if residual else None
    w = (torch.rand(hidden, generator=g) + 0.5).to(torch.bfloat16).to(device)
    xq, sx, r = rms_norm_fp8(x, res, w, 1e-5)
    if residual:
        h, r_ref = fused_add_rms_norm(x, res, w, 1e-5)
    else:
        h, r_ref = rms_norm(x, w, 1e-5), x
    q_ref, s_ref = quantize_fp8_ref(h)
    assert torch.equal(r, r_ref)
    assert torch.equal(sx, s_ref)
    assert torch.equal(xq.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("k", [300, 4096, 20000])  # one pass; one pass; two passes
def test_quantize_fp8_matches_reference_at_every_width(device, k):
    x = (torch.randn(3, k, generator=torch.Generator().manual_seed(4)) * 5).to(torch.bfloat16)
    x[1].zero_()  # an all-zero token: scale 1
    q, s = quantize_fp8(x.to(device))
    q_ref, s_ref = quantize_fp8_ref(x)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gemv_fp8_real_shapes(n, k):
    dev = torch.device("cuda")
    for m in (1, 8):
        xq, sx, wq, sw = _operands(m, n, k, dev, seed=m)
        ref = gemv_fp8_ref(xq, sx, wq, sw, torch.bfloat16)
        cfg = default_config("fp8a8", m, n, k, dev)
        y = gemv_fp8(xq, sx, wq, sw, cfg)
        err = (y.float() - ref.float()).abs()
        assert (err <= _bound(xq, sx, wq, sw, ref, True)).all()
        if n == 28672:  # the SiLU epilogue
            c = default_config("fp8a8-silu", m, n // 2, k, dev)
            ys = gemv_fp8(xq, sx, wq, sw, c, silu_and_mul=True)
            full = gemv_fp8_ref(xq, sx, wq, sw, torch.bfloat16)
            sref = torch.nn.functional.silu(full[:, :n // 2]) * full[:, n // 2:]
            torch.testing.assert_close(ys.float(), sref.float(), rtol=2e-2,
                                       atol=2e-2 * float(sref.abs().max()))


def _grouped_ref(xq, sx, wq, sw, group: int) -> torch.Tensor:
    """(per-group-scaled x) @ (per-channel-scaled W)^T in float32."""
    m, k = xq.shape
    xs = xq.float() * sx.repeat_interleave(group, dim=1)[:, :k]
    return (xs @ wq.float().t()) * sw[None, :]


@pytest.mark.parametrize("m,n,k,split,rows", [(1, 64, 512, 1, 0), (5, 96, 384, 2, 0),
                                             (8, 64, 200, 1, 0), (3, 100, 384, 2, 11)])
def test_gemv_fp8_grouped_activation_scales(device, m, n, k, split, rows):
    """x scaled per row and 128-wide group (what the SiLU epilogue's FP8 output is):
    each K tile's sum times its group's scale (indexed by K tile: balanced rows apply)."""
    g = torch.Generator().manual_seed(7)
    wq, sw = quantize_fp8_ref(torch.randn(n, k, generator=g))
    x = (torch.randn(m, k, generator=g) * torch.linspace(0.1, 8, k)).to(torch.bfloat16)
    xq, sx = quantize_fp8_ref(x, group=128)
    xq, sx, wq, sw = xq.to(device), sx.to(device), wq.to(device), sw.to(device)
    y = gemv_fp8(xq, sx, wq, sw, WoqGemvConfig(32, 128, split, num_stages=2, rows=rows))
    ref = _grouped_ref(xq.cpu(), sx.cpu(), wq.cpu(), sw.cpu(), 128)
    torch.testing.assert_close(y.float().cpu(), ref.to(torch.bfloat16).float(), rtol=1e-2,
                               atol=1e-2 * float(ref.abs().max()))
    with pytest.raises(AssertionError):  # the groups must be the config's K step
        gemv_fp8(xq, sx, wq, sw, WoqGemvConfig(32, 64, split, num_stages=2))


@pytest.mark.parametrize("m", [1, 3])
def test_gemv_fp8_silu_fp8_output_feeds_the_grouped_gemv(device, m):
    """gate/up with SiLU and FP8 output per 128-wide group: the bytes and scales of
    ``quantize_fp8(silu(gate) * up, group=128)`` on the bf16 product; then a down GEMV
    reading them gives the unfused chain's result."""
    d, k = 256, 256
    xq, sx, wq, sw = _operands(m, 2 * d, k, device, seed=8)
    cfg = WoqGemvConfig(128, 128, 1, num_stages=2, promote=128)
    hq, hs = gemv_fp8(xq, sx, wq, sw, cfg, silu_and_mul=True, fp8_out=True)
    h = gemv_fp8(xq, sx, wq, sw, cfg, silu_and_mul=True)  # the bf16 product
    q_ref, s_ref = quantize_fp8_ref(h.cpu(), group=128)
    assert hq.shape == (m, d) and hs.shape == (m, d // 128)
    torch.testing.assert_close(hs.cpu(), s_ref, rtol=0, atol=0)
    assert torch.equal(hq.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    wd, sd = quantize_fp8_ref(torch.randn(64, d, generator=torch.Generator().manual_seed(9)))
    y = gemv_fp8(hq, hs, wd.to(device), sd.to(device), WoqGemvConfig(32, 128, 2, num_stages=2))
    ref = _grouped_ref(q_ref, s_ref, wd, sd, 128)
    torch.testing.assert_close(y.float().cpu(), ref.to(torch.bfloat16).float(), rtol=1e-2,
                               atol=1e-2 * float(ref.abs().max()))


def test_gemv_fp8_out_refuses_balanced_rows(device):
    """The FP8 output's scale groups are whole tiles (oscale [M, d / block_n], group g =
    program g's block_n columns, the down GEMV's K steps): a program owning fewer rows
    cannot produce them, so such a config is refused, not run into wrong groups; rows =
    block_n is the whole tile and runs."""
    d, k = 256, 256
    xq, sx, wq, sw = _operands(1, 2 * d, k, device, seed=10)
    with pytest.raises(AssertionError, match="balanced rows"):
        gemv_fp8(xq, sx, wq, sw, WoqGemvConfig(128, 128, 1, num_stages=2, promote=128,
                                               rows=100), silu_and_mul=True, fp8_out=True)
    whole = WoqGemvConfig(128, 128, 1, num_stages=2, promote=128)
    hq, hs = gemv_fp8(xq, sx, wq, sw, WoqGemvConfig(128, 128, 1, num_stages=2, promote=128,
                                                    rows=128), silu_and_mul=True, fp8_out=True)
    hq0, hs0 = gemv_fp8(xq, sx, wq, sw, whole, silu_and_mul=True, fp8_out=True)
    assert torch.equal(hs, hs0) and torch.equal(hq.view(torch.uint8), hq0.view(torch.uint8))


@pytest.mark.gpu
@requires_cuda
def test_gemv_fp8_chain_real_shapes():
    """Llama-3.1-8B's MLP at M = 1 and 8: gate/up + SiLU with FP8 output in 128-wide groups
    (the default ``fp8a8-siluq`` tile), then down on those groups (``fp8a8-xg``)."""
    dev = torch.device("cuda")
    d, k = 14336, 4096
    for m in (1, 8):
        xq, sx, wq, sw = _operands(m, 2 * d, k, dev, seed=m)
        hq, hs = gemv_fp8(xq, sx, wq, sw, default_config("fp8a8-siluq", m, d, k, dev),
                          silu_and_mul=True, fp8_out=True)
        full = gemv_fp8_ref(xq, sx, wq, sw, torch.bfloat16)
        h = torch.nn.functional.silu(full[:, :d]) * full[:, d:]
        h_back = hq.float() * hs.repeat_interleave(128, dim=1)
        torch.testing.assert_close(h_back, h.float(), rtol=8e-2,
                                   atol=2e-2 * float(h.abs().max()))
        wd, sd = quantize_fp8_ref(torch.randn(k, d, device=dev))
        y = gemv_fp8(hq, hs, wd, sd, default_config("fp8a8-xg", m, k, d, dev))
        ref = (h_back @ wd.float().t()) * sd[None, :]
        torch.testing.assert_close(y.float(), ref, rtol=2e-2,
                                   atol=2e-2 * float(ref.abs().max()))
