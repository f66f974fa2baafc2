"""The attention backend interface: each step, a metadata builder derives what the
backend needs from the step's AttentionMetadata (once, before the layers run); then every
layer writes its K/V into the paged cache and attends over each request's whole context
through its block table."""

from __future__ import annotations

from typing import Protocol

import torch

from kvflow.layers.attention.kv_quant import KVQuant
from kvflow.layers.attention.metadata import AttentionMetadata, AttentionSpec
from kvflow.layers.rotary import RotaryEmbedding


class AttentionMetadataBuilder(Protocol):
    def build(self, meta: AttentionMetadata, positions: torch.Tensor, *,
              split_context: int | None = None) -> AttentionMetadata:
        """Set ``meta.backend`` for this step and return ``meta``.

        positions [T] are the step's token positions. ``split_context`` replaces the
        step's longest context where a backend sizes work by it (a CUDA graph is captured
        once for every context length it will replay).
        """
        ...


class AttentionBackend(Protocol):
    name: str

    def metadata_builder(self, spec: AttentionSpec) -> AttentionMetadataBuilder:
        """The per-step metadata builder for this backend on ``spec``'s cache."""
        ...

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_cache: torch.Tensor, rotary: RotaryEmbedding,
                scale: float, meta: AttentionMetadata, *,
                kv_quant: KVQuant | None = None, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """Apply rotary to q and k, store k and v at ``meta.slot_mapping`` in
        ``kv_cache`` [2, num_blocks, block_size, KVH, D], and return attention output.
        With ``kv_quant`` the cache is int8/fp8: values are quantized as they are stored
        and dequantized as attention reads them (``kv_quant.py``).

        Per layer: ``rotary`` is the layer's table (it may differ from the spec's, e.g.
        Gemma 3's local layers); ``window`` W: a query at position p sees keys
        p - W + 1 .. p, and block-table entries of blocks wholly before every query's
        window are never read (the cache manager may have freed them); ``softcap``:
        scores (after the scale) become softcap * tanh(score / softcap), before masking.

        q [T, H, D], k and v [T, KVH, D] -> [T, H, D]. ``meta.backend`` was built by
        this backend's metadata builder.
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
