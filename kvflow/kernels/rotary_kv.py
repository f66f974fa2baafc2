"""Rotary embedding of q and k fused with the paged KV-cache write, in one launch.

References: ``kvflow.layers.rotary.apply_rotary_ref`` (rotate-half / NeoX layout, float32
cos/sin, one rounding to the input dtype) and
``kvflow.layers.attention.torch_backend.write_kv_ref`` (store at flat slot
``block_id * block_size + offset``; slot -1 is skipped).

Algorithm: grid ``(T,)``, one program per token. It reads the token's position and its
cos/sin row (``cos_sin_cache[pos] = [cos | sin]``, float32, D/2 each), rotates all H
query heads as one ``[H_PAD, D/2]`` tile pair (x1, x2) and all KVH key heads the same
way, writes ``q_rot`` and ``k_rot``, and, when ``slot_mapping[t] >= 0``, stores ``k_rot``
and ``v`` into ``kv_cache[0|1].view(-1, KVH, D)[slot]``. Rows of q/k/v beyond
``slot_mapping.shape[0]`` (CUDA-graph padding) are rotated but not cached.

Quantized caches (``kv_quant``, reference ``kvflow.layers.attention.kv_quant``): int8
stores ``round(x / s)`` with ``s = max|x| / 127`` per token and KV head (the head's
max comes from the two rotated halves already in registers) and writes ``s`` to the
scale tensor at the same slot; fp8 stores ``x / scale`` saturated to +-448 and rounded
to nearest even (one per-tensor scale each for K and V).

Traffic (memory-bound), per token with elem = 2 bytes:
``(2*H*D + 2*KVH*D) * elem`` (q, k read + write) ``+ KVH*D*elem`` (v read)
``+ 2*KVH*D*elem`` (cache write) ``+ 4*D`` (cos/sin) ``+ 8`` (position) ``+ 8`` (slot).
Llama-3.1-8B (H=32, KVH=8, D=128): 27.2 KB per token; 8192 tokens ~222 MB, ~53 us at
4.2 TB/s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def _rotate_heads(src_ptr, dst_ptr, src_stride_h, n_heads, cos, sin, half,
                  HEADS: tl.constexpr, HALF: tl.constexpr):
    """Rotate n_heads rows of one token; returns (x1', x2') as float32 [HEADS, HALF]."""
    h = tl.arange(0, HEADS)
    c = tl.arange(0, HALF)
    mask = (h < n_heads)[:, None] & (c < half)[None, :]
    src = src_ptr + h[:, None] * src_stride_h + c[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    dst = dst_ptr + h[:, None] * (2 * half) + c[None, :]
    tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, o2.to(dst_ptr.dtype.element_ty), mask=mask)
    return o1, o2, mask


@triton.jit
def _fp8_grid(y):
    """Round float32 y (|y| <= 448) to the nearest E4M3 value, in exact float32 steps:
    normals keep 4 significant bits (Veltkamp split), subnormals step 2^-9. Only for
    the CPU interpreter, whose float8 cast drops the carry when rounding up across a
    power of two; a GPU's cvt rounds correctly (and would contract these steps into FMAs)."""
    c = y * 1048577.0  # 2^20 + 1
    hi = c - (c - y)
    magic = 12582912.0  # 1.5 * 2^23: adding it rounds to an integer
    sub = ((y * 512.0 + magic) - magic) / 512.0
    return tl.where(tl.abs(y) < 0.015625, sub, hi)


