"""``kvflow quantize --method smoothquant``: int8 W8A8 checkpoints with SmoothQuant
(Xiao et al. 2022) smoothing, calibrated on CPU with the real model.

1. Calibrate: the dense float32 model prefills windows of the calibration text; a
   forward pre-hook on every decoder linear records the absolute maximum of each input
   channel over all tokens (``collect_input_absmax``).
2. Smooth (``smooth_model``): per input channel j of a linear,
   ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``; the weight's column j is multiplied
   by s_j and its input divided by s_j, which leaves the product unchanged but moves the
   activation outliers (a few channels of SmolLM2 reach hundreds) into the weights,
   which are quantized per output channel and tolerate them. The division is folded
   where the input is made:
   - qkv_proj: into input_layernorm's weight; gate_up_proj: into
     post_attention_layernorm's weight (RMSNorm is ``w * x / rms(x)``);
   - o_proj: into v_proj's rows (the attention output of head h is a convex
     combination of its KV head's values); with grouped-query attention the heads that
     share a KV head must share s, so s is computed from the group's maxima;
   - down_proj: into up_proj's rows (``silu(gate) * up`` is linear in up).
   With ``--fold norms`` o_proj and down_proj keep an explicit ``input_smooth`` (1/s)
   vector instead, multiplied into their input at run time.
3. Quantize every decoder linear to int8 per output channel and write the checkpoint:
   ``model.safetensors`` (Hugging Face tensor names; ``<proj>.weight`` int8,
   ``<proj>.weight_scale`` float32 [N], ``<proj>.input_smooth`` where not folded, the
   smoothed norms, embeddings and head in float32), ``config.json`` with the
   ``quantization_config`` below, and the tokenizer files.

``quantization_config`` (kvflow's own layout, docs/quantization.md)::

    {"quant_method": "smoothquant", "format": "int8-w8a8",
     "weights": {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": true},
     "activations": {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": true,
                     "symmetric": true},
     "alpha": 0.5, "folded": [...], "smooth_inputs": [...], "ignore": ["lm_head"],
     "calibration": {"text": ..., "windows": ..., "tokens": ...}}
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvflow.errors import InvalidParameterError
from kvflow.logger import init_logger

logger = init_logger(__name__)

BUILTIN_TEXT = os.path.join(os.path.dirname(__file__), "data", "calib_text.txt")
_MIN_SCALE = 1e-5


# ---- calibration ---------------------------------------------------------------------------

def calibration_text(calib: str | None) -> tuple[str, str]:
    """(text, description): a file, or 'builtin' = kvflow's own calibration text
    followed by the Python language reference shipped with Python (pydoc_data)."""
    if calib in (None, "builtin", "pydoc"):
        parts = []
        if calib != "pydoc":
            with open(BUILTIN_TEXT, encoding="utf-8") as f:
                parts.append(f.read())
        try:  # installed with CPython: the reference manual's topics as plain text
            from pydoc_data.topics import topics

            parts.append("\n\n".join(topics[k] for k in sorted(topics)))
        except ImportError:
            if calib == "pydoc":
                raise InvalidParameterError("--calib pydoc: this Python has no pydoc_data",
                                            param="calib") from None
        return "\n\n".join(parts), calib or "builtin"
    try:
        with open(calib, encoding="utf-8") as f:
            return f.read(), os.path.basename(calib)
    except OSError as e:
        raise InvalidParameterError(f"cannot read --calib {calib}: {e}", param="calib") from None


def decoder_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """prefix -> LinearBase of every decoder-layer linear (not the lm_head)."""
    from kvflow.layers.linear import LinearBase

    return {m.prefix: m for m in model.modules()
            if isinstance(m, LinearBase) and ".layers." in m.prefix}


@torch.no_grad()
def collect_input_absmax(model: torch.nn.Module, run) -> dict[str, torch.Tensor]:
    """Calls ``run()`` (which feeds the calibration data through ``model``) with a hook on
    every decoder linear; returns prefix -> float32 [K] max |x_j| over all tokens seen."""
    stats: dict[str, torch.Tensor] = {}
    hooks = []
    for prefix, lin in decoder_linears(model).items():
        def hook(_mod, args, _p=prefix):
            x = args[0].reshape(-1, args[0].shape[-1])  # [T, K]
            m = x.abs().amax(dim=0).float()
            stats[_p] = m if _p not in stats else torch.maximum(stats[_p], m)
        hooks.append(lin.register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return stats


# ---- smoothing -----------------------------------------------------------------------------

def smoothing_factors(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float
                      ) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha), [K]; channels never active get 1."""
    x_max = x_max.float().clamp(min=_MIN_SCALE)
    w_max = w_max.float().clamp(min=_MIN_SCALE)
    s = x_max.pow(alpha) / w_max.pow(1.0 - alpha)
    return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s)).clamp(min=_MIN_SCALE)


