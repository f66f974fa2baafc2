"""Low-bit weights: one ``QuantizationConfig`` per model, a method per layer prefix.

``linear_method`` and ``embedding_method`` are the registry the layers call; the model
files pass a config and module prefixes and never branch on the method (DESIGN rule 6).
"""

from __future__ import annotations

from kvflow.layers.quantization.config import QuantizationConfig, resolve_quantization

__all__ = ["QuantizationConfig", "resolve_quantization", "linear_method",
           "embedding_method", "make_embedding", "make_lm_head"]


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


def make_embedding(vocab_size: int, hidden_size: int, dtype, tp, config, prefix: str):
    """The token embedding: vocabulary-parallel (dense, or stored as its method says when
    split over several ranks), or on one rank the embedding whose storage its method
    picks."""
    if config is None or (tp is not None and tp.world_size > 1):
        from kvflow.layers.vocab_parallel import VocabParallelEmbedding

        return VocabParallelEmbedding(vocab_size, hidden_size, dtype, tp, config, prefix)
    from kvflow.layers.embedding import VocabEmbedding

    return VocabEmbedding(vocab_size, hidden_size, dtype, config, prefix)


def make_lm_head(vocab_size: int, hidden_size: int, dtype, tied_to, tp, config):
    """The lm_head, tied to ``tied_to`` when given; quantized as the config says, and
    vocabulary-parallel over several ranks."""
    if config is None or (tp is not None and tp.world_size > 1):
        from kvflow.layers.vocab_parallel import ParallelLMHead

        return ParallelLMHead(vocab_size, hidden_size, dtype, tied_to=tied_to, tp=tp,
                              quant_config=config)
    from kvflow.layers.embedding import LMHead

    return LMHead(vocab_size, hidden_size, dtype, tied_to=tied_to, quant_config=config)
