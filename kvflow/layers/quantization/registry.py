"""Which method a layer of a quantized model gets: ``linear_method`` and
``embedding_method``, asked through the model's ``QuantizationConfig`` by module prefix.

Each method's module loads when a layer first asks for it (an unquantized model loads
none), so importing this registry, or the config that calls it, loads no torch. Nothing
here imports the config: it is passed in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.layers.quantization.config import QuantizationConfig


def linear_method(config: QuantizationConfig | None, prefix: str, tied_to=None):
    """The LinearMethod of the layer named ``prefix`` (``tied_to``: the embedding a tied
    lm_head shares)."""
    from kvflow.layers.linear import UnquantizedLinearMethod

    kind = "none" if config is None else config.method_for(prefix)
    if kind == "none":
        return UnquantizedLinearMethod()
    if kind == "gguf":
        from kvflow.layers.quantization.gguf import GGUFLinearMethod

        # A tied head reads its embedding's blocks, unless the embedding itself is dense.
        return GGUFLinearMethod(tied_to)
    if kind in ("gptq", "awq", "compressed-tensors"):
        from kvflow.layers.quantization.prequant import PrequantizedLinearMethod

        return PrequantizedLinearMethod(kind, config.bits, config.group_size,
                                        config.zero_offset, config.symmetric)
    if kind == "fp8" and config.weight_block:
        from kvflow.layers.quantization.fp8_block import (Fp8BlockCheckpointLinearMethod,
                                                          Fp8BlockLinearMethod)

        if config.prequantized:
            return Fp8BlockCheckpointLinearMethod(config.weight_block, config.scale_name)
        return Fp8BlockLinearMethod(config.weight_block)
    if kind == "fp8":
        from kvflow.layers.quantization.fp8 import Fp8CheckpointLinearMethod, Fp8LinearMethod

        return Fp8CheckpointLinearMethod(config.static_input_scale) if config.prequantized \
            else Fp8LinearMethod()
    if kind == "w8a8-int8":
        from kvflow.layers.quantization.smoothquant import (Int8W8A8CheckpointLinearMethod,
                                                            Int8W8A8LinearMethod)

        if config.prequantized:
            name = prefix.rsplit(".", 1)[-1]
            return Int8W8A8CheckpointLinearMethod(name in config.smooth_inputs)
        return Int8W8A8LinearMethod()
    if kind == "llm-int8":
        from kvflow.layers.quantization.llm_int8 import LlmInt8LinearMethod

        return LlmInt8LinearMethod(config.llm_int8_threshold)
    from kvflow.layers.quantization.rtn import Int4LinearMethod, Int8LinearMethod

    if kind == "int8":
        return Int8LinearMethod()
    return Int4LinearMethod(config.group_size, config.symmetric)


def embedding_method(config: QuantizationConfig | None, prefix: str):
    """The embedding method of the table named ``prefix``."""
    kind = "none" if config is None else config.method_for(prefix)
    if kind == "gguf":
        from kvflow.layers.quantization.gguf import GGUFEmbeddingMethod

        return GGUFEmbeddingMethod()
    from kvflow.layers.embedding import UnquantizedEmbeddingMethod

    return UnquantizedEmbeddingMethod()
