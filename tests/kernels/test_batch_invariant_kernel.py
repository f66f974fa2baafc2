"""Batch-invariant matmul (kvflow/kernels/batch_invariant.py) against F.linear, and its
promise: row r of an M-row product is the same bits as the same row in a product of any
other M (both tile shapes included). On the CPU the interpreter checks the loop order;
the tensor-core instructions are checked by the gpu-marked tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels.batch_invariant import matmul, matmul_config

MS = [1, 3, 17, 64, 65, 130]


def _data(m: int, k: int, n: int, dtype, device, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k,n,bias", [(256, 192, False), (200, 72, True)])
def test_matches_linear(device, dtype, k, n, bias):
    x, w, b = _data(130, k, n, dtype, device, bias=bias)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = matmul(x, w, b)
    assert got.dtype == dtype and got.shape == (130, n)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.float(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_batch(device, dtype):
    """The first 130 rows are one batch; every smaller batch is a slice of it, shifted so
    a row sits at other offsets inside its tile, with other rows around it."""
    k, n = 320, 136  # 5 K chunks at bf16 (10 at fp32); N not a multiple of a tile
    x, w, _ = _data(200, k, n, dtype, device, seed=1)
    assert matmul_config(1, dtype).block_m != matmul_config(130, dtype).block_m
    full = matmul(x[:130], w)
    for m in MS:
        for start in {0, 5, 130 - m} if m < 130 else {0}:
            part = matmul(x[start: start + m], w)
            assert torch.equal(part, full[start: start + m]), (m, start)
    # the same rows among different neighbours (rows 130.. of x are other data)
    mixed = torch.cat([x[130:160], x[40:57], x[160:200]])
    assert torch.equal(matmul(mixed, w)[30:47], full[40:57])


def test_strided_and_3d_input(device):
    x, w, _ = _data(12, 128, 64, torch.bfloat16, device, seed=2)
    wide = torch.zeros(12, 256, dtype=x.dtype, device=device)
    wide[:, ::2] = x
    view = wide[:, ::2]  # stride 2 along K
    assert torch.equal(matmul(view, w), matmul(x, w))
    assert torch.equal(matmul(x.view(3, 4, 128), w), matmul(x, w).view(3, 4, 64))
    assert matmul(x[:0], w).shape == (0, 64)


# --- attention: split-KV in fixed key ranges (paged_attention(split_tokens=...)) --------

def _attn_subset(batch, idx: list[int], num_decodes: int, **kw) -> torch.Tensor:
    """paged_attention over requests ``idx`` of ``batch`` (the first ``num_decodes`` of
    them decodes) -> their output rows, in the order of ``idx``."""
    from kvflow.kernels.paged_attention import paged_attention

    q_rows = [torch.arange(batch.qsl[i], batch.qsl[i + 1]) for i in idx]
    q_lens = [len(r) for r in q_rows]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    dev = batch.q.device
    return paged_attention(
        batch.q[torch.cat(q_rows).to(dev)].contiguous(), batch.kv_cache,
        batch.block_tables[torch.tensor(idx, device=dev)].contiguous(),
        torch.tensor(qsl, dtype=torch.int32, device=dev),
        torch.tensor([batch.seq_lens[i] for i in idx], dtype=torch.int32, device=dev),
        batch.scale, num_decodes=num_decodes, max_query_len=max(q_lens),
        max_seq_len=max(batch.seq_lens[i] for i in idx), **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fixed_split_decode_rows_do_not_depend_on_the_batch(device, dtype):
    """A decode row with split_tokens is the same bits alone and among decodes and
    prefill chunks of other context lengths, whatever the grid's split count, and
    matches the reference."""
    from test_paged_attention_kernel import Batch

    # decodes: target (3 splits of 512, the last partial), 1, 513, 2000 keys; then two
    # prefill chunks
    q_lens = [1, 1, 1, 1, 9, 30]
    seq_lens = [1100, 1, 513, 2000, 40, 600]
    b = Batch(q_lens, seq_lens, 4, 8, 2, 64, 16, dtype, device, seed=3)
    kw = dict(split_tokens=512)
    alone = _attn_subset(b, [0], 1, num_kv_splits=3, **kw)
    ref = b.ref()[0:1]
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(alone.float(), ref.float(), **tol)
    for idx, nd, splits in (([1, 0, 3], 3, 4), ([3, 2, 0, 4, 5], 3, 8),
                            ([0, 5], 1, 16), ([2, 1, 0], 3, 3)):
        got = _attn_subset(b, idx, nd, num_kv_splits=splits, **kw)
        row = sum(q_lens[i] for i in idx[:idx.index(0)])
        assert torch.equal(got[row: row + 1], alone), (idx, splits)
    # every decode of the full batch against the reference
    full = b.run(num_kv_splits=4, **kw)
    torch.testing.assert_close(full[:4].float(), b.ref()[:4].float(), **tol)


def test_fixed_split_one_split_equals_no_split(device):
    """Contexts within one split: the merge hands the partial back exactly, so the
    split grid and the unsplit launch give the same bits."""
    from test_paged_attention_kernel import Batch

    b = Batch([1, 1, 1], [100, 512, 7], 3, 4, 2, 64, 16, torch.bfloat16, device, seed=4)
    one = b.run(num_kv_splits=1, split_tokens=512)
    many = b.run(num_kv_splits=4, split_tokens=512)
    assert torch.equal(one, many)


def test_prefill_rows_do_not_depend_on_other_requests(device):
    """The prefill launch: a prompt chunk's rows are the same bits alone and beside
    decodes and other chunks (the same chunk; how a prompt is cut is a GPU test, as the
    interpreter's dot rounds by a row's place in its tile)."""
    from test_paged_attention_kernel import Batch

    q_lens = [1, 1, 37, 5, 64]
    seq_lens = [700, 3, 80, 5, 64]
    b = Batch(q_lens, seq_lens, 2, 8, 2, 64, 16, torch.bfloat16, device, seed=5)
    alone = _attn_subset(b, [2], 0, num_kv_splits=2, split_tokens=512)
    mixed = _attn_subset(b, [1, 0, 4, 2, 3], 2, num_kv_splits=2, split_tokens=512)
    assert torch.equal(mixed[2 + 64: 2 + 64 + 37], alone)
