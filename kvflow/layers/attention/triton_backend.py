"""Triton attention backend (GPU): fused rotary + KV cache write, then one paged
flash-attention call for the whole mixed batch (decodes, optionally split-KV, then
prefill chunks)."""

from __future__ import annotations

import torch

from kvflow.kernels.paged_attention import paged_attention
from kvflow.kernels.rotary_kv import rotary_and_cache_write
from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.layers.rotary import RotaryEmbedding


class TritonAttentionBackend:
    name = "triton"

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_cache: torch.Tensor, rotary: RotaryEmbedding,
                scale: float, meta: AttentionMetadata) -> torch.Tensor:
        q, _ = rotary_and_cache_write(positions, q, k, v, rotary.cos_sin_cache, kv_cache,
                                      meta.slot_mapping)
        return paged_attention(
            q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
            num_decodes=meta.num_decodes, max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len, num_kv_splits=meta.num_kv_splits)
