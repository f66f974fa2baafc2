"""The C++ decode step's 4-bit GEMVs (kvflow/cpu/int4.cpp) against the dequantized
float32 weight, at the embedded model's shapes and others, group sizes 32 to 128, 4-bit
and doubled 8-bit weights: the float32-activation one (1 to 16 rows in one pass, also
through quant_gemv) and the int8-activation one (q8_gemv, any number of rows, its VNNI kernel and its
plain loops); and the layouts they read (packed.gemv_layout, packed.q8_layout)."""

from __future__ import annotations

import pytest
import torch

from kvflow.layers.quantization.packed import Int4Groups, gemv_layout, quantize_int4
from kvflow.cpu import step as cpu_step

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
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
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
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        ext.int4_gemv(torch.randn(17, 64), q, sb, 32, False)
    with pytest.raises(RuntimeError, match="x float32"):
        ext.int4_gemv(torch.randn(1, 64, dtype=torch.bfloat16), q, sb, 32, False)
    with pytest.raises(RuntimeError, match="packed values"):
        ext.int4_gemv(torch.randn(1, 128), q, sb, 32, False)
    with pytest.raises(RuntimeError, match="scales"):
        ext.int4_gemv(torch.randn(1, 64), q, sb[:, :1].contiguous(), 32, False)


# The int8-activation GEMV (q8_gemv): activations rounded to int8 per row and block of
# 32, integer dot products; against packed.q8_reference (the same rounding in torch, the
# product in float64) with the layout's own dequantized weight.

def _fp16_groups(n: int, k: int, group: int = 32, seed: int = 0) -> Int4Groups:
    """Random affine 4-bit weights whose scales and biases are float16 values (as GGUF
    Q4_1 stores them), so that q8_layout is exact."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half().float()
    low = (torch.randn(n, k // group, generator=g) * 0.05).half().float()
    return Int4Groups(v, scale, low + 8 * scale, group)


def _q8(w: Int4Groups):
    from kvflow.layers.quantization.packed import q8_layout

    return q8_layout(*gemv_layout(w), w.group, w.doubled)


def _check_q8(ext, w: Int4Groups, m: int, simd: bool, seed: int = 0) -> None:
    from kvflow.layers.quantization.packed import q8_dequantize, q8_reference

    blocks, bits = _q8(w)
    deq = q8_dequantize(blocks, bits)
    assert torch.equal(deq, w.dequantize())  # the layout loses nothing
    x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(seed))
    got = ext.q8_gemv(x, blocks, bits, simd)
    want = q8_reference(x, deq)
    assert got.shape == (m, w.out_features) and got.dtype == torch.float32
    bound = 1e-5 * (x.double().abs() @ deq.double().abs().t()) + 1e-6
    assert ((got.double() - want).abs() <= bound).all(), float((got - want).abs().max())
    # The rounding itself: far below a wrong kernel's order-one error.
    exact = x.double() @ deq.double().t()
    assert float((got - exact).abs().max() / exact.abs().max()) < 3e-2


def _simd_modes(ext) -> list[bool]:
    return [True, False] if ext.q8_gemv_simd() else [False]


@pytest.mark.parametrize("n,k", [(576, 576), (3072, 576), (576, 1536), (37, 128), (5, 64)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16])
def test_q8_4bit_matches_reference(ext, n, k, m):
    for simd in _simd_modes(ext):
        _check_q8(ext, _fp16_groups(n, k, seed=n + m), m, simd, seed=m)


@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("group", [64, 128])
def test_q8_larger_groups(ext, m, group):
    for simd in _simd_modes(ext):
        _check_q8(ext, _fp16_groups(45, 256, group), m, simd)


@pytest.mark.parametrize("m", [1, 6, 16])
def test_q8_8bit_blocks(ext, m):
    """Q8_0 blocks (doubled 8-bit with the high half 16x the low one) -> one byte each,
    and a 4-bit shard widened into the same merged layer (its high half zero)."""
    g = torch.Generator().manual_seed(m)
    q = torch.randint(-127, 128, (67, 192), dtype=torch.int8, generator=g)
    d = (torch.rand(67, 6, generator=g) * 0.01).half().float()
    w8 = Int4Groups.from_int8_blocks(q, d)
    w4 = _fp16_groups(13, 192, seed=m)
    from kvflow.layers.quantization.gguf import widen

    for w in (w8, Int4Groups.cat([w8, widen(w4)])):
        assert _q8(w)[1] == 8
        for simd in _simd_modes(ext):
            _check_q8(ext, w, m, simd)


def test_q8_layout_refuses_what_it_cannot_hold():
    # 8-bit of K = 96: gemv_layout takes it (2K = 192 nibbles), q8's blocks of 64 not.
    d = torch.rand(8, 3) * 0.01
    assert _q8(Int4Groups.from_int8_blocks(
        torch.randint(-127, 128, (8, 96), dtype=torch.int8), d)) is None
    d = torch.rand(8, 2) * 0.01
    w8 = Int4Groups.from_int8_blocks(torch.randint(-127, 128, (8, 64), dtype=torch.int8), d)
    w8.scale[:, 0] *= 3  # a high half not 16x the low one
    assert _q8(w8) is None


@pytest.mark.parametrize("doubled", [False, True])
@pytest.mark.parametrize("n", [37, 100, 576])
def test_int4_rows_do_not_depend_on_their_neighbours(ext, n, doubled):
    """Each row's outputs are bit-identical whether it runs alone or with up to 15 others
    in one pass (the weights are read once for all rows, in spans): a speculative verify
    step's rows then give exactly the logits of 1-row decode steps."""
    if doubled:
        q8 = torch.randint(-127, 128, (n, 128), dtype=torch.int8)
        w = Int4Groups.from_int8_blocks(q8, torch.rand(n, 4) * 0.01)
    else:
        w = quantize_int4(torch.randn(n, 128), 32, symmetric=False)
    q, sb = gemv_layout(w)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(n))
    alone = torch.cat([ext.int4_gemv(x[i:i + 1], q, sb, w.group, w.doubled) for i in range(16)])
    for m in (2, 3, 5, 9, 16):
        got = ext.int4_gemv(x[:m], q, sb, w.group, w.doubled)
        assert torch.equal(got, alone[:m]), m


