"""The one quantization decision of a model, resolved once at load (pure Python, no torch).

Where it comes from, in order: ``--quantization METHOD`` (int8, int4, none); a GGUF file's
tensor types (``gguf``: the blocks are kept and multiplied as they are); a Hugging Face
``config.json`` ``quantization_config`` (not supported yet: refused with the methods that
are). Layers ask it for their method by module prefix (``method_for``), so lm_head,
embeddings or listed layers can stay unquantized without the model knowing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.errors import ModelLoadError, require

# Methods a user may name with --quantization ("auto" picks from the checkpoint).
USER_METHODS = ("auto", "none", "int8", "int4", "gguf")


@dataclass(frozen=True)
class QuantizationConfig:
    """How a model's weights are stored and multiplied."""

    method: str
    """int8 (per output channel, symmetric), int4 (group-wise round-to-nearest) or gguf
    (the GGUF file's own blocks, repacked once at load)."""
    group_size: int = 32
    """int4: input elements sharing one scale (and zero point): 32, 64 or 128."""
    symmetric: bool = False
    """int4: zero point fixed at the middle of the range (scale only) instead of per group."""
    lm_head: str = "int8"
    """How an int8/int4 model stores its lm_head: int8 (per output channel; the logits GEMM
    is a fifth of the small models' weights) or none (model dtype)."""
    skip_modules: tuple[str, ...] = ()
    """Module prefixes kept in the model dtype (e.g. ``model.layers.0.mlp``)."""

    def __post_init__(self) -> None:
        require(self.method in ("int8", "int4", "gguf"), "quantization",
                f"must be int8, int4 or gguf, got {self.method!r}")
        require(self.group_size in (32, 64, 128), "quantization_group_size",
                f"must be 32, 64 or 128, got {self.group_size}")
        require(self.lm_head in ("int8", "none"), "lm_head", "must be int8 or none")

    def is_skipped(self, prefix: str) -> bool:
        return any(prefix == p or prefix.startswith(p + ".") for p in self.skip_modules)

    def method_for(self, prefix: str) -> str:
        """The method of the linear layer (or embedding) named ``prefix``: none, int8,
        int4 or gguf."""
        if self.is_skipped(prefix):
            return "none"
        if self.method == "gguf":
            return "gguf"
        if prefix == "lm_head":
            return self.lm_head
        if prefix.endswith("embed_tokens"):
            return "none"  # a lookup reads a few rows; quantizing it only saves memory
        return self.method

    def describe(self) -> str:
        if self.method == "int4":
            kind = "symmetric" if self.symmetric else "asymmetric"
            return f"int4 (group {self.group_size}, {kind}, lm_head {self.lm_head})"
        if self.method == "int8":
            return f"int8 (per channel, lm_head {self.lm_head})"
        return "gguf (blocks kept quantized)"


def resolve_quantization(requested: str, load_format: str, hf_quant_config: dict | None,
                         device: str, dtype_forced: bool, group_size: int = 32,
                         symmetric: bool = False) -> QuantizationConfig | None:
    """The model's QuantizationConfig from what the user asked and what the checkpoint is;
    None means dense weights in the model dtype."""
    require(requested in USER_METHODS, "quantization",
            f"must be one of {', '.join(USER_METHODS)}, got {requested!r}")
    if hf_quant_config:
        method = hf_quant_config.get("quant_method", "?")
        raise ModelLoadError(
            f"the checkpoint is pre-quantized with {method!r} (config.json "
            f"quantization_config); kvflow does not load pre-quantized Hugging Face "
            f"checkpoints yet (supported: GGUF files, and int8/int4 quantized at load from "
            f"a float checkpoint with --quantization int8|int4)")
    on_cpu = device == "cpu"
    if requested == "none":
        return None
    if requested == "auto":
        # GGUF runs on its own blocks on CPU unless a dtype was asked for (which means the
        # dense path in that dtype); the GPU has no GGUF kernels yet.
        if load_format == "gguf" and on_cpu and not dtype_forced:
            return QuantizationConfig("gguf")
        return None
    if not on_cpu:
        raise ModelLoadError(f"--quantization {requested} runs on CPU only for now (its GPU "
                             f"kernels are not written yet); use --quantization none on "
                             f"{device}")
    if requested == "gguf" and load_format != "gguf":
        raise ModelLoadError("--quantization gguf needs a GGUF file")
    if load_format == "dummy" and requested == "gguf":
        raise ModelLoadError("--quantization gguf needs real GGUF weights, not dummy ones")
    return QuantizationConfig(requested, group_size=group_size, symmetric=symmetric)
