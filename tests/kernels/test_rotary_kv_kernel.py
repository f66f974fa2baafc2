"""rotary_and_cache_write kernel vs apply_rotary_ref + write_kv_ref."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.rotary_kv import rotary_and_cache_write
from kvflow.layers.attention.torch_backend import write_kv_ref
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary_ref

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=1e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _check(device, dtype, t, h, kvh, d, block_size, num_blocks, max_pos, seed,
           num_slots=None, fused_qkv=True, scaling=None):
    torch.manual_seed(seed)
    rotary = RotaryEmbedding(d, max_pos, 500000.0 if scaling else 10000.0, scaling).to(device)
    positions = torch.randint(0, max_pos, (t,), device=device)
    if fused_qkv:  # q, k, v as strided views of the qkv projection output
        qkv = torch.randn(t, (h + 2 * kvh) * d, dtype=dtype, device=device)
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q, k, v = q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)
    else:
        q = torch.randn(t, h, d, dtype=dtype, device=device)
        k = torch.randn(t, kvh, d, dtype=dtype, device=device)
        v = torch.randn(t, kvh, d, dtype=dtype, device=device)
    num_slots = t if num_slots is None else num_slots
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_slots]
    skip = torch.rand(num_slots, device=device) < 0.2  # padding tokens
    slots = torch.where(skip, torch.full_like(slots, -1), slots)
    kv_cache = torch.randn(2, num_blocks, block_size, kvh, d, dtype=dtype, device=device)
    expected_cache = kv_cache.clone()

    q_rot, k_rot = rotary_and_cache_write(positions, q, k, v, rotary.cos_sin_cache, kv_cache,
                                          slots)

    cos, sin = rotary.cos_sin(positions)
    torch.testing.assert_close(q_rot, apply_rotary_ref(q, cos, sin), **TOL[dtype])
    torch.testing.assert_close(k_rot, apply_rotary_ref(k, cos, sin), **TOL[dtype])
    # The cache must hold exactly k_rot and v at the written slots and be untouched
    # elsewhere (it started as random data).
    write_kv_ref(k_rot, v, expected_cache, slots)
    assert torch.equal(kv_cache, expected_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 64), (8, 1, 128), (6, 2, 32)],
                         ids=lambda x: f"H{x[0]}-KVH{x[1]}-D{x[2]}")
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_rotary_and_cache_write(device, dtype, heads, block_size, seed):
    h, kvh, d = heads
    _check(device, dtype, 11, h, kvh, d, block_size, 7, 300, seed)


@pytest.mark.parametrize("fused_qkv", [True, False])
def test_rotary_llama3_scaling_and_padding_rows(device, fused_qkv):
    """llama3 rope scaling; rows past slot_mapping's length are rotated but not cached."""
    _check(device, torch.bfloat16, 12, 8, 2, 64, 16, 4, 4096, 0, num_slots=9,
           fused_qkv=fused_qkv, scaling=LLAMA3_SCALING)


def test_rotary_in_place(device):
    torch.manual_seed(0)
    t, h, kvh, d = 5, 4, 2, 64
    rotary = RotaryEmbedding(d, 64, 10000.0).to(device)
    positions = torch.arange(t, device=device)
    q = torch.randn(t, h, d, device=device)
    k = torch.randn(t, kvh, d, device=device)
    v = torch.randn(t, kvh, d, device=device)
    cos, sin = rotary.cos_sin(positions)
    q_exp, k_exp = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
    kv_cache = torch.zeros(2, 2, 8, kvh, d, device=device)
    slots = torch.arange(t, device=device)
    q_rot, k_rot = rotary_and_cache_write(positions, q, k, v, rotary.cos_sin_cache, kv_cache,
                                          slots, q_out=q, k_out=k)
    assert q_rot is q and k_rot is k
    torch.testing.assert_close(q, q_exp, **TOL[torch.float32])
    torch.testing.assert_close(k, k_exp, **TOL[torch.float32])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 256, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_and_cache_write_llama8b_gpu(num_tokens, dtype):
    _check("cuda", dtype, num_tokens, 32, 8, 128, 16, 1024, 131072, 0,
           scaling=LLAMA3_SCALING)
