"""apply_token_bitmask_kernel against the torch path and the per-row reference: random
bitmasks, a bitmask narrower than the logits (padded vocabulary: forbidden past 32 W),
bit 31 (the sign bit), rows out of order, fp32 and bf16 logits."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.token_bitmask import BLOCK, apply_token_bitmask_kernel
from kvflow.layers.token_bitmask import apply_token_bitmask_ref, apply_token_bitmask_torch


def _bitmask(allowed: list[list[int]], words: int) -> torch.Tensor:
    bits = torch.zeros(len(allowed), words * 32, dtype=torch.bool)
    for r, ids in enumerate(allowed):
        bits[r, ids] = True
    w = (bits.view(len(allowed), words, 32).to(torch.int64)
         << torch.arange(32)).sum(-1)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,grammar_vocab", [(70, 70), (BLOCK + 100, BLOCK + 100),
                                                  (2 * BLOCK + 5, 3000)])
def test_matches_reference(device, dtype, vocab, grammar_vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    rows = [4, 1, 2]
    allowed = [sorted(set(torch.randint(0, grammar_vocab, (40,), generator=g).tolist())
                      | {31, grammar_vocab - 1}) for _ in rows]
    words = -(-grammar_vocab // 32)
    bitmask = _bitmask(allowed, words)
    want = apply_token_bitmask_ref(logits, rows, allowed)
    torch_path = apply_token_bitmask_torch(logits.clone(), torch.tensor(rows), bitmask)
    assert torch.equal(torch_path, want)
    got = apply_token_bitmask_kernel(logits.clone().to(device),
                                     torch.tensor(rows, device=device), bitmask.to(device))
    assert torch.equal(got.cpu(), want)


def test_no_rows(device):
    logits = torch.randn(2, 50, device=device)
    out = apply_token_bitmask_kernel(logits.clone(), torch.empty(0, dtype=torch.int64,
                                                                 device=device),
                                     torch.empty(0, 2, dtype=torch.int32, device=device))
    assert torch.equal(out, logits)
