"""How many KV tokens fit: the engine's own memory budget, predicted.

The engine (``kvflow/worker/profiler.py``) gives the KV cache
``gpu_memory_utilization * total - weights - peak activations - memory outside torch -
CUDA graph reserve``, where "weights" is everything allocated before profiling (the
parameters, the rotary cos/sin table, the device block table) and the peak activations
are the larger of a ``max_num_batched_tokens`` forward pass and sampling
``max_num_seqs`` rows. The cache is then cut into blocks of ``block_size`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.config import GiB
from kvflow.plan.efficiency import Efficiency
from kvflow.plan.model import ShardedModel
from kvflow.utils import cdiv

# Same value as kvflow.worker.profiler.CUDA_GRAPH_RESERVE (a test keeps them equal; that
# module imports torch, which the planner does not need).
CUDA_GRAPH_RESERVE = GiB // 2


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU's memory, as the engine would divide it."""

    total_bytes: int
    usable_bytes: int
    """total * gpu_memory_utilization."""
    weight_bytes: int
    """Parameters on this GPU."""
    buffer_bytes: int
    """Rotary cos/sin table and device block table (allocated with the weights)."""
    forward_activation_bytes: int
    """Peak of a max_num_batched_tokens forward pass."""
    sampler_bytes: int
    """Peak of sampling max_num_seqs rows."""
    non_torch_bytes: int
    graph_reserve_bytes: int
    kv_budget_bytes: int
    """What is left for the KV cache (negative: the model does not fit)."""
    block_size: int
    block_bytes: int
    num_blocks: int
    lora_bytes: int = 0
    """LoRA adapter slots (``--max-loras`` x ``--max-lora-rank``)."""

    @property
    def activation_bytes(self) -> int:
        return max(self.forward_activation_bytes, self.sampler_bytes)

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_sequences(self, length: int) -> int:
        """Sequences of ``length`` tokens the cache holds at once (whole blocks each)."""
        return self.num_blocks // cdiv(length, self.block_size)


def plan_memory(m: ShardedModel, eff: Efficiency, *, total_bytes: int,
                gpu_memory_utilization: float, max_model_len: int,
                max_num_batched_tokens: int, max_num_seqs: int, block_size: int = 16,
                cuda_graphs: bool = True, lora_bytes: int = 0) -> MemoryPlan:
    a = m.arch
    rotary = max(max_model_len, a.max_position_embeddings) * a.head_dim * 4  # float32
    block_table = max_num_seqs * cdiv(max_model_len, block_size) * 4  # int32
    per_tok_a, per_tok_b = eff.activation_bytes_per_token
    forward = max_num_batched_tokens * (per_tok_a * a.hidden_size
                                        + per_tok_b * m.intermediate) * m.dtype_bytes
    sampler = int(eff.sampler_row_copies * max_num_seqs * a.vocab_size * 4)
    usable = int(total_bytes * gpu_memory_utilization)
    reserve = CUDA_GRAPH_RESERVE if cuda_graphs else 0
    budget = (usable - m.weight_bytes - rotary - block_table - max(forward, sampler)
              - eff.non_torch_bytes - reserve - lora_bytes)
    block_bytes = block_size * m.kv_bytes_per_token
    return MemoryPlan(
        total_bytes=total_bytes, usable_bytes=usable, weight_bytes=m.weight_bytes,
        buffer_bytes=rotary + block_table, forward_activation_bytes=forward,
        sampler_bytes=sampler, non_torch_bytes=eff.non_torch_bytes,
        graph_reserve_bytes=reserve, kv_budget_bytes=budget, block_size=block_size,
        block_bytes=block_bytes, num_blocks=max(0, budget // block_bytes),
        lora_bytes=lora_bytes)
