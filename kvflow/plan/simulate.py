"""An offline run (``kvflow bench throughput``: N equal requests, all at once), step by
step: the scheduler's one rule (running requests first, then waiting ones, within the
token budget and ``max_num_seqs``) with each step priced by ``step_cost``.

Simplifications: a request is admitted only when the cache holds its full length (the
engine allocates as it goes and may preempt instead); decode-only steps replay CUDA
graphs, steps with prefill run eagerly; host work per request is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.plan.efficiency import Efficiency
from kvflow.plan.gpus import GpuSpec
from kvflow.plan.memory import MemoryPlan
from kvflow.plan.model import ShardedModel, step_cost
from kvflow.utils import cdiv


@dataclass(frozen=True)
class OfflineEstimate:
    """A simulated offline run."""

    num_prompts: int
    input_len: int
    output_len: int
    steps: int
    """Engine steps; 0 when not one request fits in the KV cache."""
    elapsed_s: float
    """Predicted wall time of the run."""

    def _rate(self, count: float) -> float:
        return count / self.elapsed_s if self.steps else 0.0

    @property
    def requests_per_s(self) -> float:
        return self._rate(self.num_prompts)

    @property
    def output_tokens_per_s(self) -> float:
        return self._rate(self.num_prompts * self.output_len)

    @property
    def total_tokens_per_s(self) -> float:
        return self._rate(self.num_prompts * (self.input_len + self.output_len))


def simulate_offline(m: ShardedModel, gpu: GpuSpec, eff: Efficiency, mem: MemoryPlan, *,
                     num_prompts: int, input_len: int, output_len: int,
                     max_num_batched_tokens: int, max_num_seqs: int) -> OfflineEstimate:
    blocks_each = cdiv(input_len + output_len, mem.block_size)
    max_running = min(max_num_seqs, mem.num_blocks // blocks_each)
    if max_running < 1:
        return OfflineEstimate(num_prompts, input_len, output_len, 0, 0.0)
    waiting = num_prompts
    running: list[list[int]] = []  # [prompt tokens computed, tokens generated]
    elapsed, steps = 0.0, 0
    while waiting or running:
        budget = max_num_batched_tokens
        decodes, context, chunks = 0, 0, []
        for req in running:
            if budget == 0:
                break
            if req[0] < input_len:
                chunk = min(input_len - req[0], budget)
                chunks.append((chunk, req[0]))
                req[0] += chunk
                budget -= chunk
                if req[0] == input_len:
                    req[1] += 1  # the prompt's last step samples the first token
            else:
                decodes += 1
                context += input_len + req[1]
                req[1] += 1
                budget -= 1
        while waiting and budget and len(running) < max_running:
            chunk = min(input_len, budget)
            chunks.append((chunk, 0))
            running.append([chunk, 1 if chunk == input_len else 0])
            waiting -= 1
            budget -= chunk
        cost = step_cost(m, gpu, eff, decode_seqs=decodes,
                         decode_context=context / decodes if decodes else 0.0,
                         prefill=tuple(chunks), cuda_graph=decodes <= max_num_seqs)
        elapsed += cost.predicted_s
        steps += 1
        running = [r for r in running if r[1] < output_len]
    return OfflineEstimate(num_prompts, input_len, output_len, steps, elapsed)
