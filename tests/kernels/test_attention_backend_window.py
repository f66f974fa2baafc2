"""The torch and Triton attention backends with a layer's own window, soft cap and rotary
table (what Gemma 2/3, Mistral v0.1 and Phi-3 layers pass), through their metadata
builders, on one mixed step: decodes of several lengths, a fresh prompt, a chunk in the
middle of a sequence. Against the reference: the layer's rotary, the cache write, then
``paged_attention_ref`` with the window and cap.

Block-table entries wholly before each request's window point at a NaN block (the
torch backend's point at it through -1, the last block): a backend that reads one fails.
For the Triton backend the slots past each context are NaN as well.
The Triton backend runs in the interpreter on CPU.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.layers.attention import get_attention_backend
from kvflow.layers.attention.metadata import AttentionMetadata, AttentionSpec
from kvflow.layers.attention.torch_backend import paged_attention_ref, window_start
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary_ref
from kvflow.utils import cdiv

H, KVH, D, BS = 4, 2, 32, 8


def _step(q_lens, seq_lens, num_decodes, window, device, seed=0, poison_tails=True):
    """q, k, v (unrotated), a cache whose pre-window entries are poisoned, and the meta.
    ``poison_tails``: slots past each context are NaN too (the torch backend reads whole
    blocks and masks, so there they must be finite, as stale cache values are)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [cdiv(s, BS) for s in seq_lens]
    num_blocks = sum(nblk) + 1
    poison = num_blocks - 1
    cache = torch.randn(2, num_blocks, BS, KVH, D, generator=g)
    cache[:, poison] = float("nan")
    perm = torch.randperm(num_blocks - 1, generator=g).tolist()
    tables = torch.full((len(seq_lens), max(nblk) + 1), poison, dtype=torch.int32)
    slots, positions = [], []
    for i, (n, s) in enumerate(zip(q_lens, seq_lens)):
        ids = [perm.pop() for _ in range(nblk[i])]
        tables[i, : nblk[i]] = torch.tensor(ids, dtype=torch.int32)
        if s % BS and poison_tails:
            cache[:, ids[-1], s % BS:] = float("nan")  # past the context
        if window is not None:
            tables[i, : window_start(s, n, window) // BS] = poison  # "freed"
        for p in range(s - n, s):
            positions.append(p)
            slots.append(int(tables[i, p // BS]) * BS + p % BS)
    t = sum(q_lens)
    q = torch.randn(t, H, D, generator=g)
    k, v = torch.randn(t, KVH, D, generator=g), torch.randn(t, KVH, D, generator=g)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        num_actual_tokens=t, num_reqs=len(seq_lens), num_decodes=num_decodes,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens))
    return (q.to(device), k.to(device), v.to(device), cache.to(device), meta,
            torch.tensor(positions, device=device))


def _reference(q, k, v, cache, meta, positions, rotary, scale, window, softcap):
    cos, sin = rotary.cos_sin(positions)
    q, k = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
    cache = cache.clone()
    flat = cache.view(2, -1, KVH, D)
    flat[0, meta.slot_mapping], flat[1, meta.slot_mapping] = k, v
    return paged_attention_ref(q, cache, meta.block_tables, meta.query_start_loc_cpu,
                               meta.seq_lens_cpu, scale, window=window, softcap=softcap)


# decodes of contexts 3, 30, 41, 57, 64 (one group of 4, then one), a 19-token prompt,
# a 12-token chunk after 40 cached tokens
Q_LENS = [1, 1, 1, 1, 1, 19, 12]
SEQ_LENS = [3, 57, 30, 64, 41, 19, 52]


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
@pytest.mark.parametrize("window,softcap,own", [(10, 3.0, True), (16, None, False),
                                                (None, 3.0, False), (100, None, True)])
def test_backend_window_softcap_own_rotary(device, monkeypatch, backend_name, window,
                                           softcap, own):
    from kvflow.layers.attention import torch_backend

    spec_rotary = RotaryEmbedding(D, 256, 10000.0, None).to(device)
    layer_rotary = RotaryEmbedding(D, 256, 500.0, None).to(device) if own else spec_rotary
    q, k, v, cache, meta, positions = _step(Q_LENS, SEQ_LENS, 5, window, device,
                                            poison_tails=backend_name == "triton")
    scale = 0.3
    want = _reference(q, k, v, cache, meta, positions, layer_rotary, scale, window, softcap)
    assert not want.isnan().any()
    backend = get_attention_backend(backend_name)
    spec = AttentionSpec(block_size=BS, num_kv_heads=KVH, dtype=torch.float32,
                         device=device, rotary=spec_rotary)
    kernels = [False]
    if backend_name == "torch":
        cache[:, -1] = float("nan")  # -1 entries (torch's last block) are the NaN block
        meta.block_tables[meta.block_tables == cache.shape[1] - 1] = -1
        kernels = [False, True]  # with and without the C++ decode kernel's plan
    for kernel in kernels:
        if kernel:
            monkeypatch.setattr(torch_backend, "use_cpu_decode_kernel", lambda spec: True)
        builder = backend.metadata_builder(spec)
        builder.build(meta, positions)
        kv = cache.clone()
        extra = {k_: v_ for k_, v_ in (("window", window), ("softcap", softcap)) if v_}
        got = backend.forward(positions, q, k, v, kv, layer_rotary, scale, meta, **extra)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
