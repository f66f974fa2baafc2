"""Applying a grammar's token bitmask to logits: a Triton launch on GPU, vectorized torch
on CPU.

Bit ``t % 32`` of word ``t // 32`` of a row says whether token ``t`` is allowed (the
layout xgrammar fills). A bitmask of W words covers tokens below 32 W; the logits past
that (a vocabulary padded past the tokenizer, which the grammar never sees) are
forbidden. Only the rows that carry a constraint are touched.
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[M, W] int32 -> [M, vocab_size] bool (True: allowed; False past 32 W)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [M, W, 32]
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]),
                                          value=False)
    return allowed


def apply_token_bitmask_torch(logits: torch.Tensor, rows: torch.Tensor,
                              bitmask: torch.Tensor) -> torch.Tensor:
    """The vectorized torch path (CPU, and the kernel's reference)."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])  # [M, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                        bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of forbidden tokens to -inf in ``rows`` of ``logits`` [N, V], in
    place; returns ``logits``."""
    if logits.is_cuda:
        from kvflow.kernels.token_bitmask import apply_token_bitmask_kernel

        return apply_token_bitmask_kernel(logits, rows, bitmask)
    return apply_token_bitmask_torch(logits, rows, bitmask)


def apply_token_bitmask_ref(logits: torch.Tensor, rows: list[int],
                            allowed_ids: list[list[int]]) -> torch.Tensor:
    """Reference: per row, keep the listed token ids, -inf elsewhere."""
    out = logits.clone()
    for r, ids in zip(rows, allowed_ids):
        keep = torch.full_like(out[r], float("-inf"))
        keep[ids] = out[r, ids]
        out[r] = keep
    return out