@torch.no_grad()
def smooth_model(model: torch.nn.Module, stats: dict[str, torch.Tensor], alpha: float,
                 fold: str = "all") -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Apply the smoothing in place on the dense model. Returns (prefix -> input_smooth
    [K] = 1/s of the layers that multiply it explicitly, per layer type a summary of the
    activation ranges before / after). The model's function is unchanged (up to float
    rounding): ``tests/test_smoothquant.py`` checks it."""
    explicit: dict[str, torch.Tensor] = {}
    summary: dict[str, dict] = {}

    def note(kind: str, x_max: torch.Tensor, s: torch.Tensor) -> None:
        d = summary.setdefault(kind, {"layers": 0, "act_absmax_before": 0.0,
                                      "act_absmax_after": 0.0})
        d["layers"] += 1
        d["act_absmax_before"] = max(d["act_absmax_before"], float(x_max.max()))
        d["act_absmax_after"] = max(d["act_absmax_after"], float((x_max / s).max()))

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o, gu, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        missing = [m.prefix for m in (qkv, o, gu, down) if m.prefix not in stats]
        if missing:
            raise InvalidParameterError(f"no calibration statistics for {missing[0]} (did "
                                        f"the calibration run reach every layer?)")
        # qkv <- input_layernorm
        s = smoothing_factors(stats[qkv.prefix], qkv.weight.abs().amax(0), alpha)
        layer.input_layernorm.weight.div_(s.to(qkv.weight.dtype))
        qkv.weight.mul_(s[None, :].to(qkv.weight.dtype))
        note("qkv_proj", stats[qkv.prefix], s)
        # gate_up <- post_attention_layernorm
        s = smoothing_factors(stats[gu.prefix], gu.weight.abs().amax(0), alpha)
        layer.post_attention_layernorm.weight.div_(s.to(gu.weight.dtype))
        gu.weight.mul_(s[None, :].to(gu.weight.dtype))
        note("gate_up_proj", stats[gu.prefix], s)
        # o_proj <- v_proj rows, one s per KV channel (shared by the heads of a group)
        h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        x_o = stats[o.prefix].view(kvh, h // kvh, d).amax(1)  # [KVH, D]
        w_o = o.weight.abs().amax(0).view(kvh, h // kvh, d).amax(1)
        s_kv = smoothing_factors(x_o.reshape(-1), w_o.reshape(-1), alpha)  # [KVH * D]
        s = s_kv.view(kvh, 1, d).expand(kvh, h // kvh, d).reshape(-1)  # [H * D]
        o.weight.mul_(s[None, :].to(o.weight.dtype))
        if fold == "all":
            v_rows = slice(qkv.q_size + qkv.kv_size, qkv.q_size + 2 * qkv.kv_size)
            qkv.weight[v_rows].div_(s_kv[:, None].to(qkv.weight.dtype))
            if qkv.bias is not None:
                qkv.bias[v_rows].div_(s_kv.to(qkv.bias.dtype))
        else:
            explicit[o.prefix] = 1.0 / s
        note("o_proj", stats[o.prefix], s)
        # down_proj <- up_proj rows (the second half of gate_up)
        inter = down.input_size
        s = smoothing_factors(stats[down.prefix], down.weight.abs().amax(0), alpha)
        down.weight.mul_(s[None, :].to(down.weight.dtype))
        if fold == "all":
            gu.weight[inter:2 * inter].div_(s[:, None].to(gu.weight.dtype))
            if gu.bias is not None:
                gu.bias[inter:2 * inter].div_(s.to(gu.bias.dtype))
        else:
            explicit[down.prefix] = 1.0 / s
        note("down_proj", stats[down.prefix], s)
    return explicit, summary


# ---- the checkpoint ------------------------------------------------------------------------

# merged kvflow layer -> Hugging Face shards (rows in order)
def _shards(lin) -> list[tuple[str, int]]:
    name = lin.prefix.rsplit(".", 1)[-1]
    if name == "qkv_proj":
        return [("q_proj", lin.q_size), ("k_proj", lin.kv_size), ("v_proj", lin.kv_size)]
    if name == "gate_up_proj":
        return [("gate_proj", lin.output_sizes[0]), ("up_proj", lin.output_sizes[1])]
    return [(name, lin.output_size)]


@torch.no_grad()
def checkpoint_tensors(model: torch.nn.Module, explicit: dict[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors: decoder linears as int8 + per-channel scales, every
    other parameter (norms, embeddings, an untied head) as it is."""
    from kvflow.layers.quantization.int8_gemm import quantize_int8_rows

    lins = decoder_linears(model)
    out: dict[str, torch.Tensor] = {}
    owned = set()
    for prefix, lin in lins.items():
        q, scale = quantize_int8_rows(lin.weight.data)  # [N, K], [N]
        base = prefix.rsplit(".", 1)[0]
        start = 0
        for name, rows in _shards(lin):
            out[f"{base}.{name}.weight"] = q[start:start + rows].contiguous()
            out[f"{base}.{name}.weight_scale"] = scale[start:start + rows].contiguous()
            if lin.bias is not None:
                out[f"{base}.{name}.bias"] = lin.bias.data[start:start + rows].float().clone()
            if prefix in explicit:
                out[f"{base}.{name}.input_smooth"] = explicit[prefix].float().contiguous()
            start += rows
        owned.update(f"{prefix}.{n}" for n, _ in lin.named_parameters(recurse=False))
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, p in model.named_parameters():
        if name in owned or (tied and name.startswith("lm_head")):
            continue
        out[name] = p.data.float().contiguous().clone()
    return out


