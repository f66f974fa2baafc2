"""The one quantization decision of a model, resolved once at load (pure Python, no torch).

Where it comes from, in order: ``--quantization METHOD`` (int8, int4, fp8, w8a8-int8,
llm-int8, none); a GGUF file's tensor types (``gguf``: the blocks are kept and multiplied
as they are); a Hugging Face ``config.json`` ``quantization_config`` (gptq, awq,
compressed-tensors, fp8, kvflow's smoothquant; anything else is refused with the methods
that are supported). Layers ask it for their method by module prefix (``method_for``), so lm_head,
embeddings or listed layers can stay unquantized without the model knowing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvflow.errors import ModelLoadError, require
from kvflow.layers.quantization import registry

# Pre-quantized checkpoint formats (config.json quant_method).
PREQUANTIZED = ("gptq", "awq", "compressed-tensors")
# config.json quant_method of FP8 checkpoints (compressed-tensors float-quantized is
# recognized by its format).
FP8_CHECKPOINT = "fp8"
# config.json quant_method of the int8 W8A8 checkpoints `kvflow quantize --method
# smoothquant` writes (docs/quantization.md defines the layout).
SMOOTHQUANT_CHECKPOINT = "smoothquant"

# Methods a user may name with --quantization ("auto" picks from the checkpoint).
USER_METHODS = ("auto", "none", "int8", "int4", "gguf", "fp8", "fp8-block", "w8a8-int8",
                "llm-int8")


@dataclass(frozen=True)
class QuantizationConfig:
    """How a model's weights are stored and multiplied."""

    method: str
    """int8 (per output channel, symmetric), int4 (group-wise round-to-nearest), gguf
    (the GGUF file's own blocks, repacked once at load), or a pre-quantized checkpoint's
    gptq / awq."""
    group_size: int = 32
    """Input elements sharing one scale (and zero point). int4: 32, 64 or 128; gptq/awq:
    the checkpoint's (a multiple of 32, or -1 for one group per row)."""
    bits: int = 4
    """gptq / awq: bits per weight of the checkpoint."""
    zero_offset: int = 0
    """gptq: added to stored zero points (1 for the common v1 format, which stores z - 1)."""
    symmetric: bool = False
    """int4: zero point fixed at the middle of the range (scale only) instead of per group."""
    lm_head: str = "int8"
    """How an int8/int4 model stores its lm_head: int8 (per output channel; the logits GEMM
    is a fifth of the small models' weights) or none (model dtype)."""
    skip_modules: tuple[str, ...] = ()
    """Module prefixes kept in the model dtype (e.g. ``model.layers.0.mlp``)."""
    prequantized: bool = False
    """fp8, w8a8-int8: the checkpoint holds the quantized weights and scales (else:
    quantized at load)."""
    smooth_inputs: tuple[str, ...] = ()
    """w8a8-int8 checkpoints: module names (e.g. ``o_proj``, ``down_proj``) whose layers
    carry an explicit ``input_smooth`` activation scale (smoothing not folded)."""
    llm_int8_threshold: float = 6.0
    """llm-int8: the activation absmax above which an input column is an outlier."""
    weight_block: tuple[int, int] | None = None
    """fp8: block-wise scales, one per [rows, inputs] weight block (DeepSeek's 128 x
    128), with activations quantized per 1 x inputs slice of a token; None: weights
    per output channel (or tensor), activations per token."""
    scale_name: str = "weight_scale"
    """fp8 checkpoints with block-wise scales: the scale tensor's name
    (``weight_scale_inv`` in the fp8 layout, ``weight_scale`` in compressed-tensors)."""
    static_input_scale: bool = False
    """fp8 checkpoints with static activation scales (compressed-tensors
    ``input_activations`` with ``dynamic: false``, strategy tensor; the fp8 layout's
    ``activation_scheme: static``): each layer quantizes its input with the checkpoint's
    per-tensor ``input_scale`` (a merged layer: the largest of its shards') instead of a
    scale per token."""

    def __post_init__(self) -> None:
        require(self.method in ("int8", "int4", "gguf", "fp8", "w8a8-int8", "llm-int8")
                + PREQUANTIZED, "quantization",
                f"must be int8, int4, gguf, fp8, w8a8-int8, llm-int8 or one of "
                f"{PREQUANTIZED}, got {self.method!r}")
        require(self.llm_int8_threshold > 0, "llm_int8_threshold", "must be > 0")
        if self.method == "int4":
            require(self.group_size in (32, 64, 128), "quantization_group_size",
                    f"must be 32, 64 or 128, got {self.group_size}")
        require(self.lm_head in ("int8", "none"), "lm_head", "must be int8 or none")
        require(self.weight_block is None or (self.method == "fp8" and len(
            self.weight_block) == 2), "weight_block", "is two sizes, for fp8 only")
        require(not self.static_input_scale or (self.method == "fp8" and self.prequantized
                                                and self.weight_block is None),
                "static_input_scale", "is for fp8 checkpoints with per-channel or "
                "per-tensor weight scales")

    def is_skipped(self, prefix: str) -> bool:
        return any(prefix == p or prefix.startswith(p + ".") for p in self.skip_modules)

    def linear_method(self, prefix: str, tied_to=None):
        """The LinearMethod of the layer named ``prefix`` (``tied_to``: the embedding a
        tied lm_head shares). The layers ask their config, so ``layers/`` never imports
        this package (the registry is ``registry.linear_method``)."""
        return registry.linear_method(self, prefix, tied_to)

    def embedding_method(self, prefix: str):
        """The embedding method of the table named ``prefix``."""
        return registry.embedding_method(self, prefix)

    def method_for(self, prefix: str) -> str:
        """The method of the linear layer (or embedding) named ``prefix``: none, int8,
        int4 or gguf."""
        if self.is_skipped(prefix):
            return "none"
        if self.method == "gguf":  # experts too (FusedMoE: moe.methods.GGUFMoEMethod)
            return "gguf"
        if self.method in PREQUANTIZED or self.prequantized:  # decoder layers only
            return "none" if prefix == "lm_head" or prefix.endswith("embed_tokens") else (
                self.method)
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
        if self.method in PREQUANTIZED:
            return f"{self.method} ({self.bits}-bit, group {self.group_size})"
        if self.method == "w8a8-int8":
            src = ("SmoothQuant checkpoint" + (f", explicit input smoothing on "
                                                f"{', '.join(self.smooth_inputs)}"
                                                if self.smooth_inputs else "")
                   if self.prequantized else "quantized at load, no smoothing")
            return (f"w8a8-int8 ({src}; int8 weights per channel, int8 activations per "
                    f"token, torch._int_mm; lm_head {self.lm_head})")
        if self.method == "llm-int8":
            return (f"llm-int8 (int8 per channel, input columns above "
                    f"{self.llm_int8_threshold:g} in the model dtype; lm_head {self.lm_head})")
        if self.method == "fp8":
            src = "checkpoint" if self.prequantized else "quantized at load"
            if self.weight_block:
                r, g = self.weight_block
                return (f"fp8 W8A8 block-wise ({src}; {r}x{g} weight blocks, 1x{g} "
                        f"activation groups, lm_head {self.lm_head})")
            acts = ("activations per tensor with the checkpoint's static scales"
                    if self.static_input_scale else "activations per token")
            return f"fp8 W8A8 ({src}; weights per channel, {acts}, lm_head {self.lm_head})"
        return "gguf (blocks kept quantized)"