@triton.jit
def _store_kv(dst, sc_ptr, x1, x2, mask, half, inv_scale, QUANT: tl.constexpr,
              HEADS: tl.constexpr, EMULATED: tl.constexpr):
    """Store one token's rotated/plain halves x1, x2 [KVH_PAD, HALF] (float32) at dst
    (+half): as is (QUANT 0), int8 with a scale per head at sc_ptr (1), fp8 (2)."""
    if QUANT == 1:
        amax = tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1))
        sc = amax / 127.0  # [KVH_PAD]
        h = tl.arange(0, HEADS)
        tl.store(sc_ptr + h, sc, mask=tl.max(mask.to(tl.int32), axis=1) > 0)
        sc = tl.where(sc > 0.0, sc, 1.0)[:, None]  # all-zero head: stays 0
        y1 = x1 / sc
        y2 = x2 / sc
        # round half away from zero (the interpreter has no rint)
        y1 = tl.where(y1 >= 0, tl.floor(y1 + 0.5), tl.ceil(y1 - 0.5))
        y2 = tl.where(y2 >= 0, tl.floor(y2 + 0.5), tl.ceil(y2 - 0.5))
        tl.store(dst, y1.to(tl.int8), mask=mask)
        tl.store(dst + half, y2.to(tl.int8), mask=mask)
    elif QUANT == 2:
        y1 = tl.minimum(tl.maximum(x1 * inv_scale, -448.0), 448.0)
        y2 = tl.minimum(tl.maximum(x2 * inv_scale, -448.0), 448.0)
        if EMULATED:
            y1 = _fp8_grid(y1)
            y2 = _fp8_grid(y2)
        tl.store(dst, y1.to(dst.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(dst + half, y2.to(dst.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=mask)
    else:
        tl.store(dst, x1.to(dst.dtype.element_ty), mask=mask)
        tl.store(dst + half, x2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_cache_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr,
                         q_out_ptr, k_out_ptr, ks_ptr, vs_ptr, k_inv_scale, v_inv_scale,
                         n_slots, num_heads, num_kv_heads, half,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cs, stride_c_slot, stride_c_head, stride_s_slot,
                         H_PAD: tl.constexpr, KVH_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                         QUANT: tl.constexpr, EMULATED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.arange(0, HALF_PAD)
    cs_row = cs_ptr + pos * stride_cs
    cos = tl.load(cs_row + c, mask=c < half, other=0.0)
    sin = tl.load(cs_row + half + c, mask=c < half, other=0.0)

    d = 2 * half
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * num_heads * d, stride_qh,
                  num_heads, cos, sin, half, H_PAD, HALF_PAD)
    k1, k2, kmask = _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * num_kv_heads * d,
                                  stride_kh, num_kv_heads, cos, sin, half, KVH_PAD, HALF_PAD)

    slot = tl.load(slot_ptr + t, mask=t < n_slots, other=-1).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, KVH_PAD)
        kc = kc_ptr + slot * stride_c_slot + h[:, None] * stride_c_head + c[None, :]
        if QUANT == 0:  # unquantized: k rounds once, from the float32 rotation
            _store_kv(kc, ks_ptr, k1, k2, kmask, half, k_inv_scale, QUANT, KVH_PAD, EMULATED)
        else:  # quantized from k_rot as rounded to the model dtype (the reference's input)
            _store_kv(kc, ks_ptr + slot * stride_s_slot, k1.to(k_out_ptr.dtype.element_ty)
                      .to(tl.float32), k2.to(k_out_ptr.dtype.element_ty).to(tl.float32),
                      kmask, half, k_inv_scale, QUANT, KVH_PAD, EMULATED)
        vsrc = v_ptr + t * stride_vt + h[:, None] * stride_vh + c[None, :]
        vc = vc_ptr + slot * stride_c_slot + h[:, None] * stride_c_head + c[None, :]
        v1 = tl.load(vsrc, mask=kmask, other=0.0).to(tl.float32)
        v2 = tl.load(vsrc + half, mask=kmask, other=0.0).to(tl.float32)
        _store_kv(vc, vs_ptr + slot * stride_s_slot, v1, v2, kmask, half, v_inv_scale,
                  QUANT, KVH_PAD, EMULATED)


def rotary_and_cache_write(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, cos_sin_cache: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                           q_out: torch.Tensor | None = None,
                           k_out: torch.Tensor | None = None,
                           kv_quant=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, KVH, D] at ``positions`` [T]; store k_rot and v
    [T, KVH, D] into kv_cache [2, NB, BS, KVH, D] at ``slot_mapping`` [<=T] (-1 skips).

    ``cos_sin_cache`` is float32 [max_pos, D] = [cos | sin]. Returns (q_rot, k_rot),
    contiguous; ``q_out`` / ``k_out`` are written when given (they may be q / k if those
    are contiguous). ``kv_quant`` (a ``KVQuant``): the cache is int8 (scales
    [2, NB, BS, KVH] float32 written beside it) or fp8 (per-tensor scales).
    """
    t, num_heads, d = q.shape
    num_kv_heads = k.shape[1]
    assert d % 2 == 0 and cos_sin_cache.shape[-1] == d, "cos_sin_cache must be [max_pos, D]"
    assert k.shape == (t, num_kv_heads, d) and v.shape == k.shape
    assert kv_cache.shape[0] == 2 and kv_cache.shape[-2:] == (num_kv_heads, d)
    assert kv_cache.stride(-1) == 1 and kv_cache.stride(-2) == d
    assert kv_cache.stride(1) == kv_cache.shape[2] * kv_cache.stride(2), "blocks must be dense"
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cos_sin_cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    if q_out is None:
        q_out = torch.empty((t, num_heads, d), dtype=q.dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty((t, num_kv_heads, d), dtype=k.dtype, device=k.device)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    if t == 0:
        return q_out, k_out
    half = d // 2
    heads_pad = triton.next_power_of_2(num_heads)
    quant, scales, k_inv, v_inv = 0, kv_cache, 1.0, 1.0  # scales: unused unless int8
    if kv_quant is not None and kv_quant.kind == "int8":
        quant, scales = 1, kv_quant.scales
        assert kv_cache.dtype == torch.int8 and scales.dtype == torch.float32
        assert scales.shape == kv_cache.shape[:-1] and scales.is_contiguous()
    elif kv_quant is not None:
        quant, k_inv, v_inv = 2, 1.0 / kv_quant.k_scale, 1.0 / kv_quant.v_scale
        assert kv_cache.dtype == torch.float8_e4m3fn
    _rotary_cache_kernel[(t,)](
        positions, q, k, v, cos_sin_cache, kv_cache[0], kv_cache[1], slot_mapping,
        q_out, k_out, scales[0], scales[1], k_inv, v_inv, slot_mapping.shape[0], num_heads,
        num_kv_heads, half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        scales.stride(2) if quant == 1 else 0,
        H_PAD=heads_pad, KVH_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half), QUANT=quant,
        EMULATED=q.device.type == "cpu",
        num_warps=4 if heads_pad * d <= 4096 else 8)
    return q_out, k_out

