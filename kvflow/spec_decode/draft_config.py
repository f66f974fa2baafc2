"""Resolving the draft model of ``method: draft_model`` at startup (torch-free: EngineArgs
calls it beside the target's resolution, so a bad draft fails before anything loads)."""

from __future__ import annotations

import dataclasses

from kvflow.config import MAX_SPECULATIVE_TOKENS, ModelConfig, SpeculativeConfig
from kvflow.errors import InvalidParameterError, ModelLoadError, ModelNotFoundError
from kvflow.models.registry import resolve_model


def resolve_draft_model(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft's ModelConfig: ``spec.model`` (or the target itself when only
    ``draft_num_layers`` is given), cut to ``draft_num_layers`` layers. Errors name the
    option; the vocabulary check is EngineConfig's."""
    if spec.model is None:
        name, path, load_format, arch = target.model, target.path, target.load_format, \
            target.arch
    else:
        try:
            resolved = resolve_model(spec.model, spec.draft_load_format)
        except (ModelNotFoundError, ModelLoadError) as e:
            raise type(e)(f"speculative_config.model: {e}",
                          param="speculative_config.model") from None
        name, path, load_format, arch = spec.model, resolved.path, resolved.load_format, \
            resolved.arch
    if spec.draft_num_layers is not None:
        if spec.draft_num_layers > arch.num_hidden_layers:
            raise InvalidParameterError(
                f"speculative_config.draft_num_layers is {spec.draft_num_layers} but the "
                f"draft {name!r} has only {arch.num_hidden_layers} layers",
                param="speculative_config.draft_num_layers")
        arch = dataclasses.replace(arch, num_hidden_layers=spec.draft_num_layers)
    return ModelConfig(
        model=name, path=path, load_format=load_format, arch=arch, dtype=target.dtype,
        # The draft runs up to k - 1 positions past the target's last known token.
        max_model_len=target.max_model_len + MAX_SPECULATIVE_TOKENS,
        served_model_name=f"{name} (draft)",
        # Dummy weights: the target's own seed when the draft is the target itself.
        seed=target.seed if spec.model is None else target.seed + 1,
        # Exact-weights runs (quantization none) keep the draft dense too; otherwise the
        # draft takes its own format's default (a GGUF draft stays 4-bit on CPU).
        quantization=spec.draft_quantization or (
            "none" if target.quantization == "none" else "auto"),
        dtype_forced=target.dtype_forced)