def resolve_quantization(requested: str, load_format: str, hf_quant_config: dict | None,
                         device: str, dtype_forced: bool, group_size: int = 32,
                         symmetric: bool = False, llm_int8_threshold: float = 6.0,
                         lm_head: str = "auto") -> QuantizationConfig | None:
    """The model's QuantizationConfig from what the user asked and what the checkpoint is;
    None means dense weights in the model dtype. ``lm_head`` (auto, none, int8): the
    head's storage when the weights are quantized at load (auto: the method's default)."""
    config = _resolve(requested, load_format, hf_quant_config, device, dtype_forced,
                      group_size, symmetric, llm_int8_threshold)
    if lm_head == "auto" or (lm_head == "none" and config is None):
        return config
    what = f"--lm-head-quantization {lm_head}"
    if config is None:
        raise ModelLoadError(f"{what} applies to a model quantized at load; this one is "
                             f"dense (add --quantization int8|int4|fp8|...)")
    if config.method == "gguf":
        raise ModelLoadError(f"{what}: GGUF weights keep the file's own lm_head")
    if config.method in PREQUANTIZED or config.prequantized:
        raise ModelLoadError(f"{what}: a pre-quantized checkpoint keeps its lm_head in the "
                             f"model dtype")
    return dataclasses.replace(config, lm_head=lm_head)


