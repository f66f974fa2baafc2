"""A grammar's token bitmask applied to the logits of the constrained rows, one launch.

Reference: ``kvflow.layers.token_bitmask.apply_token_bitmask_torch`` (the CPU's path):
``logits[rows[i], t] = -inf`` where bit ``t % 32`` of word ``t // 32`` of bitmask row i
is clear, and for every ``t >= 32 * W`` (a grammar vocabulary narrower than the logits:
padded ids are never allowed).

Why: the torch path unpacks the bits into a [M, W, 32] int32 tensor, a bool mask, a
gathered copy of the rows and an indexed write back: about eight launches and several
times the rows' bytes, on the critical path between the forward and the sampler. Here
program (i, j) reads BLOCK words' worth of row ``rows[i]``'s logits once and writes back
only the forbidden ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # logits a program: 128 bitmask words


@triton.jit
def _apply_kernel(logits_ptr, rows_ptr, mask_ptr, V, W, stride_l, stride_m,
                  BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_v = offs < V
    word_idx = offs // 32
    words = tl.load(mask_ptr + i * stride_m + word_idx, mask=in_v & (word_idx < W), other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    ptrs = logits_ptr + row * stride_l + offs
    tl.store(ptrs, tl.full((BLOCK,), float("-inf"), logits_ptr.dtype.element_ty),
             mask=in_v & ~allowed)


def apply_token_bitmask_kernel(logits: torch.Tensor, rows: torch.Tensor,
                               bitmask: torch.Tensor) -> torch.Tensor:
    """In place on ``logits`` [N, V] (rows ``rows`` [M] int, bitmask [M, W] int32, all on
    the logits' device); returns ``logits``."""
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    m = rows.shape[0]
    if m == 0:
        return logits
    v = logits.shape[-1]
    _apply_kernel[(m, triton.cdiv(v, BLOCK))](logits, rows, bitmask, v, bitmask.shape[1],
                                             logits.stride(0), bitmask.stride(0),
                                             BLOCK=BLOCK, num_warps=4)
    return logits
