"""Build a model on its device and fill its weights: HF safetensors, GGUF, or dummy."""

from __future__ import annotations

import dataclasses

import glob
import json
import os
from collections.abc import Iterator

import torch

from kvflow.config import ModelConfig, torch_dtype
from kvflow.distributed.parallel_state import GroupCoordinator
from kvflow.errors import InvalidParameterError, ModelLoadError
from kvflow.layers.attention import AttentionBackend
from kvflow.layers.quantization import QuantizationConfig, layout_cache, resolve_quantization
from kvflow.logger import init_logger
from kvflow.models.registry import model_class

logger = init_logger(__name__)

def iter_hf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of a Hugging Face directory: sharded or single safetensors, else .bin."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from None
        files = [os.path.join(path, f) for f in files]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors import safe_open

        for file in files:
            if not os.path.isfile(file):
                raise ModelLoadError(f"weight file {file} listed in the index is missing")
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except ModelLoadError:
                raise
            except Exception as e:  # SafetensorError and friends on damaged files
                raise ModelLoadError(f"{file} is not a readable safetensors file (truncated "
                                     f"or corrupt?): {e}") from None
        return
    bins = sorted(glob.glob(os.path.join(path, "*.bin")))
    if not bins:
        raise ModelLoadError(f"{path} has no *.safetensors or *.bin weight files")
    for file in bins:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ModelLoadError(f"{file} is not a readable PyTorch checkpoint: {e}") from None
        yield from state.items()


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights with realistic scale: N(0, 0.02) matrices, norms near 1."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.9, 1.1, generator=gen)
        else:  # matrices and biases alike
            p.normal_(0.0, 0.02, generator=gen)


def quantization_config(config: ModelConfig, device: torch.device
                        ) -> QuantizationConfig | None:
    """The model's one QuantizationConfig: from --quantization, the GGUF file, or the
    checkpoint's config.json."""
    hf_quant = None
    if config.load_format == "hf" and config.path:
        cfg_path = os.path.join(config.path, "config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                hf_quant = json.load(f).get("quantization_config")
    return resolve_quantization(config.quantization, config.load_format, hf_quant,
                                torch.device(device).type, config.dtype_forced,
                                config.quantization_group_size,
                                config.quantization_symmetric,
                                config.llm_int8_threshold, config.lm_head_quantization)


def load_model(config: ModelConfig, device: torch.device, backend: AttentionBackend,
               tp: GroupCoordinator | None = None,
               pp: GroupCoordinator | None = None,
               expert_parallel: bool = False) -> torch.nn.Module:
    """Construct the model directly on ``device`` and load its weights (this rank's
    shard of them when ``tp`` spans several ranks, its stage's layers with ``pp``;
    ``expert_parallel``: a mixture of experts' experts whole, split over ``tp``)."""
    dtype = torch_dtype(config.dtype)
    quant = quantization_config(config, device)
    max_position = max(config.max_model_len, config.arch.max_position_embeddings)
    # longrope and dynamic NTK pick their frequencies by the longest sequence run
    arch = dataclasses.replace(config.arch, rope_context_len=config.max_model_len)
    cls = model_class(arch.architecture)
    extra = {}
    if expert_parallel:
        if not getattr(cls, "supports_expert_parallel", False):
            raise InvalidParameterError(
                f"enable_expert_parallel: {arch.architecture} has no experts",
                param="enable_expert_parallel")
        extra["expert_parallel"] = True
    with torch.device(device):
        model = cls(arch, dtype, backend, max_position, quant=quant, tp=tp, pp=pp, **extra)
    one_rank = (tp is None or tp.world_size == 1) and (pp is None or pp.world_size == 1)
    if config.load_format == "dummy" and one_rank:
        init_dummy_weights(model, config.seed)
    elif config.load_format == "dummy":
        from kvflow.models.sharded_dummy import load_sharded_dummy_weights

        load_sharded_dummy_weights(model, config, device)
    elif config.load_format == "gguf":
        from kvflow.models.gguf_file import iter_gguf_weights

        keep = quant is not None and quant.method == "gguf"
        model.load_weights(iter_gguf_weights(config.path, config.arch, keep_quantized=keep))
    else:
        kv_scales: dict[str, float] = {}
        model.load_weights(_take_kv_scales(iter_hf_weights(config.path), kv_scales))
        _set_kv_scales(model, kv_scales)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    layout_cache.log_summary("weights")
    if torch.device(device).type == "cuda":
        from kvflow.kernels.gemv_dispatch import describe

        logger.info("%s", describe(model))
    model.quant_config = quant
    logger.info("weights: %s, %.1f MiB", _describe(model, quant), weight_bytes(model) / 2**20)
    return model.eval()


# Per-tensor KV cache scales of FP8 checkpoints (compressed-tensors kv_cache_scheme,
# or the older k_proj/v_proj output_scale names), read by --kv-cache-dtype fp8.
_KV_SCALE_SUFFIXES = {".k_scale": "k_scale", ".v_scale": "v_scale",
                      ".k_proj.output_scale": "k_scale", ".v_proj.output_scale": "v_scale"}


def _take_kv_scales(weights: Iterator[tuple[str, torch.Tensor]], out: dict[str, float]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors without its KV cache scales, which go to ``out`` as
    ``{"model.layers.3.self_attn:k_scale": 0.02}``."""
    for name, tensor in weights:
        suffix = next((s for s in _KV_SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        if tensor.numel() != 1:
            raise ModelLoadError(f"{name} has shape {tuple(tensor.shape)}; a KV cache scale "
                                 f"must be one number (per-tensor)")
        out[f"{name[: -len(suffix)]}:{_KV_SCALE_SUFFIXES[suffix]}"] = float(tensor)


def _set_kv_scales(model: torch.nn.Module, scales: dict[str, float]) -> None:
    """Give each attention layer its checkpoint k_scale / v_scale (fp8 KV cache)."""
    if not scales:
        return
    from kvflow.layers.attention import Attention

    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        parent = name.rsplit(".", 1)[0]  # model.layers.3.self_attn(.attn)
        for key in ("k_scale", "v_scale"):
            value = scales.get(f"{parent}:{key}")
            if value is not None:
                if not value > 0:
                    raise ModelLoadError(f"{parent}.{key} = {value}: KV cache scales must "
                                         f"be positive")
                setattr(module, key, value)
    logger.info("KV cache scales from the checkpoint for %d tensors (used by "
                "--kv-cache-dtype fp8)", len(scales))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter, packed ones included (shared ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _describe(model: torch.nn.Module, quant: QuantizationConfig | None) -> str:
    if quant is None:
        return "dense"
    if quant.method == "gguf":
        from kvflow.layers.quantization.gguf import type_summary

        return f"{quant.describe()}: {type_summary(model)}"
    return quant.describe()