def hf_config(arch, quant_config: dict) -> dict:
    """config.json for ``arch`` (a ModelArchConfig), read back by from_hf_config."""
    cfg = {"architectures": [arch.architecture],
           "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                          "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"
                          }.get(arch.architecture, "llama"),
           "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
           "intermediate_size": arch.intermediate_size,
           "num_hidden_layers": arch.num_hidden_layers,
           "num_attention_heads": arch.num_attention_heads,
           "num_key_value_heads": arch.num_key_value_heads, "head_dim": arch.head_dim,
           "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta,
           "rope_scaling": arch.rope_scaling_dict,
           "max_position_embeddings": arch.max_position_embeddings,
           "tie_word_embeddings": arch.tie_word_embeddings,
           "attention_bias": arch.attention_bias, "hidden_act": arch.hidden_act,
           "bos_token_id": arch.bos_token_id,
           "eos_token_id": list(arch.eos_token_ids) if len(arch.eos_token_ids) != 1
           else arch.eos_token_ids[0],
           "torch_dtype": "float32", "quantization_config": quant_config}
    return cfg


def save_tokenizer(tok, folder: str, generation_defaults: dict, eos_ids) -> None:
    """tokenizer.json (the Rust tokenizer as configured), tokenizer_config.json (special
    tokens, chat templates) and generation_config.json (eos ids, sampling defaults)."""
    tok._backend.save(os.path.join(folder, "tokenizer.json"))
    cfg = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
           if getattr(tok, k) is not None}
    if tok.chat_templates:
        cfg["chat_template"] = (tok.chat_templates["default"]
                                if set(tok.chat_templates) == {"default"} else
                                [{"name": n, "template": t}
                                 for n, t in tok.chat_templates.items()])
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    gen = {**generation_defaults, "eos_token_id": sorted(set(eos_ids) | set(tok.eos_token_ids))}
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen, f, indent=1)


