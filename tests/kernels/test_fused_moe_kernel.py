"""The fused MoE kernel (Triton, interpreted on CPU) and the CPU routed-experts path
against the per-expert reference, over shapes with empty experts, top-k > 1, tokens
whose experts live on another rank (-1) and int8, int4 (packed along K, group scales)
and float8 experts against the reference on their dequantized weights; the router
against its definition."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.fused_moe import (FAST_ALIGN_MAX_EXPERTS, FAST_ALIGN_MAX_PAIRS,
                                      dequantize_int4_experts, fast_align_fits, fused_moe,
                                      fused_moe_ref, moe_align, moe_align_fast,
                                      pack_int4_experts)
from kvflow.layers.quantization.packed import quantize_int4
from kvflow.layers.moe.methods import routed_experts
from kvflow.layers.moe.router import route

SMALL = dict(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)


def _case(t, h, inter, e, k, seed, dtype, device, drop=0.0, only=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter ** 0.5).to(dtype)
    pool = only if only is not None else e  # route to the first `only` experts alone
    ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(t)])
    ids[torch.rand(t, k, generator=g) < drop] = -1
    w = torch.rand(t, k, generator=g)
    return [a.to(device) for a in (x, w13, w2, w, ids)]


@pytest.mark.parametrize("t,h,inter,e,k,drop,only", [
    (1, 32, 16, 4, 1, 0.0, None),     # decode, one expert
    (3, 32, 48, 8, 2, 0.0, 3),        # five of eight experts empty
    (17, 48, 32, 6, 3, 0.3, None),    # ragged H, top-3, some pairs on other ranks
    (40, 64, 16, 16, 4, 0.0, None),   # many experts, padded blocks
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(device, t, h, inter, e, k, drop, only, dtype):
    if dtype is torch.bfloat16 and t != 17:
        pytest.skip("one bf16 shape is enough on the interpreter")
    x, w13, w2, w, ids = _case(t, h, inter, e, k, t + e, dtype, device, drop, only)
    # without dropped pairs the output rows are not zeroed first: each must be written
    got = fused_moe(x, w13, w2, w, ids, config=SMALL, may_drop=drop > 0)
    want = fused_moe_ref(x, w13, w2, w, ids)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype is torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)


def test_int8_experts_in_the_kernel(device):
    x, w13, w2, w, ids = _case(9, 32, 32, 4, 2, 5, torch.float32, device)
    s13 = w13.abs().amax(-1) / 127  # [E, 2I]
    s2 = w2.abs().amax(-1) / 127  # [E, H]
    q13 = torch.round(w13 / s13[..., None]).to(torch.int8)
    q2 = torch.round(w2 / s2[..., None]).to(torch.int8)
    got = fused_moe(x, q13, q2, w, ids, s13, s2, config=SMALL)
    want = fused_moe_ref(x, q13.float() * s13[..., None], q2.float() * s2[..., None], w, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _int4_experts(w, group, symmetric, dtype):
    """w [E, N, K] -> (pack_int4_experts' layout, its float32 dequantization)."""
    parts = [quantize_int4(w[e].float().cpu(), group, symmetric) for e in range(w.shape[0])]
    packed, scale, offset = pack_int4_experts(
        torch.stack([p.values for p in parts]), torch.stack([p.scale for p in parts]),
        None if symmetric else torch.stack([p.zero for p in parts]), dtype)
    ref = torch.stack([p.dequantize() for p in parts])
    # the layout holds the same weights (scales rounded to the activation dtype)
    tol = 1e-6 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(dequantize_int4_experts(packed, scale, offset, group), ref,
                               atol=tol, rtol=tol)
    dev = w.device
    tensors = (packed.to(dev), scale.to(dev), None if offset is None else offset.to(dev))
    return tensors, dequantize_int4_experts(packed, scale, offset, group).to(dev)


# (t, h, inter, e, k, drop, only, group, block_k, symmetric): decode, empty experts, top-k
# > 1 with other ranks' pairs; tiles narrower than a group (several tiles per group), as
# wide as one, and of several groups (the down GEMM's K = 32 or 64 below a 128-wide
# tile: groups past K unread); symmetric and asymmetric
INT4_CASES = [
    (1, 64, 32, 4, 1, 0.0, None, 32, 32, False),
    (3, 64, 64, 8, 2, 0.0, 3, 64, 32, True),
    (11, 96, 32, 6, 3, 0.3, None, 32, 16, False),
    (24, 128, 64, 16, 4, 0.0, None, 64, 64, True),
    (6, 192, 32, 4, 2, 0.0, None, 32, 128, False),
    (5, 128, 64, 4, 2, 0.2, None, 32, 64, True),
]


@pytest.mark.parametrize("t,h,inter,e,k,drop,only,group,bk,sym", INT4_CASES)
def test_int4_experts_in_the_kernel(device, t, h, inter, e, k, drop, only, group, bk, sym):
    x, w13, w2, w, ids = _case(t, h, inter, e, k, 7 * t + e, torch.float32, device, drop,
                               only)
    (p13, s13, o13), d13 = _int4_experts(w13, group, sym, x.dtype)
    (p2, s2, o2), d2 = _int4_experts(w2, group, sym, x.dtype)
    assert p13.shape == (e, 2 * inter, h // 2) and s13.shape == (e, h // group, 2 * inter)
    got = fused_moe(x, p13, p2, w, ids, s13, s2, config=dict(SMALL, block_k=bk),
                    may_drop=drop > 0, w13_offset=o13, w2_offset=o2, w4_group=group)
    want = fused_moe_ref(x, d13, d2, w, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_int4_experts_bf16_in_the_kernel(device):
    """bf16 activations (the GPU's case): scales and offsets in bf16, tiles of two
    groups."""
    x, w13, w2, w, ids = _case(9, 64, 64, 4, 2, 11, torch.bfloat16, device)
    (p13, s13, o13), d13 = _int4_experts(w13, 32, False, x.dtype)
    (p2, s2, o2), d2 = _int4_experts(w2, 32, False, x.dtype)
    got = fused_moe(x, p13, p2, w, ids, s13, s2, config=dict(SMALL, block_k=64),
                    w13_offset=o13, w2_offset=o2, w4_group=32)
    want = fused_moe_ref(x, d13.to(x.dtype), d2.to(x.dtype), w, ids)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("t,h,inter,e,k,drop,only,dtype", [
    (1, 32, 16, 4, 1, 0.0, None, torch.float32),      # decode
    (5, 48, 32, 8, 2, 0.0, 3, torch.float32),         # empty experts, ragged K tiles
    (17, 32, 48, 6, 3, 0.3, None, torch.bfloat16),    # top-3, other ranks' pairs, bf16
])
def test_fp8_experts_in_the_kernel(device, t, h, inter, e, k, drop, only, dtype):
    """Weight-only float8 (e4m3) experts, per-channel scales in the epilogue."""
    from kvflow.layers.quantization.fp8 import quantize_fp8_rows

    x, w13, w2, w, ids = _case(t, h, inter, e, k, 3 * t + e, dtype, device, drop, only)
    qs = [quantize_fp8_rows(m.float().reshape(-1, m.shape[-1])) for m in (w13, w2)]
    (q13, s13), (q2, s2) = [(q.view(m.shape), s.view(m.shape[:2]))
                            for (q, s), m in zip(qs, (w13, w2))]
    assert q13.dtype == torch.float8_e4m3fn
    got = fused_moe(x, q13, q2, w, ids, s13, s2, config=SMALL, may_drop=drop > 0)
    d13, d2 = q13.float() * s13[..., None], q2.float() * s2[..., None]
    want = fused_moe_ref(x, d13.to(dtype), d2.to(dtype), w, ids)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype is torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("align", [moe_align, moe_align_fast])
def test_moe_align_groups_and_pads(align, device):
    ids = torch.tensor([[2, 0], [2, -1], [5, 2]], device=device)
    sorted_ids, block_expert, num = align(ids, 6, 4)
    n = ids.numel()
    assert int(num) == 12  # experts 0, 2 and 5: one 4-row block each
    rows = sorted_ids[: int(num)].view(-1, 4)
    for b, e in enumerate(block_expert[: int(num) // 4].tolist()):
        pairs = [p for p in rows[b].tolist() if p < n]
        assert pairs and all(ids.view(-1)[p] == e for p in pairs)
    assert sorted(p for p in sorted_ids.tolist() if p < n) == [0, 1, 2, 4, 5]
    assert (block_expert[int(num) // 4:] == -1).all()


# (pairs, experts, block_m, how the ids are drawn): the chunk and bin edges of the
# one-launch kernel (128-lane minimum chunk, 1024-lane chunks past 1024 pairs, histogram
# bins next_pow2(E + 1), 32 at least), experts per program from 32 down to 4, runs of
# many blocks
@pytest.mark.parametrize("n,e,bm,draw", [
    (0, 8, 16, "any"), (1, 128, 16, "any"), (8, 128, 16, "any"), (8, 512, 16, "any"),
    (16, 15, 32, "any"), (17, 16, 16, "drop"), (40, 17, 64, "few"), (64, 64, 16, "any"),
    (96, 3, 16, "one"), (200, 1, 32, "drop"), (1023, 128, 16, "drop"),
    (1024, 60, 64, "few"), (1025, 8, 16, "any"), (2500, 33, 32, "drop"), (1100, 4, 16, "one"),
])
def test_fast_align_equals_torch_align(device, n, e, bm, draw):
    g = torch.Generator().manual_seed(n * 1000 + e)
    if draw == "one":  # every pair on one expert: one long run
        ids = torch.full((n,), e - 1)
    elif draw == "few":  # most experts empty
        ids = torch.randint(0, 3, (n,), generator=g) * (e // 3)
    else:
        ids = torch.randint(0, e, (n,), generator=g)
    if draw in ("drop", "any"):  # other ranks' experts (-1) and ids past the last expert
        r = torch.rand(n, generator=g)
        ids[r < 0.2] = -1
        if draw == "drop":
            ids[r > 0.9] = e + torch.randint(0, 5, (int((r > 0.9).sum()),), generator=g)
    ids = (ids.view(-1, 1) if n % 8 else ids.view(-1, 8)).to(device)
    for got, want in zip(moe_align_fast(ids, e, bm), moe_align(ids, e, bm)):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


def test_fast_align_bounds():
    cuda = torch.device("cuda")
    assert fast_align_fits(FAST_ALIGN_MAX_PAIRS, FAST_ALIGN_MAX_EXPERTS, cuda)
    assert not fast_align_fits(FAST_ALIGN_MAX_PAIRS + 1, 8, cuda)
    assert not fast_align_fits(8, FAST_ALIGN_MAX_EXPERTS + 1, cuda)


def test_cpu_path_reads_only_routed_experts():
    x, w13, w2, w, ids = _case(7, 32, 16, 8, 2, 3, torch.float32, "cpu", 0.2, only=4)
    seen = []

    def mlp(e, rows):
        seen.append(e)
        gu = rows @ w13[e].t()
        return (torch.nn.functional.silu(gu[:, :16]) * gu[:, 16:]) @ w2[e].t()

    got = routed_experts(x, w, ids, 8, mlp)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, w, ids), atol=1e-5, rtol=1e-5)
    assert seen == sorted(set(ids[ids >= 0].tolist()))  # once each, none of the empty ones


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renorm", [True, False])
def test_router(scoring, renorm):
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    w, ids = route(logits, 3, scoring, renorm)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    want = scores.gather(-1, ids)
    if renorm:
        want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(w, want)
    assert (scores.gather(-1, ids).min(-1).values
            >= scores.topk(3).values[:, -1] - 1e-7).all()
    with pytest.raises(ValueError, match="scoring_func"):
        route(logits, 2, "sparsemax", True)


def test_launch_rows_are_tuning_data(tmp_path):
    """The fused MoE launch rows come from the GPU's tuning file (the H100's were measured
    there), a KVFLOW_TUNING_FILE overlay replaces them whole, other GPUs and the CPU get
    DEFAULT_CONFIGS; a step takes the first row whose max_tokens covers it."""
    import json

    from kvflow.kernels import fused_moe as fm
    from kvflow.kernels import tuning

    h100 = tuning.for_device("NVIDIA H100 80GB HBM3").fused_moe
    assert h100 and [r["max_tokens"] for r in h100] == sorted(r["max_tokens"] for r in h100)
    assert h100 == json.load(open(tuning.device_file("NVIDIA H100")))["fused_moe"]
    assert tuning.for_device("NVIDIA A100-SXM4-80GB").fused_moe == []
    overlay = tmp_path / "t.json"
    rows = [dict(max_tokens=10**9, block_m=64, block_n=64, block_k=32, num_warps=4,
                 num_stages=2)]
    tuning.write_rows(str(overlay), "H100", "fused_moe", rows, "r1")
    assert tuning.for_device("NVIDIA H100 80GB HBM3", str(overlay)).fused_moe == rows
    assert fm.fused_moe_config(1, torch.device("cpu")) == fm.DEFAULT_CONFIGS[0]
    assert fm.fused_moe_config(300, torch.device("cpu")) == fm.DEFAULT_CONFIGS[-1]
