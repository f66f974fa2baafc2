"""Device memory of the LoRA slots, as ``kvflow.lora.layers.LoRAWeights`` allocates it
(for ``kvflow plan``; the engine's own memory profile sees the slots directly)."""

from __future__ import annotations

from kvflow.config import ModelArchConfig


def lora_slot_bytes(arch: ModelArchConfig, tp: int, max_loras: int, max_rank: int,
                    dtype_bytes: int) -> int:
    """Bytes of ``max_loras`` slots of rank ``max_rank`` on one of ``tp`` GPUs."""
    if max_loras <= 0:
        return 0
    h, d = arch.hidden_size, arch.head_dim
    q = arch.num_attention_heads // tp * d
    kv = max(1, arch.num_key_value_heads // tp) * d
    i = arch.intermediate_size // tp
    per_layer = (3 * h + q + 2 * kv  # qkv: A [3R, H], B [q | k | v, R]
                 + q + h  # o: A [R, q/tp], B [H, R]
                 + 2 * h + 2 * i  # gate_up: A [2R, H], B [2 x I/tp, R]
                 + i + h)  # down: A [R, I/tp], B [H, R]
    return per_layer * max_rank * max_loras * arch.num_hidden_layers * dtype_bytes