def _resolve(requested: str, load_format: str, hf_quant_config: dict | None, device: str,
             dtype_forced: bool, group_size: int, symmetric: bool,
             llm_int8_threshold: float) -> QuantizationConfig | None:
    require(requested in USER_METHODS, "quantization",
            f"must be one of {', '.join(USER_METHODS)}, got {requested!r}")
    on_cpu = device == "cpu"
    if hf_quant_config:
        return _prequantized(hf_quant_config, requested, device)
    if requested == "none":
        return None
    if requested == "fp8":  # W8A8: _scaled_mm on FP8 GPUs, an emulation elsewhere
        # (a GGUF file is dequantized first, then quantized again, as for int8)
        return QuantizationConfig("fp8", lm_head="none")
    if requested in ("w8a8-int8", "llm-int8"):  # int8 activations: the head stays dense
        _check_device(device, f"--quantization {requested}")
        return QuantizationConfig(requested, lm_head="none",
                                  llm_int8_threshold=llm_int8_threshold)
    if requested == "fp8-block":  # DeepSeek-style 128 x 128 weight blocks
        return QuantizationConfig("fp8", lm_head="none", weight_block=(128, 128))
    if requested == "auto":
        # GGUF runs on its own blocks on CPU unless a dtype was asked for (which means the
        # dense path in that dtype). On the GPU it stays dense unless asked for
        # (--quantization gguf): the GPU path is new and its speed is still being tuned.
        if load_format == "gguf" and on_cpu and not dtype_forced:
            return QuantizationConfig("gguf")
        return None
    _check_device(device, f"--quantization {requested}")
    if requested == "gguf" and load_format != "gguf":
        raise ModelLoadError("--quantization gguf needs a GGUF file")
    if load_format == "dummy" and requested == "gguf":
        raise ModelLoadError("--quantization gguf needs real GGUF weights, not dummy ones")
    return QuantizationConfig(requested, group_size=group_size, symmetric=symmetric)



def _check_device(device: str, what: str) -> None:
    """CPU (aten packed kernels) and CUDA (Triton kernels, kvflow/kernels/w*a16_gemm.py)."""
    if device not in ("cpu", "cuda"):
        raise ModelLoadError(f"{what} runs on cpu and cuda, not on {device}")


def _prequantized(qc: dict, requested: str, device: str) -> QuantizationConfig:
    """A config.json ``quantization_config`` -> QuantizationConfig, or a clear refusal."""
    method = str(qc.get("quant_method", "?")).lower()
    if method == FP8_CHECKPOINT or (method == "compressed-tensors"
                                    and qc.get("format") == "float-quantized"):
        return _fp8_checkpoint(qc, method, requested)
    if method == SMOOTHQUANT_CHECKPOINT:
        return _smoothquant_checkpoint(qc, requested, device)
    if method not in PREQUANTIZED:
        raise ModelLoadError(
            f"the checkpoint is pre-quantized with {method!r} (config.json "
            f"quantization_config), which kvflow does not load (supported: gptq 4/8-bit, "
            f"awq 4-bit GEMM, compressed-tensors pack-quantized W4A16/W8A16 and "
            f"float-quantized FP8, fp8 with per-tensor or per-channel scales, smoothquant int8 "
            f"W8A8 from kvflow quantize; or a float checkpoint with --quantization "
            f"int8|int4|fp8|w8a8-int8|llm-int8)")
    if requested not in ("auto", method):
        raise ModelLoadError(f"the checkpoint is already {method}-quantized; "
                             f"--quantization {requested} cannot apply to it (use auto)")
    _check_device(device, f"a {method} checkpoint")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ModelLoadError(f"awq version {qc.get('version')!r} is not supported "
                             f"(supported: gemm)")
    offset = 0
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"gptq checkpoint_format {fmt!r} is not supported "
                                 f"(supported: gptq, gptq_v2)")
        offset = 1 if fmt == "gptq" else 0
    return QuantizationConfig(method, group_size=group, bits=bits, zero_offset=offset,
                              lm_head="none")


