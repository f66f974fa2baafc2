"""Triton attention backend (GPU): fused rotary + KV cache write, then one paged
flash-attention call for the whole mixed batch (decodes, optionally split-KV, then
prefill chunks). A decode-only step can instead hand the rotary and the cache write to
the decode attention launch itself (``KVFLOW_ROPE_IN_ATTN``), one launch fewer per
layer.

``--deterministic`` (``AttentionSpec.deterministic``, docs/determinism.md): decode rows
split their context into fixed ranges of ``deterministic_split_tokens`` keys whatever
the batch, merged in order, and the rotary stays in its own launch on every step (a
decode row then takes the same path in a decode-only step as beside prefill chunks)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvflow.kernels.paged_attention import DecodeRope, choose_num_kv_splits, paged_attention
from kvflow.kernels.rotary_kv import rotary_and_cache_write
from kvflow.layers.attention.kv_quant import KVQuant
from kvflow.layers.attention.metadata import AttentionMetadata, AttentionSpec
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.utils import cdiv

# --deterministic: keys per decode split, at least this many, and at most this many
# splits at max_model_len (the partials' workspace is sized by the split count)
DET_MIN_SPLIT_TOKENS = 512
DET_MAX_SPLITS = 64


def deterministic_split_tokens(max_model_len: int) -> int:
    """Keys per split-KV range in --deterministic mode: 512, or the power of two that
    keeps max_model_len within 64 splits; fixed for the engine, whatever the batch."""
    want = cdiv(max(1, max_model_len), DET_MAX_SPLITS)
    return max(DET_MIN_SPLIT_TOKENS, 1 << (want - 1).bit_length())


@dataclass
class TritonAttentionMetadata:
    num_kv_splits: int  # split-KV (flash-decoding) partitions of the decode launch
    split_tokens: int = 0  # > 0: fixed keys per split (--deterministic)


class TritonMetadataBuilder:
    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    def build(self, meta: AttentionMetadata, positions: torch.Tensor, *,
              split_context: int | None = None) -> AttentionMetadata:
        if self.spec.deterministic:
            # The grid covers max_model_len: one split count for eager steps and every
            # captured graph; a request's splits past its context exit at once.
            tokens = deterministic_split_tokens(self.spec.max_model_len)
            meta.backend = TritonAttentionMetadata(
                num_kv_splits=cdiv(self.spec.max_model_len, tokens), split_tokens=tokens)
            return meta
        context = meta.max_seq_len if split_context is None else split_context
        splits = 1
        if meta.num_decodes:
            splits = choose_num_kv_splits(meta.num_decodes, context, self.spec.num_kv_heads,
                                          self.spec.num_sms)
        meta.backend = TritonAttentionMetadata(num_kv_splits=splits)
        return meta


class TritonAttentionBackend:
    name = "triton"

    def metadata_builder(self, spec: AttentionSpec) -> TritonMetadataBuilder:
        return TritonMetadataBuilder(spec)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_cache: torch.Tensor, rotary: RotaryEmbedding,
                scale: float, meta: AttentionMetadata, *,
                kv_quant: KVQuant | None = None, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        # window and softcap are the layer's constants (constexprs of the launches, so
        # a captured CUDA graph holds each layer's own); rotary is the layer's table
        split_tokens = meta.backend.split_tokens
        if (meta.num_decodes and not meta.num_prefills and meta.tree is None
                and kv_quant is None and not split_tokens and rope_in_attention(q.device)):
            # decode-only step: the attention launch rotates and caches the new K/V
            return paged_attention(
                q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                num_decodes=meta.num_decodes, max_query_len=meta.max_query_len,
                max_seq_len=meta.max_seq_len, num_kv_splits=meta.backend.num_kv_splits,
                rope=DecodeRope(rotary.cos_sin_cache, k, v, meta.slot_mapping),
                window=window, softcap=softcap)
        q, _ = rotary_and_cache_write(positions, q, k, v, rotary.cos_sin_cache, kv_cache,
                                      meta.slot_mapping, kv_quant=kv_quant)
        return paged_attention(
            q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
            num_decodes=meta.num_decodes, max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len, num_kv_splits=meta.backend.num_kv_splits,
            kv_quant=kv_quant, tree=meta.tree, split_tokens=split_tokens, window=window,
            softcap=softcap)


@functools.lru_cache(maxsize=8)
def rope_in_attention(device: torch.device) -> bool:
    """``KVFLOW_ROPE_IN_ATTN`` (``kvflow.envs.rope_in_attention``; ``auto``: the GPU's
    measured default in ``kvflow/kernels/decode_defaults.py``, off elsewhere), read once
    per process and device."""
    from kvflow import envs
    from kvflow.kernels.decode_defaults import switch_on

    return switch_on(envs.rope_in_attention(), "rope_in_attn", device)
