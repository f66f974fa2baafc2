"""KV cache tensors: how many blocks fit, allocation, and binding to attention layers."""

from __future__ import annotations

import math
import mmap

import torch
from torch import nn

from kvflow.config import GiB, EngineConfig, torch_dtype
from kvflow.errors import InvalidParameterError, OutOfMemoryError
from kvflow.layers.attention import Attention
from kvflow.logger import init_logger
from kvflow.utils import cdiv

logger = init_logger(__name__)

CPU_DEFAULT_KV_BYTES = 4 * GiB


def local_kv_heads(config: EngineConfig) -> int:
    """KV heads of one tensor-parallel rank's cache."""
    return config.parallel.kv_heads_per_rank(config.model.arch.num_key_value_heads)


def local_num_layers(config: EngineConfig) -> int:
    """Layers of one pipeline stage's cache (the stage the config is for)."""
    start, end = config.parallel.stage_layers(config.model.arch.num_hidden_layers)
    return end - start


def block_bytes(config: EngineConfig) -> int:
    """Bytes of one KV block across this rank's layers (K and V) and KV heads, plus the
    same block of a draft model's cache (speculative decoding keeps one per target
    block, so the budget pays for both)."""
    arch = config.model.arch
    target = (config.cache.block_size * arch.kv_bytes_per_token(config.model.dtype)
              * local_kv_heads(config) * local_num_layers(config)
              // (arch.num_key_value_heads * arch.num_hidden_layers))
    draft = config.draft_model
    if draft is not None:
        target += config.cache.block_size * draft.arch.kv_bytes_per_token(draft.dtype)
    return target


def num_blocks_for_budget(config: EngineConfig, budget_bytes: int) -> int:
    return max(0, int(budget_bytes) // block_bytes(config))


def num_host_blocks(config: EngineConfig) -> int:
    """Blocks of the host swap pool (0 unless preemption may swap)."""
    if config.cache.preemption_mode == "recompute":
        return 0
    return num_blocks_for_budget(config, config.cache.swap_space)


def allocate_host_cache(config: EngineConfig, num_blocks: int,
                        device: torch.device) -> torch.Tensor:
    """Swap space: [num_blocks, L, 2, block_size, KVH, D], one contiguous block per row
    so each block moves in a single copy (pinned when the device is a GPU)."""
    arch = config.model.arch
    shape = (num_blocks, local_num_layers(config), 2, config.cache.block_size,
             local_kv_heads(config), arch.head_dim)
    try:
        return torch.empty(shape, dtype=torch_dtype(config.model.dtype),
                           pin_memory=device.type == "cuda")
    except (RuntimeError, OSError) as e:
        raise OutOfMemoryError(f"cannot allocate {num_blocks} blocks of swap space "
                               f"(--swap-space): {e}") from None


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor in its own anonymous mapping: no memset at startup and no
    resident memory until used, and zero whatever allocator the process runs with."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)  # the tensor keeps a reference to the mapping
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def available_host_memory() -> int | None:
    """Bytes of memory the OS can still give without swapping (Linux MemAvailable), or
    None where that is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_kv_budget(requested: int | None) -> int:
    """The CPU KV cache budget: ``requested`` (--kv-cache-memory) if the machine has that
    much memory available, else an error; by default 4 GiB, or half of what is available
    when that is less (the cache is committed as it fills, and an over-committed cache
    would get the process killed mid-run instead of refused at start)."""
    available = available_host_memory()
    if requested is None:
        if available is not None and available // 2 < CPU_DEFAULT_KV_BYTES:
            logger.warning("only %.2f GiB of memory available: the KV cache gets half of it "
                           "(set --kv-cache-memory to choose)", available / GiB)
            return available // 2
        return CPU_DEFAULT_KV_BYTES
    if available is not None and requested > available:
        raise OutOfMemoryError(
            f"--kv-cache-memory asks for {requested / GiB:.2f} GiB but only "
            f"{available / GiB:.2f} GiB of memory is available; lower --kv-cache-memory")
    return requested


def check_capacity(config: EngineConfig, num_blocks: int) -> None:
    """The cache must hold at least one sequence of max_model_len tokens."""
    bs = config.cache.block_size
    need = cdiv(config.model.max_model_len, bs)
    if num_blocks < need:
        per_token = block_bytes(config) // bs
        raise OutOfMemoryError(
            f"the KV cache holds {num_blocks * bs} tokens ({num_blocks} blocks) but one "
            f"sequence of max_model_len={config.model.max_model_len} tokens needs {need} "
            f"blocks ({need * bs * per_token / GiB:.2f} GiB); lower --max-model-len or give "
            f"the cache more memory (--kv-cache-memory on CPU, --gpu-memory-utilization on GPU)")


def allocate_kv_cache(config: EngineConfig, num_blocks: int,
                      device: torch.device) -> torch.Tensor:
    """The whole cache as one tensor [L, 2, num_blocks, block_size, KVH, D]; layer i's
    cache is ``caches[i]`` (one tensor lets a single kernel copy blocks in all layers)."""
    arch = config.model.arch
    shape = (local_num_layers(config), 2, num_blocks, config.cache.block_size,
             local_kv_heads(config), arch.head_dim)
    # Zeroed: attention reads whole blocks and masks the unwritten slots, and a masked
    # NaN still poisons the output (0 * NaN). On the CPU the cache is an anonymous
    # mapping, which the OS hands out zero-filled and commits page by page as it is
    # written; torch.empty could return recycled heap memory holding NaN bit patterns.
    dtype = torch_dtype(config.model.dtype)
    try:
        if device.type == "cpu":
            return zeroed_host_tensor(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)
    except (RuntimeError, torch.OutOfMemoryError, OSError) as e:
        raise OutOfMemoryError(f"cannot allocate the KV cache ({num_blocks} blocks): {e}") \
            from None


def bind_kv_cache(model: nn.Module, kv_caches) -> None:
    """Give attention layer i its cache ``kv_caches[i]`` (a tensor's first dim works)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(kv_caches):
        raise InvalidParameterError("KV cache and model disagree on the number of layers")
    for layer, cache in zip(layers, kv_caches):
        layer.kv_cache = cache


def log_kv_cache(config: EngineConfig, num_blocks: int) -> None:
    bs = config.cache.block_size
    tokens = num_blocks * bs
    gib = num_blocks * block_bytes(config) / GiB
    concurrency = tokens / config.model.max_model_len
    logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB; maximum concurrency "
                "at max_model_len=%d: %.2fx", num_blocks, bs, tokens, gib,
                config.model.max_model_len, concurrency)
