"""Reading a Hugging Face config.json beyond the Llama family's fields: sliding windows
and local/global layer patterns, Gemma's soft-capping and scales, rope scaling as
hashable pairs, and the refusal of attention features kvflow lacks. Pure Python (ground
floor): ``ModelArchConfig.from_hf_config`` calls it."""

from __future__ import annotations

from kvflow.errors import require

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
