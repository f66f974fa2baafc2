"""paged_attention kernel vs paged_attention_ref on mixed prefill/decode batches.

Batches use shuffled, non-contiguous block ids. Every cache slot a request must not
read (the tail of its last block, unused block-table entries) holds NaN, so a kernel
that reads or fails to mask past a context's end cannot pass.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvflow.kernels.paged_attention import (TileConfig, attention_bytes_flops,
                                            choose_num_kv_splits, paged_attention)
from kvflow.layers.attention.torch_backend import paged_attention_ref
from kvflow.utils import cdiv

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=1e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(2, 2, 64), (8, 2, 64), (8, 1, 128)]  # GQA ratios 1, 4, 8
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Batch:
    """A random paged batch: decodes first, then prefill chunks."""

    def __init__(self, q_lens: list[int], seq_lens: list[int], num_decodes: int, h: int,
                 kvh: int, d: int, block_size: int, dtype: torch.dtype, device,
                 seed: int = 0, free_blocks: int = 3) -> None:
        assert all(n == 1 for n in q_lens[:num_decodes])
        torch.manual_seed(seed)
        self.q_lens, self.seq_lens, self.num_decodes = q_lens, seq_lens, num_decodes
        nblk = [cdiv(s, block_size) for s in seq_lens]
        num_blocks = sum(nblk) + free_blocks + 1
        poison = num_blocks - 1  # a NaN block: what unused block-table entries point at
        self.kv_cache = torch.randn(2, num_blocks, block_size, kvh, d, dtype=dtype,
                                    device=device)
        self.kv_cache[:, poison] = float("nan")
        perm = torch.randperm(num_blocks - 1).tolist()
        self.block_tables = torch.full((len(seq_lens), max(nblk, default=0) + 2), poison,
                                       dtype=torch.int32)
        for i, (s, n) in enumerate(zip(seq_lens, nblk)):
            ids = [perm.pop() for _ in range(n)]
            self.block_tables[i, :n] = torch.tensor(ids, dtype=torch.int32)
            if s % block_size:  # slots past the context's end in its last block
                self.kv_cache[:, ids[-1], s % block_size:] = float("nan")
        self.block_tables = self.block_tables.to(device)
        self.qsl = [0]
        for n in q_lens:
            self.qsl.append(self.qsl[-1] + n)
        self.q = torch.randn(self.qsl[-1], h, d, dtype=dtype, device=device)
        self.query_start_loc = torch.tensor(self.qsl, dtype=torch.int32, device=device)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.scale = d ** -0.5

    def run(self, num_kv_splits: int = 1, **kwargs) -> torch.Tensor:
        return paged_attention(
            self.q, self.kv_cache, self.block_tables, self.query_start_loc, self.seq_lens_t,
            self.scale, num_decodes=self.num_decodes,
            max_query_len=max(self.q_lens, default=0), max_seq_len=max(self.seq_lens),
            num_kv_splits=num_kv_splits, **kwargs)

    def ref(self) -> torch.Tensor:
        return paged_attention_ref(self.q, self.kv_cache, self.block_tables, self.qsl,
                                   self.seq_lens, self.scale)


def _mixed_lens(seed: int, num_decodes: int = 3) -> tuple[list[int], list[int]]:
    """Decodes, then: a fresh prompt (no cached prefix), a chunk after a cached prefix, a
    one-token chunk after a prefix. Lengths mostly not multiples of the block size."""
    rng = random.Random(seed)
    q_lens = [1] * num_decodes
    seq_lens = [rng.randint(1, 200) for _ in range(num_decodes)]
    fresh = rng.randint(20, 70)
    q_lens += [fresh, rng.randint(2, 40), 1]
    seq_lens += [fresh, q_lens[-2] + rng.randint(1, 120), rng.randint(2, 90)]
    return q_lens, seq_lens


def _check(batch: Batch, out: torch.Tensor, dtype: torch.dtype) -> None:
    t = batch.qsl[-1]
    torch.testing.assert_close(out[:t], batch.ref(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda x: f"H{x[0]}-KVH{x[1]}-D{x[2]}")
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch(device, dtype, heads, seed):
    h, kvh, d = heads
    q_lens, seq_lens = _mixed_lens(seed)
    batch = Batch(q_lens, seq_lens, 3, h, kvh, d, 16, dtype, device, seed)
    expected = batch.ref()
    for num_kv_splits in (1, 4):
        torch.testing.assert_close(batch.run(num_kv_splits)[: batch.qsl[-1]], expected,
                                   **TOL[dtype])


def test_group_not_power_of_two(device):
    """GQA ratio 3: the group is padded to 4 rows per token and the pad rows masked."""
    q_lens, seq_lens = _mixed_lens(6)
    batch = Batch(q_lens, seq_lens, 3, 6, 2, 64, 16, torch.bfloat16, device, 6)
    expected = batch.ref()
    for num_kv_splits in (1, 2):
        torch.testing.assert_close(batch.run(num_kv_splits)[: batch.qsl[-1]], expected,
                                   **TOL[torch.bfloat16])


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_block_sizes(device, block_size, num_kv_splits):
    q_lens, seq_lens = _mixed_lens(7)
    batch = Batch(q_lens, seq_lens, 3, 8, 2, 64, block_size, torch.bfloat16, device, 7)
    _check(batch, batch.run(num_kv_splits), torch.bfloat16)


@pytest.mark.parametrize("num_kv_splits", [1, 3, 16])
def test_decode_only(device, num_kv_splits):
    """16 splits of a <=300-token context leave most splits empty."""
    rng = random.Random(3)
    seq_lens = [1, 64, 65, rng.randint(100, 300)]
    batch = Batch([1] * 4, seq_lens, 4, 8, 2, 64, 16, torch.float16, device, 3)
    _check(batch, batch.run(num_kv_splits), torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_only(device, dtype):
    batch = Batch([70, 20, 130], [70, 150, 131], 0, 8, 2, 64, 16, dtype, device, 5)
    _check(batch, batch.run(), dtype)


def test_padded_decodes_and_out(device):
    """CUDA-graph padding: decode slots with q_len 0 write nothing; rows past
    query_start_loc[R] are untouched; ``out=`` is filled in place."""
    batch = Batch([1, 1, 0, 0], [40, 90, 0, 0], 2, 8, 2, 64, 16, torch.float16, device, 2)
    t = batch.qsl[-1]
    out = torch.full((t + 3, 8, 64), 7.0, dtype=torch.float16, device=device)
    q = torch.cat([batch.q, torch.zeros(3, 8, 64, dtype=torch.float16, device=device)])
    for splits in (1, 4):
        res = paged_attention(q, batch.kv_cache, batch.block_tables, batch.query_start_loc,
                              batch.seq_lens_t, batch.scale, num_decodes=4, max_query_len=1,
                              max_seq_len=90, num_kv_splits=splits, out=out)
        assert res is out
        torch.testing.assert_close(out[:t], batch.ref(), **TOL[torch.float16])
        assert bool((out[t:] == 7.0).all())


def test_head_dim_not_power_of_two(device):
    q_lens, seq_lens = _mixed_lens(4)
    batch = Batch(q_lens, seq_lens, 3, 4, 2, 48, 16, torch.float32, device, 4)
    _check(batch, batch.run(2), torch.float32)


def test_tile_config_override(device):
    q_lens, seq_lens = _mixed_lens(5)
    batch = Batch(q_lens, seq_lens, 3, 8, 2, 64, 16, torch.float16, device, 5)
    out = batch.run(2, decode_config=TileConfig(16, 16, 4, 2),
                    prefill_config=TileConfig(32, 16, 4, 2))
    _check(batch, out, torch.float16)


def test_choose_num_kv_splits():
    assert choose_num_kv_splits(256, 4096, 8, 132) == 1  # batch fills the GPU
    assert choose_num_kv_splits(1, 100, 8, 132) == 1  # context too short to split
    assert choose_num_kv_splits(1, 4096, 8, 132) == 16  # >= 256 keys per split
    assert choose_num_kv_splits(16, 4096, 8, 132) == 4  # ~4 programs per SM
    assert choose_num_kv_splits(1, 1 << 20, 1, 132) == 64  # capped
    for b in range(1, 300, 7):
        s = choose_num_kv_splits(b, 8192, 8, 132)
        assert 1 <= s <= 64 and s & (s - 1) == 0


def test_attention_bytes_flops():
    nbytes, flops = attention_bytes_flops([1, 4], [10, 4], 2, 1, 8, 2)
    assert nbytes == 14 * 1 * 8 * 2 * 2 + 5 * 2 * 8 * 2 * 2
    assert flops == 4 * 2 * 8 * (10 + (1 + 2 + 3 + 4))


# --- GPU, real shapes (Llama-3.1-8B: H=32, KVH=8, D=128) -----------------------------

def _gpu_batch(q_lens, seq_lens, num_decodes, dtype=torch.bfloat16, heads=(32, 8, 128),
               block_size=16, seed=0):
    h, kvh, d = heads
    return Batch(q_lens, seq_lens, num_decodes, h, kvh, d, block_size, dtype, "cuda", seed)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_kv_splits", [1, 4, None])
def test_decode_batch256_gpu(num_kv_splits):
    rng = random.Random(0)
    seq_lens = [rng.randint(1, 4096) for _ in range(256)]
    batch = _gpu_batch([1] * 256, seq_lens, 256)
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(256, max(seq_lens), 8, _num_sms())
    _check(batch, batch.run(num_kv_splits), torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_context_small_batch_split_gpu(dtype):
    seq_lens = [32768, 17001]
    splits = choose_num_kv_splits(2, max(seq_lens), 8, _num_sms())
    assert splits > 1
    batch = _gpu_batch([1, 1], seq_lens, 2, dtype)
    _check(batch, batch.run(splits), dtype)
    _check(batch, batch.run(1), dtype)


@pytest.mark.gpu
@requires_cuda
def test_prefill_8k_gpu():
    batch = _gpu_batch([8192], [8192], 0)
    _check(batch, batch.run(), torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 16, 64), (32, 4, 128)],
                         ids=lambda x: f"H{x[0]}-KVH{x[1]}-D{x[2]}")
def test_mixed_batch_gpu(block_size, heads):
    rng = random.Random(1)
    seq_lens = [rng.randint(1, 3000) for _ in range(64)] + [2048 + 4096, 512, 777]
    q_lens = [1] * 64 + [2048, 512, 300]
    batch = _gpu_batch(q_lens, seq_lens, 64, heads=heads, block_size=block_size)
    _check(batch, batch.run(2), torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
def test_decode_cuda_graph_capture_gpu():
    """The decode path (with split-KV) captures into a CUDA graph and replays correctly
    after the batch's tensors are updated in place."""
    rng = random.Random(2)
    seq_lens = [rng.randint(1, 8192) for _ in range(32)]
    batch = _gpu_batch([1] * 32, seq_lens, 32)
    splits = choose_num_kv_splits(32, 8192, 8, _num_sms())
    out = torch.empty_like(batch.q)
    batch.run(splits, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch.run(splits, out=out)
    new_lens = [max(1, s - rng.randint(0, 100)) for s in seq_lens]
    batch.seq_lens = new_lens
    batch.seq_lens_t.copy_(torch.tensor(new_lens, dtype=torch.int32))
    batch.q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    _check(batch, out, torch.bfloat16)


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _rope_inputs(batch: Batch, h: int, kvh: int, d: int, dtype, device, seed: int,
                 pad: int = 0):
    """Unrotated q, k, v of the batch's decodes as strided views of one qkv output (plus
    ``pad`` CUDA-graph padding rows), the rotary table, positions (each decode's last
    position) and slots (where its block table puts that position)."""
    from kvflow.layers.rotary import RotaryEmbedding

    g = torch.Generator(device="cpu").manual_seed(seed)
    n = batch.num_decodes
    t = n + pad
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g).to(dtype).to(device)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)
    rotary = RotaryEmbedding(d, 1024, 10000.0, None).to(device)
    bs = batch.kv_cache.shape[2]
    lens = batch.seq_lens[:n] + [1] * pad
    positions = torch.tensor([s - 1 for s in lens], device=device)
    tables = batch.block_tables.cpu()
    slots = torch.tensor([int(tables[i, (s - 1) // bs]) * bs + (s - 1) % bs if s else -1
                          for i, s in enumerate(batch.seq_lens[:n])], device=device)
    return q, k, v, rotary, positions, slots


@pytest.mark.parametrize("dtype,heads,num_kv_splits", [
    (torch.float32, (2, 2, 64), 1), (torch.float32, (8, 2, 64), 16),
    (torch.float16, (8, 1, 128), 3), (torch.bfloat16, (8, 2, 64), 1),
    (torch.bfloat16, (8, 1, 128), 16), (torch.float32, (4, 2, 48), 3)],
    ids=lambda x: str(x).replace("torch.", "") if not isinstance(x, tuple) else
    f"H{x[0]}-KVH{x[1]}-D{x[2]}")
def test_decode_rope_in_attention(device, dtype, heads, num_kv_splits):
    """Rotary + cache write inside the decode launch (``DecodeRope``) gives the result of
    ``rotary_and_cache_write`` followed by the plain decode launch, and leaves the cache
    identical: the new key written by the program whose split holds it (a 1-key context,
    contexts ending on a block edge and inside one, empty splits), nothing else touched
    (the NaN-poisoned slots past each context stay unread and unwritten)."""
    from kvflow.kernels.paged_attention import DecodeRope
    from kvflow.kernels.rotary_kv import rotary_and_cache_write

    h, kvh, d = heads
    seq_lens = [1, 16, 45, 200]
    batch = Batch([1] * 4, seq_lens, 4, h, kvh, d, 16, dtype, device, 7)
    q, k, v, rotary, positions, slots = _rope_inputs(batch, h, kvh, d, dtype, device, 7)
    cache = batch.kv_cache.clone()
    q_rot, _ = rotary_and_cache_write(positions, q, k, v, rotary.cos_sin_cache, cache, slots)
    batch.q, batch.kv_cache = q_rot, cache  # what the separate launch left
    want = batch.run(num_kv_splits)
    _check(batch, want, dtype)

    fresh = Batch([1] * 4, seq_lens, 4, h, kvh, d, 16, dtype, device, 7)  # same cache
    got = paged_attention(q, fresh.kv_cache, fresh.block_tables, fresh.query_start_loc,
                          fresh.seq_lens_t, fresh.scale, num_decodes=4, max_query_len=1,
                          max_seq_len=max(seq_lens), num_kv_splits=num_kv_splits,
                          rope=DecodeRope(rotary.cos_sin_cache, k, v, slots))
    torch.testing.assert_close(got, want, **TOL[dtype])
    _same_cache(fresh.kv_cache, cache, slots, dtype)


@pytest.mark.parametrize("heads,num_kv_splits", [((8, 2, 64), 16), ((6, 2, 48), 3)],
                         ids=["GQA4-16splits", "GQA3-D48-3splits"])
def test_decode_rope_in_attention_splits(device, heads, num_kv_splits):
    """The rotary inside a split launch whose group and head dim need padding (a group of
    3 padded to 4 heads, head_dim 48 padded to 64, empty splits): the separate rotary
    launch's result."""
    from kvflow.kernels.paged_attention import DecodeRope
    from kvflow.kernels.rotary_kv import rotary_and_cache_write

    h, kvh, d = heads
    seq_lens = [1, 16, 45, 200]
    batch = Batch([1] * 4, seq_lens, 4, h, kvh, d, 16, torch.float32, device, 8)
    q, k, v, rotary, positions, slots = _rope_inputs(batch, h, kvh, d, torch.float32,
                                                     device, 8)
    cache = batch.kv_cache.clone()
    q_rot, _ = rotary_and_cache_write(positions, q, k, v, rotary.cos_sin_cache, cache, slots)
    batch.q, batch.kv_cache = q_rot, cache
    want = batch.ref()
    fresh = Batch([1] * 4, seq_lens, 4, h, kvh, d, 16, torch.float32, device, 8)
    got = paged_attention(q, fresh.kv_cache, fresh.block_tables, fresh.query_start_loc,
                          fresh.seq_lens_t, fresh.scale, num_decodes=4, max_query_len=1,
                          max_seq_len=max(seq_lens), num_kv_splits=num_kv_splits,
                          rope=DecodeRope(rotary.cos_sin_cache, k, v, slots))
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    _same_cache(fresh.kv_cache, cache, slots, torch.float32)


def _same_cache(got: torch.Tensor, want: torch.Tensor, slots: torch.Tensor, dtype) -> None:
    """The caches agree: exactly outside the written slots (NaN poison included), and at
    them within the dtype's rounding (the two kernels may contract the rotation's
    multiply-adds differently on the GPU: one float32 ulp before the final rounding)."""
    flat_got = got.flatten(1, 2)  # [2, NB * BS, KVH, D]
    flat_want = want.flatten(1, 2)
    written = torch.zeros(flat_got.shape[1], dtype=torch.bool, device=got.device)
    written[slots[slots >= 0]] = True
    assert torch.equal(flat_got[:, ~written].nan_to_num(123.0),
                       flat_want[:, ~written].nan_to_num(123.0))
    torch.testing.assert_close(flat_got[:, written], flat_want[:, written], **TOL[dtype])


def test_decode_rope_in_attention_padding(device):
    """CUDA-graph padding rows (q_len 0, no slot) are neither attended nor cached, and
    rows past query_start_loc[R] of ``out`` stay untouched."""
    from kvflow.kernels.paged_attention import DecodeRope
    from kvflow.kernels.rotary_kv import rotary_and_cache_write

    batch = Batch([1, 1, 0, 0], [40, 90, 0, 0], 2, 8, 2, 64, 16, torch.float16, device, 2)
    q, k, v, rotary, positions, slots = _rope_inputs(batch, 8, 2, 64, torch.float16, device,
                                                     2, pad=3)
    cache = batch.kv_cache.clone()
    q_rot, _ = rotary_and_cache_write(positions, q, k, v, rotary.cos_sin_cache, cache, slots)
    out = torch.full((5, 8, 64), 7.0, dtype=torch.float16, device=device)
    for splits in (1, 4):
        res = paged_attention(q, batch.kv_cache, batch.block_tables, batch.query_start_loc,
                              batch.seq_lens_t, batch.scale, num_decodes=4, max_query_len=1,
                              max_seq_len=90, num_kv_splits=splits, out=out,
                              rope=DecodeRope(rotary.cos_sin_cache, k, v, slots))
        assert res is out and bool((out[2:] == 7.0).all())
        _same_cache(batch.kv_cache, cache, slots, torch.float16)
        batch.q, batch.kv_cache = q_rot[:2], cache.clone()
        _check(batch, out[:2], torch.float16)


def test_decode_rope_in_attention_refuses_prefills(device):
    from kvflow.kernels.paged_attention import DecodeRope

    q_lens, seq_lens = _mixed_lens(1)
    batch = Batch(q_lens, seq_lens, 3, 8, 2, 64, 16, torch.float16, device, 1)
    t = batch.q.shape[0]
    k = torch.zeros(t, 2, 64, dtype=torch.float16, device=device)
    rope = DecodeRope(torch.zeros(8, 64, device=device), k, k,
                      torch.zeros(t, dtype=torch.long, device=device))
    with pytest.raises(AssertionError, match="decode-only"):
        batch.run(2, rope=rope)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_triton_backend_rope_switch(device, monkeypatch, mode):
    """The Triton backend takes the in-attention rotary for decode-only steps when
    ``KVFLOW_ROPE_IN_ATTN`` says so (and keeps the rotary launch for mixed steps); either
    way the output and the cache are those of the separate rotary launch."""
    from kvflow import envs
    from kvflow.errors import InvalidParameterError
    from kvflow.kernels import paged_attention as pa
    from kvflow.kernels.rotary_kv import rotary_and_cache_write
    from kvflow.layers.attention import triton_backend as tb
    from kvflow.layers.attention.metadata import AttentionMetadata

    monkeypatch.setenv("KVFLOW_ROPE_IN_ATTN", mode)
    tb.rope_in_attention.cache_clear()
    calls = []
    monkeypatch.setattr(tb, "paged_attention",
                        lambda *a, **kw: calls.append(kw.get("rope")) or pa.paged_attention(
                            *a, **kw))
    try:
        seq_lens = [30, 77]
        batch = Batch([1, 1], seq_lens, 2, 8, 2, 64, 16, torch.bfloat16, device, 4)
        q, k, v, rotary, positions, slots = _rope_inputs(batch, 8, 2, 64, torch.bfloat16,
                                                         device, 4)
        meta = AttentionMetadata(
            num_actual_tokens=2, num_reqs=2, num_decodes=2, max_query_len=1,
            max_seq_len=max(seq_lens), slot_mapping=slots,
            query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens_t,
            block_tables=batch.block_tables, query_start_loc_cpu=batch.qsl,
            seq_lens_cpu=seq_lens, backend=tb.TritonAttentionMetadata(num_kv_splits=4))
        cache = batch.kv_cache.clone()
        out = tb.TritonAttentionBackend().forward(positions, q, k, v, cache, rotary,
                                                  batch.scale, meta)
        assert (calls[0] is not None) == (mode == "on")
        want_cache = batch.kv_cache.clone()
        q_rot, _ = rotary_and_cache_write(positions, q, k, v, rotary.cos_sin_cache,
                                          want_cache, slots)
        batch.q, batch.kv_cache = q_rot, want_cache
        _check(batch, out, torch.bfloat16)
        _same_cache(cache, want_cache, slots, torch.bfloat16)
    finally:
        tb.rope_in_attention.cache_clear()
    monkeypatch.setenv("KVFLOW_ROPE_IN_ATTN", "sometimes")
    with pytest.raises(InvalidParameterError, match="KVFLOW_ROPE_IN_ATTN"):
        envs.rope_in_attention()

