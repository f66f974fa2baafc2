"""What a CPU decode step is built from (``step.py``'s C++ step, ``compiled.py``'s
inductor step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvflow.config import EngineConfig
from kvflow.layers.attention import AttentionMetadataBuilder, AttentionSpec


@dataclass(frozen=True)
class StepParts:
    """What a CPU decode step is built from, as the CUDA graph runner is: the model, its
    metadata builder, its KV caches and the few settings the step reads (the model
    runner's, or a draft model's own)."""

    model: nn.Module
    attn_builder: AttentionMetadataBuilder
    """The eager metadata builder. The step wraps it (``step.attn_builder``, which the
    owner installs once the step is up) and its self-check plans the eager reference
    with it."""
    kv_caches: torch.Tensor
    """The model's KV caches, [L, 2, NB, BS, KVH, D]."""
    kv_scales: torch.Tensor | None
    """An int8 cache's per-token scales, [L, 2, NB, BS, KVH]; None otherwise."""
    attn_spec: AttentionSpec
    """The block size (the C++ step takes each layer's rotary table from the layer; the
    compiled step plans with this one)."""
    config: EngineConfig
    """The engine's configuration: --enforce-eager, the decoder layer count and batch
    bound of the compiled step, and the settings a recorded self-check is keyed on."""
    lora: object | None = None
    """With --enable-lora, the LoRA worker (kvflow/lora/worker.py): the C++ step reads
    its slots (``slots.targets``) and per-step map (``slots.step``) and adds the deltas
    itself, telling it so (``in_cpu_step``)."""