def _fp8_checkpoint(qc: dict, method: str, requested: str) -> QuantizationConfig:
    """compressed-tensors float-quantized (FP8 W8A8 / W8A16) or the ``fp8`` layout."""
    if requested not in ("auto", "fp8", "fp8-block"):
        raise ModelLoadError(f"the checkpoint is already fp8-quantized; --quantization "
                             f"{requested} cannot apply to it (use auto or fp8)")
    skip: tuple[str, ...] = ()
    block, scale_name = None, "weight_scale"
    if method == FP8_CHECKPOINT:
        if qc.get("weight_block_size"):  # DeepSeek-style: weight_scale_inv per block
            block, scale_name = _block_size(qc["weight_block_size"]), "weight_scale_inv"
        skip = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ModelLoadError(f"fp8 checkpoint: activation_scheme {scheme!r} is not "
                                 f"supported (supported: dynamic, static)")
        static = scheme == "static"
    else:
        groups = list((qc.get("config_groups") or {}).values())
        w = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
        if (len(groups) != 1 or w.get("type") != "float" or int(w.get("num_bits", 0)) != 8
                or w.get("strategy", "tensor") not in ("tensor", "channel", "block")):
            raise ModelLoadError(f"compressed-tensors float-quantized scheme {groups} is not "
                                 f"supported (supported: one group of 8-bit float weights, "
                                 f"tensor, channel or block strategy)")
        if w.get("strategy") == "block":
            block = _block_size(w.get("block_structure"))
        skip = tuple(m for m in qc.get("ignore") or () if not m.startswith("re:"))
        acts = groups[0].get("input_activations") or {}
        static = acts.get("dynamic", True) is False
        if static and acts.get("strategy", "tensor") != "tensor":
            raise ModelLoadError(f"compressed-tensors float-quantized static activations "
                                 f"{acts} are not supported (supported: dynamic, or static "
                                 f"with strategy tensor)")
    if static and block is not None:
        raise ModelLoadError("fp8 checkpoint: static activation scales with block-wise "
                             "weight scales are not supported (block-wise checkpoints "
                             "quantize activations dynamically per 1 x block group)")
    # Static: each layer's per-tensor input_scale quantizes its input (Fp8Checkpoint-
    # LinearMethod); else activations are quantized per token (per 1 x block group).
    return QuantizationConfig("fp8", lm_head="none", skip_modules=skip, prequantized=True,
                              weight_block=block, scale_name=scale_name,
                              static_input_scale=static)


def _block_size(value) -> tuple[int, int]:
    """A checkpoint's [rows, inputs] weight block size (the kernels' limits are checked
    when the layers are built)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(
            isinstance(v, int) and v > 0 for v in value):
        raise ModelLoadError(f"fp8 checkpoint: weight block size {value!r} is not two "
                             f"positive integers [rows, inputs]")
    return int(value[0]), int(value[1])


def _smoothquant_checkpoint(qc: dict, requested: str, device: str) -> QuantizationConfig:
    """The int8 W8A8 layout of ``kvflow quantize --method smoothquant``."""
    if requested not in ("auto", "w8a8-int8"):
        raise ModelLoadError(f"the checkpoint is already int8 W8A8 (smoothquant); "
                             f"--quantization {requested} cannot apply to it (use auto)")
    _check_device(device, "a smoothquant checkpoint")
    w, a = qc.get("weights") or {}, qc.get("activations") or {}
    if (w.get("type"), int(w.get("num_bits", 0)), w.get("strategy")) != (
            "int", 8, "channel") or (a.get("type"), int(a.get("num_bits", 0)),
                                     a.get("strategy"), a.get("dynamic")) != (
            "int", 8, "token", True):
        raise ModelLoadError(f"smoothquant checkpoint with weights {w} and activations {a} "
                             f"is not supported (supported: int 8-bit channel weights, int "
                             f"8-bit dynamic token activations)")
    smooth = qc.get("smooth_inputs") or []
    if not isinstance(smooth, list) or not all(isinstance(m, str) for m in smooth):
        raise ModelLoadError(f"smoothquant smooth_inputs must be a list of module names, "
                             f"got {smooth!r}")
    return QuantizationConfig("w8a8-int8", lm_head="none", prequantized=True,
                              smooth_inputs=tuple(smooth),
                              skip_modules=tuple(qc.get("ignore") or ()))


def _compressed_tensors(qc: dict) -> QuantizationConfig:
    """compressed-tensors ``pack-quantized`` with one group of int weight-only settings."""
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if fmt != "pack-quantized" or len(groups) != 1:
        raise ModelLoadError(f"compressed-tensors format {fmt!r} with {len(groups)} config "
                             f"groups is not supported (supported: pack-quantized, one group)")
    w, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    strategy = w.get("strategy", "group")
    if acts or w.get("type", "int") != "int" or strategy not in ("group", "channel") or (
            w.get("actorder")):
        raise ModelLoadError(f"compressed-tensors scheme {w} (activations {acts}) is not "
                             f"supported (supported: int weight-only, group or channel "
                             f"strategy, no actorder: W4A16, W8A16)")
    skip = tuple(m for m in qc.get("ignore") or () if not m.startswith("re:"))
    return QuantizationConfig("compressed-tensors", bits=int(w.get("num_bits", 4)),
                              group_size=int(w.get("group_size") or -1) if strategy == "group"
                              else -1, symmetric=bool(w.get("symmetric", True)),
                              lm_head="none", skip_modules=skip)
