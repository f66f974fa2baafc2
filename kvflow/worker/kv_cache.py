"""KV cache tensors: how many blocks fit, allocation, and binding to attention layers.

(A CPU engine's budget and its zero-filled host mappings are the CPU wing's:
``cpu/memory.py``.)"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.config import DTYPE_BYTES, GiB, EngineConfig, torch_dtype
from kvflow.core.kv_cache_manager import freeable_window
from kvflow.core.scheduler import peak_kv
from kvflow.cpu.memory import zeroed_host_tensor
from kvflow.errors import InvalidParameterError, OutOfMemoryError
from kvflow.layers.attention import Attention, KVQuant
from kvflow.layers.attention.kv_quant import check_fp8_device, storage_dtype
from kvflow.logger import init_logger
from kvflow.utils import cdiv

logger = init_logger(__name__)

INT8_SCALE_BYTES = 4  # an int8 cache's float32 scale per token, KV head, K and V


def local_kv_heads(config: EngineConfig) -> int:
    """KV heads of one tensor-parallel rank's cache."""
    return config.parallel.kv_heads_per_rank(config.model.arch.num_key_value_heads)


def local_num_layers(config: EngineConfig) -> int:
    """Layers of one pipeline stage's cache (the stage the config is for)."""
    start, end = config.parallel.stage_layers(config.model.arch.num_hidden_layers)
    return end - start


def kv_quant_kind(config: EngineConfig) -> str | None:
    """'int8' or 'fp8' for a quantized cache (--kv-cache-dtype), None for the model dtype."""
    kind = config.cache.cache_dtype
    return None if kind == "auto" else kind


def kv_storage_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype the cache's values are stored in."""
    kind = kv_quant_kind(config)
    return torch_dtype(config.model.dtype) if kind is None else storage_dtype(kind)


def kv_bytes_per_token(config: EngineConfig) -> int:
    """Bytes one token takes in this rank's cache: K and V values of its layers and KV
    heads, plus int8's float32 scale per token, head, K and V."""
    kind = kv_quant_kind(config)
    elem = DTYPE_BYTES[config.model.dtype] if kind is None else 1
    per_head = config.model.arch.head_dim * elem + (INT8_SCALE_BYTES if kind == "int8" else 0)
    return 2 * local_num_layers(config) * local_kv_heads(config) * per_head


def block_bytes(config: EngineConfig) -> int:
    """Bytes of one KV block across this rank's layers (K and V) and KV heads, plus the
    same block of a draft model's cache (speculative decoding keeps one per target
    block, so the budget pays for both)."""
    target = config.cache.block_size * kv_bytes_per_token(config)
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
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Swap space: [num_blocks, L, 2, block_size, KVH, D], one contiguous block per row
    so each block moves in a single copy (pinned when the device is a GPU); with an
    int8 cache also its scales [num_blocks, L, 2, block_size, KVH] (else None)."""
    arch = config.model.arch
    shape = (num_blocks, local_num_layers(config), 2, config.cache.block_size,
             local_kv_heads(config), arch.head_dim)
    pin = device.type == "cuda"
    try:
        scales = (torch.empty(shape[:-1], dtype=torch.float32, pin_memory=pin)
                  if kv_quant_kind(config) == "int8" else None)
        return torch.empty(shape, dtype=kv_storage_dtype(config), pin_memory=pin), scales
    except (RuntimeError, OSError) as e:
        raise OutOfMemoryError(f"cannot allocate {num_blocks} blocks of swap space "
                               f"(--swap-space): {e}") from None


def check_capacity(config: EngineConfig, num_blocks: int) -> None:
    """The cache must hold at least one sequence of max_model_len tokens (of a model whose
    every layer is windowed: its window and one step's tokens, ``peak_kv``)."""
    bs = config.cache.block_size
    need = peak_kv(config.model.max_model_len, config.model.max_model_len, bs,
                   freeable_window(config), config.scheduler.max_prompt_chunk)[1]
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
    dtype = kv_storage_dtype(config)
    if kv_quant_kind(config) == "fp8":
        check_fp8_device(device)
    return _zeroed(shape, dtype, device, f"the KV cache ({num_blocks} blocks)")


def allocate_kv_scales(config: EngineConfig, num_blocks: int,
                       device: torch.device) -> torch.Tensor | None:
    """An int8 cache's scales [L, 2, num_blocks, block_size, KVH] float32, block for block
    beside the cache (so copy-on-write and swap move them the same way); else None."""
    if kv_quant_kind(config) != "int8":
        return None
    shape = (local_num_layers(config), 2, num_blocks, config.cache.block_size,
             local_kv_heads(config))
    return _zeroed(shape, torch.float32, device, f"the KV cache scales ({num_blocks} blocks)")


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            what: str) -> torch.Tensor:
    try:
        if device.type == "cpu":
            return zeroed_host_tensor(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)
    except (RuntimeError, torch.OutOfMemoryError, OSError) as e:
        raise OutOfMemoryError(f"cannot allocate {what}: {e}") from None


def bind_kv_cache(model: nn.Module, kv_caches, kv_scales: torch.Tensor | None = None,
                  kind: str | None = None) -> None:
    """Give attention layer i its cache ``kv_caches[i]`` (a tensor's first dim works);
    a quantized cache (``kind`` int8/fp8) also gets its KVQuant: int8 its scales
    ``kv_scales[i]``, fp8 the layer's checkpoint k_scale/v_scale."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(kv_caches):
        raise InvalidParameterError("KV cache and model disagree on the number of layers")
    for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
        layer.kv_cache = cache
        layer.kv_quant = None if kind is None or cache is None else KVQuant(
            kind, None if kv_scales is None else kv_scales[i],
            float(layer.k_scale), float(layer.v_scale))


def log_kv_cache(config: EngineConfig, num_blocks: int) -> None:
    bs = config.cache.block_size
    tokens = num_blocks * bs
    # The target's own cache: a draft model's share of block_bytes is logged by the draft.
    gib = num_blocks * bs * kv_bytes_per_token(config) / GiB
    concurrency = tokens / config.model.max_model_len
    kind = kv_quant_kind(config)
    dtype = config.model.dtype if kind is None else {
        "int8": "int8 + float32 scale per token and head", "fp8": "fp8 e4m3"}[kind]
    logger.info("KV cache: %s, %d blocks x %d tokens = %d tokens, %.2f GiB (%d bytes per "
                "token); maximum concurrency at max_model_len=%d: %.2fx", dtype, num_blocks,
                bs, tokens, gib, kv_bytes_per_token(config),
                config.model.max_model_len, concurrency)
