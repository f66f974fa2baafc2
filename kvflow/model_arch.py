"""A model's architecture as kvflow runs it: ``ModelArchConfig``, read from a Hugging
Face config.json (or a GGUF file's metadata through the same fields) and checked on
creation. Pure Python (ground floor), beside the engine config that holds one."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.dtypes import DTYPE_BYTES
from kvflow.errors import require
from kvflow.hf_arch import check_moe_fields, hf_window_fields, moe_fields, rope_scaling_items

# Rope scalings layers/rotary.py computes (kept here so config checks stay torch-free).
_ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope", "freq_factors")


@dataclass(frozen=True)
class ModelArchConfig:
    """Hyperparameters of a Llama-family model (names follow Hugging Face's config.json)."""

    architecture: str
    """HF class name: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM, MixtralForCausalLM,
    Qwen2MoeForCausalLM, Qwen3MoeForCausalLM."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    """Rope scaling parameters as sorted (key, value) pairs, e.g. llama3's factors."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on the q, k and v projections (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before rotary (Qwen3)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    """The MLP's gate activation: silu, or gelu_pytorch_tanh (Gemma's GeGLU)."""
    sliding_window: int | None = None
    """Keys a query of a windowed layer sees, itself included (Mistral v0.1, Gemma's local
    layers, Phi-3); None: no windowed layer."""
    layer_types: tuple[str, ...] | None = None
    """Per layer: sliding_attention or full_attention; None: every layer is windowed when
    ``sliding_window`` is set."""
    attn_logit_softcapping: float | None = None
    """Attention scores become cap * tanh(score / cap) before the mask (Gemma 2)."""
    final_logit_softcapping: float | None = None
    """Logits become cap * tanh(logit / cap) (Gemma 2)."""
    query_pre_attn_scalar: float | None = None
    """Attention scale is this ** -0.5 instead of head_dim ** -0.5 (Gemma)."""
    rope_local_base_freq: float | None = None
    """Rope base of the sliding layers, unscaled (Gemma 3); None: ``rope_theta``."""
    rope_context_len: int | None = None
    """The longest sequence the engine runs (its max_model_len, set at load): longrope
    picks its long factors and dynamic NTK its base from it; None: the table length."""
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE); num_experts 0: a dense model.
    num_experts: int = 0
    """Routed experts per MoE layer (HF num_experts / num_local_experts)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Intermediate size of one routed expert (Mixtral: intermediate_size)."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's always-on shared expert (behind a sigmoid gate); 0: none."""
    norm_topk_prob: bool = True
    """Renormalize the top-k routing weights to sum to 1."""
    decoder_sparse_step: int = 1
    """Every decoder_sparse_step-th layer is an MoE layer, the others dense MLPs."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP whatever decoder_sparse_step says."""
    scoring_func: str = "softmax"
    """Router scores: softmax over all experts or sigmoid per expert."""

    def __post_init__(self) -> None:
        require(self.hidden_act in ("silu", "gelu_pytorch_tanh"), "hidden_act",
                f"must be silu or gelu_pytorch_tanh, got {self.hidden_act}")
        require(self.num_attention_heads % self.num_key_value_heads == 0,
                 "num_key_value_heads", "must divide num_attention_heads")
        if self.sliding_window is not None:
            require(isinstance(self.sliding_window, int) and self.sliding_window >= 1,
                    "sliding_window", f"must be an integer >= 1, got {self.sliding_window!r}")
        if self.layer_types is not None:
            require(len(self.layer_types) == self.num_hidden_layers, "layer_types",
                    f"must name {self.num_hidden_layers} layers, got {len(self.layer_types)}")
            bad = sorted(set(self.layer_types) - {"sliding_attention", "full_attention"})
            require(not bad, "layer_types", f"kvflow runs sliding_attention and "
                    f"full_attention layers, not {', '.join(bad)}")
            require(self.sliding_window is not None or "sliding_attention"
                    not in self.layer_types, "sliding_window",
                    "is needed by the sliding_attention layers of layer_types")
        if self.rope_scaling:
            from_rope = dict(self.rope_scaling)
            kind = from_rope.get("rope_type", from_rope.get("type"))
            require(kind in _ROPE_TYPES, "rope_scaling.rope_type",
                    f"{kind!r} is not supported (supported: "
                    f"{', '.join(t for t in _ROPE_TYPES if t != 'freq_factors')})")
        if self.num_experts:
            check_moe_fields(self)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: the layer attends to the whole context)."""
        if self.sliding_window is None:
            return (None,) * self.num_hidden_layers
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_hidden_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None
                     for t in self.layer_types)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` routes to experts (else a dense MLP)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def num_active_params(self) -> int:
        """Parameters one token reads (its top-k experts of each MoE layer)."""
        return self.num_params - sum(
            (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size
            * self.moe_intermediate_size for i in range(self.num_hidden_layers)
            if self.is_moe_layer(i))

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings included once when tied)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        moe = (self.num_experts * (3 * h * self.moe_intermediate_size + h)  # + router row
               + (3 * h * self.shared_expert_intermediate_size + h
                  if self.shared_expert_intermediate_size else 0))
        return sum(attn + norms + (moe if self.is_moe_layer(i) else mlp)
                   for i in range(self.num_hidden_layers)) + emb + h

    def kv_bytes_per_token(self, dtype: str) -> int:
        """2 (K and V) * layers * kv_heads * head_dim * bytes per value."""
        return (2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
                * DTYPE_BYTES[dtype])

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArchConfig":
        """Build from a Hugging Face config.json dictionary."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else {
            "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
            "phi3": "Phi3ForCausalLM",
            "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
        }.get(cfg.get("model_type", ""), "LlamaForCausalLM")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 layout
        dense = hf_window_fields(cfg, arch)  # windows, soft-capping, Gemma; refusals
        if isinstance(rope_params, dict) and "full_attention" in rope_params:
            rope_params = rope_params["full_attention"]  # Gemma 3: one dict per layer type
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or rope_params
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
                None, "default"):
            rope_scaling = None
        if rope_scaling:
            rope_scaling = rope_scaling_items(rope_scaling, cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get(
                "qkv_bias", arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act", "silu"),
            **dense,
            **moe_fields(arch, cfg),
        )
