"""Paged attention: one layer type, pluggable backends (torch reference, Triton)."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.layers.attention.backend import (AttentionBackend, AttentionMetadataBuilder,
                                            get_attention_backend)
from kvflow.layers.attention.kv_quant import KVQuant
from kvflow.layers.attention.metadata import AttentionMetadata, AttentionSpec
from kvflow.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Rotary + KV cache write + paged attention for one layer.

    ``kv_cache`` is bound by the model runner once the cache is allocated.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int,
                 rotary: RotaryEmbedding, backend: AttentionBackend, *,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 scale: float | None = None, own_rotary: bool = False) -> None:
        """``sliding_window``: keys a query sees, itself included (None: all);
        ``logits_soft_cap``: scores become cap * tanh(score / cap); ``own_rotary``: this
        layer's table is not the one the step's plan was built from (the backends rotate
        with the table they are given: ``rotary``). All three go to the backend, per
        layer (Python constants: the Triton kernels take them as constexprs)."""
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.own_rotary = own_rotary
        self.rotary = rotary
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None
        # Set with a quantized cache (--kv-cache-dtype int8/fp8); fp8's per-tensor
        # k_scale/v_scale come from the checkpoint when it has them (else 1.0).
        self.kv_quant: KVQuant | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H*D], k and v [T, KVH*D] -> [T, H*D]."""
        t = q.shape[0]
        extra = {}  # only where set: a backend without windows still serves the rest
        if self.sliding_window is not None:
            extra["window"] = self.sliding_window
        if self.logits_soft_cap is not None:
            extra["softcap"] = self.logits_soft_cap
        out = self.backend.forward(
            positions, q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            self.kv_cache, self.rotary, self.scale, meta, kv_quant=self.kv_quant, **extra)
        return out.reshape(t, self.num_heads * self.head_dim)


def model_rotary(model: nn.Module) -> RotaryEmbedding:
    """The one rotary table a model's attention layers share (metadata builders plan a
    step's cos/sin rows from it); layers with ``own_rotary`` rotate by themselves."""
    tables = {id(m.rotary): m.rotary for m in model.modules()
              if isinstance(m, Attention) and not m.own_rotary}
    if len(tables) != 1:
        raise ValueError(f"expected one rotary table shared by every attention layer, "
                         f"found {len(tables)}")
    return next(iter(tables.values()))


def eager_reason(model: nn.Module) -> str | None:
    """Why ``model``'s decodes cannot take the opt-in compiled (inductor) CPU decode
    step (``kvflow/cpu/step.py``; the C++ step has its own check, ``cpu/stack.py``):
    some layer is windowed, soft-capped or rotates with its own table, which that step
    does not plan. None: none is. (The attention backends,
    torch and Triton, take all three per layer: CUDA graphs stay on for such models.)"""
    for m in model.modules():
        if isinstance(m, Attention):
            if m.sliding_window is not None:
                return "sliding-window attention"
            if m.logits_soft_cap is not None:
                return "soft-capped attention scores"
            if m.own_rotary:
                return "a layer with its own rotary table"
    return None


__all__ = ["Attention", "AttentionBackend", "KVQuant", "AttentionMetadata", "AttentionMetadataBuilder",
           "AttentionSpec", "eager_reason", "get_attention_backend", "model_rotary"]
