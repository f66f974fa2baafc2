"""paged_attention with a per-layer sliding window and soft-capped scores, against
paged_attention_ref (float32 math) on mixed decode / chunked-prefill batches.

Every block wholly before a request's window has its block-table entry pointed at the
NaN block, as the cache manager's freed entries would be: a kernel that reads one (even
masked inside a tile, as P @ V then multiplies NaN by 0) cannot pass. So these tests
prove that windowed loops start at the window, not that they mask what they read.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.paged_attention import paged_attention
from kvflow.layers.attention.torch_backend import paged_attention_ref, window_start
from test_paged_attention_kernel import TOL, Batch, _rope_inputs

# Decodes (contexts 1, 37, 90, 150), then a fresh 20-token prompt, a 30-token chunk in
# the middle of a 101-token sequence and a 1-token chunk after 44 cached tokens.
Q_LENS = [1, 1, 1, 1, 20, 30, 1]
SEQ_LENS = [1, 37, 90, 150, 20, 101, 45]
NUM_DECODES = 4


def _free_before_window(batch: Batch, window: int | None) -> None:
    """Point every block-table entry wholly before a request's window at the NaN block."""
    if window is None:
        return
    bs = batch.kv_cache.shape[2]
    poison = batch.kv_cache.shape[1] - 1
    for i, (n, s) in enumerate(zip(batch.q_lens, batch.seq_lens)):
        first = window_start(s, n, window) // bs
        batch.block_tables[i, :first] = poison


def _run(batch: Batch, window, softcap, **kw) -> torch.Tensor:
    return batch.run(window=window, softcap=softcap, **kw)[: batch.qsl[-1]]


def _ref(batch: Batch, window, softcap) -> torch.Tensor:
    return paged_attention_ref(batch.q, batch.kv_cache, batch.block_tables, batch.qsl,
                               batch.seq_lens, batch.scale, window=window, softcap=softcap)


# Windows: 5 and 13 (smaller than most contexts, not block-aligned), 16 (block-aligned),
# 37 (one decode's whole context), 1000 (larger than every context).
@pytest.mark.parametrize("window,softcap,heads", [
    (5, None, (4, 2, 32)), (13, 2.0, (8, 2, 32)), (16, None, (4, 1, 32)),
    (37, 2.0, (4, 2, 32)), (1000, None, (4, 2, 32)), (None, 2.0, (4, 2, 32))],
    ids=lambda x: f"H{x[0]}-KVH{x[1]}-D{x[2]}" if isinstance(x, tuple) else str(x))
def test_window_softcap_mixed_batch(device, window, softcap, heads):
    h, kvh, d = heads
    batch = Batch(Q_LENS, SEQ_LENS, NUM_DECODES, h, kvh, d, 8, torch.float32, device, 3)
    _free_before_window(batch, window)
    want = _ref(batch, window, softcap)
    assert not want.isnan().any()
    for splits in (1, 4):  # split-KV over the window (empty splits included)
        torch.testing.assert_close(_run(batch, window, softcap, num_kv_splits=splits), want,
                                   **TOL[torch.float32])


def test_window_and_softcap_change_the_result(device):
    """The reference (and so the tests above) would notice a kernel ignoring either."""
    batch = Batch(Q_LENS, SEQ_LENS, NUM_DECODES, 4, 2, 32, 8, torch.float32, device, 3)
    full = _ref(batch, None, None)
    rows = slice(1, None)  # past the 1-token context, where a window of 5 cuts keys off
    assert (_ref(batch, 5, None)[rows] - full[rows]).abs().max() > 1e-2
    assert (_ref(batch, None, 2.0) - full).abs().max() > 1e-2
    got = _run(batch, None, None)
    torch.testing.assert_close(got, full, **TOL[torch.float32])


def test_window_bf16_prefill_tiles(device):
    """bf16, a 200-token prompt and a 70-token chunk after 230 cached tokens, a window of
    150: 64-token q-blocks whose rows' windows start in different 64-key tiles (masked
    front tiles, then unmasked tiles inside every row's window, then the diagonal)."""
    batch = Batch([200, 70], [200, 300], 0, 4, 2, 64, 16, torch.bfloat16, device, 5)
    _free_before_window(batch, 150)
    torch.testing.assert_close(_run(batch, 150, 3.0), _ref(batch, 150, 3.0),
                               **TOL[torch.bfloat16])


def test_window_deterministic_splits(device):
    """--deterministic: fixed 64-key splits; those wholly before a decode's window write
    nothing and the merge starts at the window's first split."""
    batch = Batch([1, 1, 1, 5], [30, 150, 200, 140], 3, 4, 2, 32, 16, torch.float32,
                  device, 9)
    _free_before_window(batch, 70)
    torch.testing.assert_close(_run(batch, 70, 2.0, num_kv_splits=4, split_tokens=64),
                               _ref(batch, 70, 2.0), **TOL[torch.float32])


def test_window_decode_rope_in_attention(device):
    """Rotary + cache write inside the windowed, soft-capped decode launch."""
    from kvflow.kernels.paged_attention import DecodeRope
    from kvflow.kernels.rotary_kv import rotary_and_cache_write

    seq_lens = [1, 16, 45, 200]
    batch = Batch([1] * 4, seq_lens, 4, 8, 2, 32, 16, torch.float32, device, 7)
    _free_before_window(batch, 20)
    q, k, v, rotary, positions, slots = _rope_inputs(batch, 8, 2, 32, torch.float32,
                                                     device, 7)
    cache = batch.kv_cache.clone()
    q_rot, _ = rotary_and_cache_write(positions, q, k, v, rotary.cos_sin_cache, cache, slots)
    fresh_cache = batch.kv_cache
    batch.q, batch.kv_cache = q_rot, cache
    want = _ref(batch, 20, 2.0)
    for splits in (1, 4):
        got = paged_attention(q, fresh_cache.clone(), batch.block_tables,
                              batch.query_start_loc, batch.seq_lens_t, batch.scale,
                              num_decodes=4, max_query_len=1, max_seq_len=200,
                              num_kv_splits=splits, window=20, softcap=2.0,
                              rope=DecodeRope(rotary.cos_sin_cache, k, v, slots))
        torch.testing.assert_close(got, want, **TOL[torch.float32])
