"""copy_blocks (Triton) against copy_blocks_ref."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.copy_blocks import copy_blocks, copy_blocks_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 10, 4, 2, 16), (3, 7, 16, 1, 64)])
@pytest.mark.parametrize("seed", [0, 1])
def test_copy_blocks_matches_reference(device, dtype, shape, seed):
    layers, nb, bs, kvh, d = shape
    g = torch.Generator().manual_seed(seed)
    caches = torch.randn((layers, 2, nb, bs, kvh, d), generator=g).to(dtype).to(device)
    perm = torch.randperm(nb, generator=g)
    pairs = torch.stack([perm[:3], perm[3:6]], dim=1).to(device)  # distinct src and dst
    want = caches.clone()
    copy_blocks_ref(want, pairs)
    copy_blocks(caches, pairs)
    torch.testing.assert_close(caches, want, rtol=0, atol=0)
    untouched = [b for b in range(nb) if b not in pairs[:, 1].tolist()]
    assert torch.equal(caches[:, :, untouched], want[:, :, untouched])


def test_no_pairs_is_a_no_op(device):
    caches = torch.randn(1, 2, 3, 4, 1, 8, device=device)
    before = caches.clone()
    copy_blocks(caches, torch.empty(0, 2, dtype=torch.int64, device=device))
    assert torch.equal(caches, before)
