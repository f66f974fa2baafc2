"""Quantized KV cache (int8 / fp8) in the Triton kernels: the fused rotary + cache write
stores what the torch reference (``layers/attention/kv_quant.py``) stores, and paged
attention over the quantized cache matches the reference attention over the same
values dequantized. Small shapes run under TRITON_INTERPRET=1 on the CPU."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.paged_attention import paged_attention
from kvflow.kernels.rotary_kv import rotary_and_cache_write
from kvflow.layers.attention.kv_quant import (KVQuant, dequantize_cache, quantize_fp8,
                                             quantize_int8, storage_dtype, write_kv_quant)
from kvflow.layers.attention.torch_backend import paged_attention_ref
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary_ref
from kvflow.utils import cdiv

KINDS = ["int8", "fp8"]


def _quant(kind: str, num_blocks: int, bs: int, kvh: int, device, k_scale=1.0,
           v_scale=1.0) -> KVQuant:
    scales = (torch.zeros(2, num_blocks, bs, kvh, device=device) if kind == "int8"
              else None)
    return KVQuant(kind, scales, k_scale, v_scale)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 32), (6, 3, 64)],
                         ids=lambda x: f"H{x[0]}-KVH{x[1]}-D{x[2]}")
def test_cache_write_quantized(device, kind, dtype, heads):
    h, kvh, d = heads
    torch.manual_seed(0)
    t, bs, nb = 9, 8, 5
    rotary = RotaryEmbedding(d, 256, 10000.0, None).to(device)
    positions = torch.randint(0, 256, (t,), device=device)
    q = torch.randn(t, h, d, dtype=dtype, device=device)
    k = torch.randn(t, kvh, d, dtype=dtype, device=device) * 3
    v = torch.randn(t, kvh, d, dtype=dtype, device=device)
    k[2, 0] = 0.0  # an all-zero head: scale 0, values 0
    slots = torch.randperm(nb * bs, device=device)[:t]
    slots[4] = -1  # a padding row writes nothing
    cache = torch.zeros(2, nb, bs, kvh, d, dtype=storage_dtype(kind), device=device)
    quant = _quant(kind, nb, bs, kvh, device, k_scale=0.5, v_scale=0.25)
    q_rot, k_rot = rotary_and_cache_write(positions, q, k, v, rotary.cos_sin_cache, cache,
                                          slots, kv_quant=quant)
    cos, sin = rotary.cos_sin(positions)
    torch.testing.assert_close(q_rot, apply_rotary_ref(q, cos, sin), atol=1e-2, rtol=1e-2)

    ref_cache = torch.zeros_like(cache)
    ref_quant = _quant(kind, nb, bs, kvh, device, k_scale=0.5, v_scale=0.25)
    keep = slots >= 0
    write_kv_quant(k_rot[keep], v[keep], ref_cache, ref_quant, slots[keep], dtype)
    if kind == "int8":
        diff = (cache.to(torch.int16) - ref_cache.to(torch.int16)).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01
        torch.testing.assert_close(quant.scales, ref_quant.scales, atol=0, rtol=1e-6)
    else:
        assert torch.equal(cache.float(), ref_cache.float())  # (+0 and -0 are equal)
    # The unwritten slots stay empty.
    written = torch.zeros(nb * bs, dtype=torch.bool, device=device)
    written[slots[keep]] = True
    flat = cache.view(torch.uint8).view(2, nb * bs, -1)
    assert not (flat[:, ~written] & 0x7F).any()


def test_quantize_reference_round_trip():
    torch.manual_seed(0)
    x = torch.randn(64, 3, 64) * 5
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.shape == (64, 3)
    err = (q.float() * s[..., None] - x).abs()
    assert bool((err <= s[..., None] / 2 + 1e-6).all())  # within half a step
    f = quantize_fp8(x * 100, 1.0)  # past +-448: saturated, not NaN
    assert not torch.isnan(f.float()).any() and float(f.float().abs().max()) == 448.0


def _paged_batch(kind, dtype, device, h, kvh, d, bs, q_lens, seq_lens, num_decodes, seed):
    torch.manual_seed(seed)
    nblk = [cdiv(s, bs) for s in seq_lens]
    nb = sum(nblk) + 2
    perm = torch.randperm(nb).tolist()
    tables = torch.zeros(len(seq_lens), max(nblk) + 1, dtype=torch.int32)
    for i, n in enumerate(nblk):
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    cache = torch.zeros(2, nb, bs, kvh, d, dtype=storage_dtype(kind), device=device)
    quant = _quant(kind, nb, bs, kvh, device, k_scale=0.05, v_scale=0.02)
    # Fill every slot through the reference quantizer: K with a few outlier channels.
    kv = torch.randn(2, nb * bs, kvh, d, device=device)
    kv[0, :, :, 3] *= 8
    write_kv_quant(kv[0].to(dtype), kv[1].to(dtype), cache, quant,
                   torch.arange(nb * bs, device=device), dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], h, d, dtype=dtype, device=device)
    return q, cache, quant, tables.to(device), qsl


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 32)],
                         ids=lambda x: f"H{x[0]}-KVH{x[1]}-D{x[2]}")
def test_paged_attention_quantized(device, kind, dtype, splits, heads):
    h, kvh, d = heads
    bs = 8
    q_lens, seq_lens = [1, 1, 13, 5], [37, 9, 13, 29]
    q, cache, quant, tables, qsl = _paged_batch(kind, dtype, device, h, kvh, d, bs, q_lens,
                                                seq_lens, 2, seed=1)
    out = paged_attention(
        q, cache, tables, torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), d ** -0.5, num_decodes=2,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), num_kv_splits=splits,
        kv_quant=quant)
    ref = paged_attention_ref(q, dequantize_cache(cache, quant, dtype), tables, qsl, seq_lens,
                              d ** -0.5)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2,
                                                                          rtol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
