"""Attention for layers the fused backends do not cover: a sliding window (Mistral v0.1,
Gemma's local layers, Phi-3), soft-capped scores (Gemma 2) or a rotary table of the
layer's own (Gemma 3's local layers rotate with a different base than the step's plan).

Backend-independent and plain torch (the cache layout is the same for every backend):
rotary from the layer's table, the paged cache write, then per request attention over
only the blocks its window reaches, in float32. Used on CPU and GPU alike; the C++ CPU
step and CUDA graphs stay off for models with such layers
(``kvflow.layers.attention.eager_reason``).

A window of W means a query at position p sees keys p - W + 1 .. p (W keys, itself
included), as transformers' sliding_window_overlay does.
"""

from __future__ import annotations

import torch

from kvflow.layers.attention.kv_quant import KVQuant
from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary, rotary_tables
from kvflow.utils import cdiv


def window_start(seq_len: int, num_queries: int, window: int | None) -> int:
    """The first sequence position any of a request's last ``num_queries`` queries sees
    (0 without a window): blocks before it are never read."""
    if window is None:
        return 0
    return max(0, seq_len - num_queries - window + 1)


def windowed_attention(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, kv_cache: torch.Tensor, rotary: RotaryEmbedding,
                       scale: float, meta: AttentionMetadata, window: int | None,
                       softcap: float | None, kv_quant: KVQuant | None) -> torch.Tensor:
    """q [T, H, D], k and v [T, KVH, D] -> [T, H, D]; kv_cache [2, NB, BS, KVH, D]."""
    from kvflow.layers.attention.torch_backend import (TorchAttentionBackend, _read,
                                                       kv_write_index, write_kv_ref)

    if meta.tree is not None:
        raise RuntimeError("candidate trees (Medusa) are not supported on windowed or "
                           "soft-capped attention layers")
    rot = rotary_tables(*rotary.cos_sin(positions))
    q, k = apply_rotary(q, rot), apply_rotary(k, rot)
    if kv_quant is None:
        write_kv_ref(k, v, kv_cache, meta.slot_mapping)
    else:
        TorchAttentionBackend._write_quant(k, v, kv_cache, kv_quant, meta.slot_mapping,
                                           kv_write_index(meta.slot_mapping))
    bs = kv_cache.shape[2]
    h, kvh, d = q.shape[1], kv_cache.shape[3], q.shape[2]
    out = torch.zeros_like(q)
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for i in range(meta.num_reqs):
        s, e, seq_len = qsl[i], qsl[i + 1], lens[i]
        n = e - s
        if n == 0:
            continue
        first = window_start(seq_len, n, window) // bs  # first block the window reaches
        last = cdiv(seq_len, bs)
        blocks = meta.block_tables[i, first:last].to(torch.int64)
        offset = first * bs
        length = seq_len - offset
        ki, vi = _read(kv_cache, ("gather", blocks, length), kv_quant, q.dtype)  # [L, KVH, D]
        qi = q[s:e].float().view(n, kvh, h // kvh, d)
        scores = torch.einsum("nkgd,lkd->kgnl", qi, ki.float()) * scale  # [KVH, G, n, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(offset, seq_len, device=q.device)[None, :]
        hidden = k_pos > q_pos  # [n, L]
        if window is not None:
            hidden |= k_pos <= q_pos - window
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        o = torch.einsum("kgnl,lkd->nkgd", probs, vi.float())
        out[s:e] = o.reshape(n, h, d).to(q.dtype)
    return out