@pytest.mark.parametrize("bits", [4, 8])
def test_q8_rows_do_not_depend_on_their_neighbours(ext, bits):
    """The int8-activation GEMV too: a row's outputs are bit-identical alone or among up
    to 299 others, whichever chunks and tiles the kernel cuts the rows into (greedy
    speculative decoding then verifies exactly what 1-row decode steps would pick, and a
    step of any size gives each request what it gets alone)."""
    if bits == 4:
        w = _fp16_groups(103, 192, seed=5)
    else:
        g = torch.Generator().manual_seed(5)
        w = Int4Groups.from_int8_blocks(torch.randint(-127, 128, (103, 192), dtype=torch.int8,
                                                      generator=g),
                                        (torch.rand(103, 6, generator=g) * 0.01).half().float())
    blocks, b = _q8(w)
    assert b == bits
    x = torch.randn(300, 192, generator=torch.Generator().manual_seed(bits))
    for simd in _simd_modes(ext):
        alone = torch.cat([ext.q8_gemv(x[i:i + 1], blocks, bits, simd) for i in range(300)])
        # Up to 16 rows (decodes, verify steps) and beyond: batched decodes and prefill
        # chunks of a whole C++ step (over 256 rows: in pieces of 256).
        for m in (2, 3, 5, 6, 9, 13, 16, 17, 40, 256, 257, 300):
            assert torch.equal(ext.q8_gemv(x[:m], blocks, bits, simd), alone[:m]), (simd, m)


@pytest.mark.parametrize("m", [5, 16])
def test_quant_gemv_float_layout_takes_16_rows(ext, m):
    """kind 0 (float32 activations) over more than 4 rows: int4_gemv in one pass."""
    w = quantize_int4(torch.randn(100, 128), 32, symmetric=False)
    q, sb = gemv_layout(w)
    x = torch.randn(m, 128)
    got = ext.quant_gemv(x, q, sb, 32, False, 0)
    torch.testing.assert_close(got[:4], ext.int4_gemv(x[:4], q, sb, 32, False))
    want = (x.double() @ w.dequantize().double().t()).float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_q8_bad_input_is_an_error(ext):
    blocks, bits = _q8(_fp16_groups(8, 64))
    with pytest.raises(RuntimeError, match="at least one row"):
        ext.q8_gemv(torch.randn(0, 64), blocks, bits, False)
    with pytest.raises(RuntimeError, match="x float32"):
        ext.q8_gemv(torch.randn(1, 64, dtype=torch.bfloat16), blocks, bits, False)
    with pytest.raises(RuntimeError, match="weights uint8"):
        ext.q8_gemv(torch.randn(1, 128), blocks, bits, False)
    with pytest.raises(RuntimeError, match="4- or 8-bit"):
        ext.q8_gemv(torch.randn(1, 64), blocks, 5, False)


def test_q8_arena(ext):
    a = ext.q8_arena(1000)
    assert a.dtype == torch.uint8 and a.numel() == 1000 and a.data_ptr() % (2 << 20) == 0
    a.fill_(7)
    assert int(a.sum()) == 7000


@pytest.mark.parametrize("bits", [4, 8])
def test_q8_refine_top(ext, bits):
    """The lm_head's refinement: the k largest logits of each row recomputed in float32
    from the layout's rows, the others left as they were."""
    from kvflow.layers.quantization.packed import q8_dequantize

    g = torch.Generator().manual_seed(bits)
    if bits == 4:
        w = _fp16_groups(300, 128, seed=3)
    else:
        q = torch.randint(-127, 128, (300, 128), dtype=torch.int8, generator=g)
        w = Int4Groups.from_int8_blocks(q, (torch.rand(300, 4, generator=g) * 0.01).half().float())
    blocks, b = _q8(w)
    assert b == bits
    x = torch.randn(3, 128, generator=g)
    y = ext.q8_gemv(x, blocks, bits, False)
    before = y.clone()
    ext.q8_refine_top(x, blocks, bits, y, 8)
    exact = (x.double() @ q8_dequantize(blocks, bits).double().t()).float()
    for r in range(3):
        top = before[r].topk(8).indices
        torch.testing.assert_close(y[r, top], exact[r, top], rtol=1e-5, atol=1e-5)
        rest = torch.ones(300, dtype=torch.bool)
        rest[top] = False
        assert torch.equal(y[r, rest], before[r, rest])
