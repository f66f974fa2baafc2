"""GPU memory profiling: how many bytes the KV cache may take.

A forward pass at the largest step shape (``max_num_batched_tokens`` tokens of prefill,
then sampling ``max_num_seqs`` rows with every filter on) measures peak activation
memory. The KV cache gets ``gpu_memory_utilization * total - weights - peak activations
- memory outside torch - a CUDA graph reserve``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from kvflow.config import EngineConfig, GiB
from kvflow.core.sched_output import NewRequestData, SchedulerOutput
from kvflow.errors import OutOfMemoryError
from kvflow.logger import init_logger
from kvflow.sampling_params import SamplingParams
from kvflow.utils import cdiv
from kvflow.worker import kv_cache

logger = init_logger(__name__)

# Memory the decode CUDA graphs' private pool may take (logged after capture).
CUDA_GRAPH_RESERVE = GiB // 2


@torch.inference_mode()
def profile_prompt_lengths(cfg: EngineConfig) -> list[int]:
    """The prompt lengths of the profiling step: the largest step the scheduler can
    build, ``max_num_batched_tokens`` split into prompts shorter than ``max_model_len``,
    but no more prompts than ``max_num_seqs`` (the persistent batch's rows): with
    ``--max-num-seqs 1`` the step is one prompt of at most ``max_model_len - 1``."""
    max_len = cfg.model.max_model_len
    tokens = min(cfg.scheduler.max_num_batched_tokens,
                 cfg.scheduler.max_num_seqs * (max_len - 1))
    return [min(max_len - 1, tokens - i) for i in range(0, tokens, max_len - 1)]


def profile_kv_budget(cfg: EngineConfig, model: nn.Module, device: torch.device,
                      execute_model: Callable[[SchedulerOutput], object]) -> int:
    """Bytes the KV cache may take, measured with one largest-shape step run by
    ``execute_model`` on ``model`` (weights already loaded on ``device``)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    weights = torch.cuda.memory_allocated(device)

    lengths = profile_prompt_lengths(cfg)
    tokens = sum(lengths)
    bs = cfg.cache.block_size
    num_blocks = sum(cdiv(n, bs) for n in lengths)
    scratch = kv_cache.allocate_kv_cache(cfg, num_blocks, device)
    scratch_scales = kv_cache.allocate_kv_scales(cfg, num_blocks, device)
    scratch_bytes = num_blocks * kv_cache.block_bytes(cfg)
    kv_cache.bind_kv_cache(model, scratch, scratch_scales, kv_cache.kv_quant_kind(cfg))

    # A throw-away step through the real input path: prefill chunks of random tokens.
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01,
                            max_tokens=1)
    new_reqs, next_block = [], 0
    for i, n in enumerate(lengths):
        nb = cdiv(n, bs)
        new_reqs.append(NewRequestData(
            req_id=f"profile-{i}", token_ids=rng.integers(0, cfg.model.arch.vocab_size,
                                                          n).tolist(),
            num_prompt_tokens=n, sampling_params=params,
            block_ids=list(range(next_block, next_block + nb)), num_computed_tokens=0))
        next_block += nb
    so = SchedulerOutput(new_reqs=new_reqs, cached_reqs=[],
                         num_scheduled_tokens={r.req_id: len(r.token_ids) for r in new_reqs},
                         total_num_scheduled_tokens=sum(lengths))
    try:
        execute_model(so)
        # Sampling at full width: logits and filters for max_num_seqs rows.
        rows = cfg.scheduler.max_num_seqs
        logits = torch.randn(rows, cfg.model.arch.vocab_size, device=device)
        from kvflow.layers.sampler import Sampler, SamplingMetadata

        meta = SamplingMetadata(
            temperature=torch.ones(rows, device=device), all_greedy=False, all_random=True,
            top_k=torch.full((rows,), 50, device=device),
            top_p=torch.full((rows,), 0.9, device=device),
            min_p=torch.full((rows,), 0.01, device=device), generators={},
            max_num_logprobs=20)
        Sampler()(logits, meta)
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError as e:
        raise OutOfMemoryError(
            f"the profiling step ({tokens} tokens) ran out of GPU memory; lower "
            f"--max-num-batched-tokens or --max-num-seqs: {e}") from None
    finally:
        execute_model(SchedulerOutput(
            new_reqs=[], cached_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
            finished_req_ids={r.req_id for r in new_reqs}))
    peak = torch.cuda.max_memory_allocated(device)
    activations = peak - weights - scratch_bytes
    del scratch, scratch_scales
    kv_cache.bind_kv_cache(model, [None] * kv_cache.local_num_layers(cfg))
    torch.cuda.empty_cache()
    # CUDA context, cuBLAS workspaces, other processes: used memory torch did not reserve.
    non_torch = max(0, (total - free_before) - torch.cuda.memory_reserved(device))
    reserve = 0 if cfg.device.enforce_eager else CUDA_GRAPH_RESERVE
    budget = int(total * cfg.cache.gpu_memory_utilization) - weights - activations \
        - non_torch - reserve
    logger.info("GPU memory: total %.2f GiB x utilization %.2f = %.2f GiB; weights %.2f GiB, "
                "peak activations %.2f GiB (%d-token step), outside torch %.2f GiB, CUDA graph "
                "reserve %.2f GiB -> KV cache %.2f GiB", total / GiB,
                cfg.cache.gpu_memory_utilization, total * cfg.cache.gpu_memory_utilization / GiB,
                weights / GiB, activations / GiB, tokens, non_torch / GiB, reserve / GiB,
                budget / GiB)
    if budget <= 0:
        raise OutOfMemoryError(
            f"no GPU memory is left for the KV cache (weights {weights / GiB:.2f} GiB, "
            f"activations {activations / GiB:.2f} GiB); raise --gpu-memory-utilization, "
            "lower --max-num-batched-tokens, or use a smaller model")
    return budget
