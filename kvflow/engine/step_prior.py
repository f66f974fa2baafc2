"""The prior of the latency target's step-time model (``--target-tpot-ms``): what a step
should cost before any step was measured.

On a GPU the capacity planner's cost model (``kvflow.plan``) gives it, evaluated for the
GPU kvflow runs on (the H200 figures when its name matches no preset). On CPU there is no
roofline to speak of: rough host rates (memory read for the weights, sustained matmul
rate) give the right order, and the online fit takes over within a few steps.
"""

from __future__ import annotations

from kvflow.config import EngineConfig
from kvflow.core.latency import StepTimePrior

# Rough sustained host rates of a small machine (the fit corrects them quickly).
CPU_READ_BYTES_PER_S = 20e9
CPU_FLOPS_PER_S = 1e11


def step_time_prior(config: EngineConfig, gpu_name: str | None = None) -> StepTimePrior:
    m = config.model
    arch = m.arch
    if config.device.is_cuda:
        return _planner_prior(config, gpu_name)
    from kvflow.config import DTYPE_BYTES

    params = arch.num_params
    fixed = params * DTYPE_BYTES[m.dtype] / CPU_READ_BYTES_PER_S
    per_token = 2.0 * (params - arch.vocab_size * arch.hidden_size) / CPU_FLOPS_PER_S
    per_seq = 2.0 * arch.vocab_size * arch.hidden_size / CPU_FLOPS_PER_S  # logits row
    return StepTimePrior(fixed, per_token, per_seq, "host rates (CPU)")


def _planner_prior(config: EngineConfig, gpu_name: str | None) -> StepTimePrior:
    from kvflow.plan.efficiency import Efficiency
    from kvflow.plan.gpus import GPU_PRESETS, get_gpu
    from kvflow.plan.model import ShardedModel, step_cost

    key = next((k for k in GPU_PRESETS if gpu_name and k.split("-")[0] in
                gpu_name.lower()), "h200")
    gpu, eff = get_gpu(key), Efficiency()
    dtype = config.model.dtype
    sm = ShardedModel(config.model.arch, tp=1, dtype=dtype, kv_dtype=dtype)
    ctx = 512.0  # a typical context; attention's share is small next to the weights

    def decode(n: int) -> float:
        return step_cost(sm, gpu, eff, decode_seqs=n, decode_context=ctx).predicted_s

    def prefill(n: int) -> float:
        return step_cost(sm, gpu, eff, prefill=((n, 0),), cuda_graph=False).predicted_s

    per_token = max(0.0, (prefill(2048) - prefill(1024)) / 1024)
    per_seq = max(0.0, (decode(65) - decode(1)) / 64 - per_token)
    fixed = max(0.0, decode(1) - per_token - per_seq)
    return StepTimePrior(fixed, per_token, per_seq, f"capacity planner ({key})")
