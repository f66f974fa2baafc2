"""The C++ decode step's 4-bit GEMV (kvflow/worker/cpu_int4.cpp) against the dequantized
float32 weight, at the embedded model's shapes and others, group sizes 32 to 128, 4-bit
and doubled 8-bit weights, 1 to 4 rows; and the layout it reads (packed.gemv_layout)."""

from __future__ import annotations

import pytest
import torch

from kvflow.layers.quantization.packed import Int4Groups, gemv_layout, quantize_int4
from kvflow.worker import cpu_step

pytestmark = pytest.mark.skipif(cpu_step.find_compiler() is None,
                                reason="no C++ compiler to build the step with")


@pytest.fixture(scope="module")
def ext():
    return cpu_step.load_extension()[0]


def _check(ext, w: Int4Groups, m: int, seed: int = 0) -> None:
    q, sb = gemv_layout(w)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, w.in_features, generator=g)
    ref = w.dequantize().double()  # [N, K]
    want = x.double() @ ref.t()
    got = ext.int4_gemv(x, q, sb, w.group, w.doubled)
    assert got.shape == (m, w.out_features) and got.dtype == torch.float32
    # float32 sums in another order: bounded by a few ulps of sum |x| |w| per output.
    bound = 1e-5 * (x.double().abs() @ ref.abs().t()) + 1e-6
    assert ((got.double() - want).abs() <= bound).all(), float((got - want).abs().max())


@pytest.mark.parametrize("n,k", [(576, 576), (1536 * 2, 576), (576, 1536), (192, 576),
                                 (64, 64), (42, 128), (5, 64)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_int4_matches_dequantized(ext, n, k, m):
    w = quantize_int4(torch.randn(n, k), 32, symmetric=False)
    _check(ext, w, m, seed=n + k + m)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_group_sizes(ext, group, symmetric):
    w = quantize_int4(torch.randn(200, 768), group, symmetric)
    _check(ext, w, 3)


@pytest.mark.parametrize("m", [1, 4])
def test_doubled_8bit(ext, m):
    q = torch.randint(-127, 128, (576, 576), dtype=torch.int8)
    d = torch.rand(576, 576 // 32) * 0.01
    w = Int4Groups.from_int8_blocks(q, d)
    assert torch.allclose(w.dequantize(), (q.float().view(576, -1, 32) * d.unsqueeze(-1)
                                           ).view(576, 576), atol=1e-6)
    _check(ext, w, m)


def test_layout_needs_whole_chunks():
    assert gemv_layout(quantize_int4(torch.randn(8, 64), 16, symmetric=True)) is None
    assert gemv_layout(quantize_int4(torch.randn(8, 96), 32, symmetric=True)) is None


def test_bad_input_is_an_error(ext):
    w = quantize_int4(torch.randn(64, 64), 32, symmetric=False)
    q, sb = gemv_layout(w)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        ext.int4_gemv(torch.randn(5, 64), q, sb, 32, False)
    with pytest.raises(RuntimeError, match="x float32"):
        ext.int4_gemv(torch.randn(1, 64, dtype=torch.bfloat16), q, sb, 32, False)
    with pytest.raises(RuntimeError, match="packed values"):
        ext.int4_gemv(torch.randn(1, 128), q, sb, 32, False)
    with pytest.raises(RuntimeError, match="scales"):
        ext.int4_gemv(torch.randn(1, 64), q, sb[:, :1].contiguous(), 32, False)
