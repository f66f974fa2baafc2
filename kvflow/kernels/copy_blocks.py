"""Copy whole KV blocks across every layer in one launch (copy-on-write).

``caches`` is the engine's single KV tensor [L, 2, NB, BS, KVH, D] (each layer's cache is
a view of it). ``pairs`` [C, 2] int64 holds (src, dst) block ids. Program (c, lk, j) copies
chunk j of block pairs[c] for layer-and-K/V slice lk: C * 2L * BS * KVH * D elements are
read once and written once.

Reference: ``copy_blocks_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 1024


@triton.jit
def _copy_blocks_kernel(cache_ptr, pairs_ptr, stride_lk, stride_block, block_numel,
                        CHUNK: tl.constexpr):
    c = tl.program_id(0)
    lk = tl.program_id(1)
    j = tl.program_id(2)
    src = tl.load(pairs_ptr + 2 * c).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * c + 1).to(tl.int64)
    offs = j * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    base = cache_ptr + lk.to(tl.int64) * stride_lk
    vals = tl.load(base + src * stride_block + offs, mask=mask)
    tl.store(base + dst * stride_block + offs, vals, mask=mask)


def copy_blocks_ref(caches: torch.Tensor, pairs: torch.Tensor) -> None:
    """caches [L, 2, NB, ...]: block dst := block src for each (src, dst) row of pairs."""
    if pairs.numel():
        caches[:, :, pairs[:, 1]] = caches[:, :, pairs[:, 0]]


def copy_blocks(caches: torch.Tensor, pairs: torch.Tensor) -> None:
    """Triton version of copy_blocks_ref (one launch for every pair, layer, K and V)."""
    num = pairs.shape[0]
    if num == 0:
        return
    assert caches.is_contiguous() and pairs.dtype == torch.int64 and pairs.is_contiguous()
    layers, two, _ = caches.shape[:3]
    block_numel = caches[0, 0, 0].numel()
    grid = (num, layers * two, triton.cdiv(block_numel, _CHUNK))
    _copy_blocks_kernel[grid](caches, pairs, caches.stride(1), caches.stride(2), block_numel,
                              CHUNK=_CHUNK)
