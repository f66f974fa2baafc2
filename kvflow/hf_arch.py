"""Reading a Hugging Face config.json beyond the Llama family's fields: sliding windows
and local/global layer patterns, Gemma's soft-capping and scales, rope scaling as
hashable pairs, the expert fields of mixtures of experts, and the refusal of attention
and router features kvflow lacks. Pure Python (ground floor): ``ModelArchConfig`` calls
it."""

from __future__ import annotations

from kvflow.errors import InvalidParameterError, require

_WINDOWED = ("MistralForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def hf_window_fields(cfg: dict, arch: str) -> dict:
    """ModelArchConfig's window, soft-capping and Gemma fields from a config.json, and
    the refusal of attention features kvflow lacks (a model computed without them would
    be silently wrong)."""
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    for where in (cfg, rope, *(v for v in rope.values() if isinstance(v, dict))):
        prf = where.get("partial_rotary_factor")
        require(prf in (None, 1, 1.0), "partial_rotary_factor",
                f"kvflow rotates the whole head (1.0), got {prf}")
    require(not cfg.get("mlp_bias"), "mlp_bias", "biases on the MLP are not supported")
    require(not cfg.get("use_bidirectional_attention"), "use_bidirectional_attention",
            "kvflow runs causal attention only")
    require(cfg.get("attention_chunk_size") is None, "attention_chunk_size",
            "chunked attention is not supported")
    out: dict = {}
    window = None
    if arch in _WINDOWED:
        window = cfg.get("sliding_window")
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        window = cfg.get("sliding_window")
    if window is not None:
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if types is None and arch == "Gemma2ForCausalLM":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        elif types is None and arch == "Gemma3ForCausalLM":
            pattern = cfg.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(n)]
        elif types is None and arch.startswith("Qwen"):
            first = cfg.get("max_window_layers", 0)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        out["sliding_window"] = window
        out["layer_types"] = tuple(types) if types is not None else None
    if arch in _GEMMA:
        out["attn_logit_softcapping"] = cfg.get("attn_logit_softcapping")
        out["final_logit_softcapping"] = cfg.get("final_logit_softcapping")
        out["query_pre_attn_scalar"] = cfg.get("query_pre_attn_scalar")
    if arch == "Gemma3ForCausalLM":
        local = rope.get("sliding_attention") or {}
        require(local.get("rope_type", "default") == "default", "rope_parameters",
                f"scaled rope on sliding layers is not supported, got {local}")
        out["rope_local_base_freq"] = float(local.get("rope_theta")
                                            or cfg.get("rope_local_base_freq") or 10000.0)
    return out


def rope_scaling_items(scaling: dict, cfg: dict) -> tuple[tuple[str, object], ...]:
    """Rope scaling as sorted, hashable (key, value) pairs; Phi-3 keeps
    original_max_position_embeddings beside the dict, longrope and YaRN read it inside."""
    scaling = {k: tuple(v) if isinstance(v, list) else v for k, v in scaling.items()
               if k not in ("rope_theta", "partial_rotary_factor")}
    if "original_max_position_embeddings" not in scaling and cfg.get(
            "original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return tuple(sorted(scaling.items()))


MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def moe_fields(arch: str, cfg: dict) -> dict:
    """ModelArchConfig's expert fields from a HF config.json (empty for dense models).
    Router options kvflow cannot honour are refused here, naming the field."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    num = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    for key, ok in (("n_group", (None, 1)), ("topk_group", (None, 1)),
                    ("topk_method", (None, "greedy")), ("routed_scaling_factor", (None, 1.0))):
        if cfg.get(key, None) not in ok:
            raise InvalidParameterError(f"config.json field {key}={cfg[key]!r}: this router "
                                        f"option is not supported", param=key)
    if arch == "MixtralForCausalLM":
        return dict(num_experts=num, num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                    scoring_func=cfg.get("scoring_func", "softmax"))
    return dict(
        num_experts=num, num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
        moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
        shared_expert_intermediate_size=(cfg.get("shared_expert_intermediate_size", 0)
                                         if arch == "Qwen2MoeForCausalLM" else 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", arch == "Qwen3MoeForCausalLM")),
        decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        scoring_func=cfg.get("scoring_func", "softmax"))


def check_moe_fields(a) -> None:
    """The expert fields' checks (ModelArchConfig.__post_init__)."""
    require(a.scoring_func in ("softmax", "sigmoid"), "scoring_func",
            f"must be softmax or sigmoid, got {a.scoring_func!r}")
    require(1 <= a.num_experts_per_tok <= a.num_experts, "num_experts_per_tok",
            f"must be in [1, num_experts={a.num_experts}], got {a.num_experts_per_tok}")
    require(a.moe_intermediate_size >= 1, "moe_intermediate_size", "must be >= 1")
    require(a.decoder_sparse_step >= 1, "decoder_sparse_step", "must be >= 1")
    require(a.shared_expert_intermediate_size >= 0, "shared_expert_intermediate_size",
            "must be >= 0")
    require(all(0 <= i < a.num_hidden_layers for i in a.mlp_only_layers),
            "mlp_only_layers", f"must name layers in [0, {a.num_hidden_layers})")