def write_smoothquant(scorer, wins: list[list[int]], alpha: float, fold: str, output: str,
                      tok=None, calibration: dict | None = None) -> int:
    """Calibrate ``scorer``'s dense model on the token windows, smooth it in place,
    quantize and write the checkpoint directory ``output``; returns the tokens seen."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    stats = collect_input_absmax(scorer.model, lambda: [scorer.logprobs(w) for w in wins])
    n_tok = sum(len(w) for w in wins)
    logger.info("calibrated on %d windows, %d tokens in %.1f s", len(wins), n_tok,
                time.perf_counter() - start)
    explicit, summary = smooth_model(scorer.model, stats, alpha, fold)
    for kind, d in summary.items():
        logger.info("smoothing %s (%d layers): activation absmax %.1f -> %.1f", kind,
                    d["layers"], d["act_absmax_before"], d["act_absmax_after"])
    folded = ["qkv_proj", "gate_up_proj"] + (["o_proj", "down_proj"] if fold == "all"
                                             else [])
    qc = {"quant_method": "smoothquant", "format": "int8-w8a8",
          "weights": {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True},
          "activations": {"type": "int", "num_bits": 8, "strategy": "token",
                          "dynamic": True, "symmetric": True},
          "alpha": alpha, "folded": folded,
          "smooth_inputs": [] if fold == "all" else ["o_proj", "down_proj"],
          "ignore": ["lm_head"],
          "calibration": {**(calibration or {}), "windows": len(wins), "tokens": n_tok},
          "smoothing_summary": summary}
    tensors = checkpoint_tensors(scorer.model, explicit)
    os.makedirs(output, exist_ok=True)
    save_file(tensors, os.path.join(output, "model.safetensors"),
              metadata={"format": "pt", "quantized_by": "kvflow quantize --method smoothquant"})
    config = scorer.config
    with open(os.path.join(output, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config(config.model.arch, qc), f, indent=1)
    if tok is not None:
        save_tokenizer(tok, output, dict(config.model.generation_defaults),
                       config.model.arch.eos_token_ids)
    return n_tok


def run_quantize(ns: argparse.Namespace) -> int:
    from kvflow.bench.quality import _Scorer
    from kvflow.engine.args import EngineArgs
    from kvflow.engine.llm_engine import load_tokenizer

    if not 0.0 <= ns.alpha <= 1.0:
        raise InvalidParameterError(f"--alpha must be in [0, 1], got {ns.alpha}",
                                    param="alpha")
    if ns.context < 16 or ns.max_windows < 1:
        raise InvalidParameterError("--context must be >= 16 and --max-windows >= 1",
                                    param="context")
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if os.path.exists(ns.output) and os.listdir(ns.output):
        raise InvalidParameterError(f"--output {ns.output} exists and is not empty",
                                    param="output")
    text, text_name = calibration_text(ns.calib)  # before the model: fail fast
    start = time.perf_counter()
    args = EngineArgs(model=ns.model, device="cpu", quantization="none", dtype="float32",
                      max_model_len=max(ns.context, 64))
    scorer = _Scorer(args, ns.context)  # the dense float32 model with a window's cache
    config = scorer.config
    tok = load_tokenizer(config)
    if tok is None:
        raise InvalidParameterError("kvflow quantize needs a model with a tokenizer")
    ids = tok.encode(text, add_special_tokens=False)
    wins = [ids[i:i + ns.context] for i in range(0, len(ids) - 15, ns.context)]
    wins = [w for w in wins if len(w) >= 16][:ns.max_windows]
    if not wins:
        raise InvalidParameterError(f"the calibration text has {len(ids)} tokens, fewer "
                                    f"than 16", param="calib")
    n_tok = write_smoothquant(scorer, wins, ns.alpha, ns.fold, ns.output, tok,
                              {"text": text_name, "source_model": ns.model,
                               "context": ns.context})
    size = os.path.getsize(os.path.join(ns.output, "model.safetensors"))
    print(f"wrote {ns.output}: smoothquant alpha {ns.alpha}, fold {ns.fold}, "
          f"{size / 2**20:.1f} MiB, calibrated on {n_tok} tokens, "
          f"{time.perf_counter() - start:.1f} s")
    return 0
