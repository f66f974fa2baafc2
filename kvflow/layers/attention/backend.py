"""The attention backend interface: write this step's K/V into the paged cache, then
attend over each request's whole context through its block table."""

from __future__ import annotations

from typing import Protocol

import torch

from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.layers.rotary import RotaryEmbedding


class AttentionBackend(Protocol):
    name: str

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_cache: torch.Tensor, rotary: RotaryEmbedding,
                scale: float, meta: AttentionMetadata) -> torch.Tensor:
        """Apply rotary to q and k, store k and v at ``meta.slot_mapping`` in
        ``kv_cache`` [2, num_blocks, block_size, KVH, D], and return attention output.

        q [T, H, D], k and v [T, KVH, D] -> [T, H, D].
        """
        ...


def get_attention_backend(name: str) -> AttentionBackend:
    """'torch' (reference, any device) or 'triton' (GPU kernels)."""
    if name == "torch":
        from kvflow.layers.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from kvflow.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}")
