"""Tree attention (Medusa candidate trees) in the Triton paged-attention kernel vs the
torch reference with the same tree masks, and the reference vs a brute-force
computation that gathers each tree token's visible keys explicitly (no mask at all)."""

from __future__ import annotations

import pytest
import torch

from kvflow.layers.attention.metadata import TreeAttention
from kvflow.spec_decode.tree import DraftTree
from tests.kernels.test_paged_attention_kernel import TOL, Batch

TREE = DraftTree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2, 0],
                               [0, 1, 0], [0, 0, 0, 0]])


def brute_force(batch: Batch, visible: list) -> torch.Tensor:
    """Each query row's attention over the key indices it may see, listed one by one."""
    out = torch.zeros_like(batch.q, dtype=torch.float32)
    bs = batch.kv_cache.shape[2]
    for i, seq_len in enumerate(batch.seq_lens):
        s, e = batch.qsl[i], batch.qsl[i + 1]
        n = e - s
        size = 0 if visible[i] is None else visible[i].shape[0]
        for a in range(n):
            pos = seq_len - n + a
            keys = [j for j in range(pos + 1) if j < seq_len - size]
            if a >= n - size:  # a tree token: the root and its own ancestors
                t = a - (n - size)
                keys += [seq_len - size + b for b in range(size) if visible[i][t, b]]
            else:
                keys = list(range(pos + 1))
            blk = batch.block_tables[i].long().cpu()[torch.tensor(keys) // bs]
            off = torch.tensor(keys) % bs
            k = batch.kv_cache[0][blk, off].float()  # [K, KVH, D]
            v = batch.kv_cache[1][blk, off].float()
            group = batch.q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            sc = torch.einsum("hd,khd->hk", batch.q[s + a].float(), k) * batch.scale
            out[s + a] = torch.einsum("hk,khd->hd", sc.softmax(-1), v)
    return out.to(batch.q.dtype)


def tree_batch(device, dtype, nodes: list[int], h=8, kvh=2, d=64, seed=0):
    """Decodes, a plain prefill chunk, then one verification per entry of ``nodes``
    (a tree cut to that many nodes, after a cached context)."""
    q_lens = [1, 1, 23] + [1 + m for m in nodes]
    seq_lens = [40, 77, 23 + 30] + [60 + 17 * j + 1 + m for j, m in enumerate(nodes)]
    batch = Batch(q_lens, seq_lens, 2, h, kvh, d, 16, dtype, device, seed)
    visible = [None, None, None] + [TREE.visible[: m + 1, : m + 1] for m in nodes]
    tree = TreeAttention.build(visible, batch.qsl, seq_lens, device)
    return batch, visible, tree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_reference_matches_brute_force(dtype):
    batch, visible, _ = tree_batch("cpu", dtype, [10, 4, 1])
    ref = paged_ref(batch, visible)
    torch.testing.assert_close(ref, brute_force(batch, visible), **TOL[dtype])
    # The mask matters: plain causal attention differs on the tree rows.
    assert not torch.allclose(batch.ref(), ref, **TOL[dtype])


def paged_ref(batch: Batch, visible: list) -> torch.Tensor:
    from kvflow.layers.attention.torch_backend import paged_attention_ref

    return paged_attention_ref(batch.q, batch.kv_cache, batch.block_tables, batch.qsl,
                               batch.seq_lens, batch.scale, tree_visible=visible)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 2, 64), (2, 2, 64)], ids=lambda x: f"H{x[0]}-KVH{x[1]}")
def test_triton_tree_attention(device, dtype, heads):
    batch, visible, tree = tree_batch(device, dtype, [10, 6, 1], *heads)
    out = batch.run(tree=tree)[: batch.qsl[-1]]
    torch.testing.assert_close(out, paged_ref(batch, visible), **TOL[dtype])


def test_triton_full_tree_of_63_nodes(device):
    """The largest tree the 64-bit masks carry, past several key tiles."""
    tree63 = DraftTree.best(63, [[0.5 ** r for r in range(8)]] * 4)
    q_lens, seq_lens = [64], [64 + 150]
    batch = Batch(q_lens, seq_lens, 0, 8, 2, 64, 16, torch.float32, device, 3)
    vis = [tree63.visible]
    tree = TreeAttention.build(vis, batch.qsl, seq_lens, device)
    out = batch.run(tree=tree)[: batch.qsl[-1]]
    torch.testing.assert_close(out, paged_ref(batch, vis), **TOL[torch.float32])
