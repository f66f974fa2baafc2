"""What the C++ CPU step reads from a model's decoder stack besides its linears: which
stacks it can run (``why_unsupported``), each layer's attention (rotary table, score
scale, sliding window, soft cap) and norms, the embedding's scale, and which LoRA
targets it can add the deltas of (``why_no_lora``).

Two layer shapes: Llama's (Llama, Mistral, Qwen2/3, Phi-3, SmolLM2: two RMSNorms,
SiLU-mul) and Gemma's (Gemma 2/3: four norms of (1 + weight) in float32, GeGLU with the
tanh GELU, embeddings times sqrt(hidden)). Either may have per-head q/k norms (Qwen3,
Gemma 3), sliding windows on some or all layers (Mistral, Phi-3, Gemma's local layers),
soft-capped scores (Gemma 2), a scale of its own (Gemma's ``query_pre_attn_scalar``) and
layers that rotate with a table of their own (Gemma 3's local layers). The models stay
as they are: this module only reads their parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvflow.layers.attention import Attention

EMPTY = torch.empty(0)


def _kind(layer: nn.Module) -> str | None:
    """"llama", "gemma", or None for a layer the step cannot run."""
    from kvflow.layers.activation import SiluAndMul
    from kvflow.models.gemma import GemmaDecoderLayer, GemmaMLP, GemmaRMSNorm
    from kvflow.models.llama import LlamaDecoderLayer

    if isinstance(layer, LlamaDecoderLayer) and isinstance(layer.mlp.act_fn, SiluAndMul):
        return "llama"
    if isinstance(layer, GemmaDecoderLayer) and type(layer.mlp) is GemmaMLP and \
            isinstance(layer.input_layernorm, GemmaRMSNorm):
        return "gemma"
    return None


def _special(attn: Attention) -> bool:
    """A layer the fused backends leave to windowed attention: windowed, soft-capped or
    with its own rotary table."""
    return attn.sliding_window is not None or attn.logits_soft_cap is not None or \
        attn.own_rotary


def step_linears(layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """The four linears of a decoder layer the step runs, in its order."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)


# A LoRA target (kvflow/lora/slots.py's layer names) -> its index in step_linears.
LORA_LINEARS = {"self_attn.qkv_proj": 0, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2,
                "mlp.down_proj": 3}


def why_no_lora(model: nn.Module, targets: list, dtype: torch.dtype) -> str | None:
    """Why the step cannot add these LoRA targets' deltas itself (None: it can); then
    steps with adapter rows run eager (the LoRA wrapper), the others still in C++.
    ``targets``: LoRASlots.targets (layer index, kind, the wrapped layer, its slots);
    ``dtype``: the step's activation dtype."""
    layers = model.model.layers
    for t in targets:
        which = LORA_LINEARS.get(t.kind)
        if which is None or not 0 <= t.index < len(layers):
            return f"a LoRA target the step does not run ({t.kind} of layer {t.index})"
        if step_linears(layers[t.index])[which] is not t.layer:
            return f"LoRA target {t.kind} of layer {t.index} is not the linear the step runs"
        w = t.weights
        if w.a.dtype != dtype or w.a.device.type != "cpu":
            return f"LoRA slots of {w.a.dtype} on {w.a.device} for {dtype} activations"
    return None


def why_unsupported(model: nn.Module, kv_caches: torch.Tensor,
                    speculative=None) -> str | None:
    """Why this model and cache cannot run the C++ step (None: it can). The caller runs
    it on one rank only; ``speculative``: the engine's SpeculativeConfig or None. LoRA
    does not keep a model off the step: the step adds the deltas (``why_no_lora`` says
    when it cannot, and then only steps with adapter rows run eager)."""
    quants = {m.kv_quant.kind for m in model.modules()
              if isinstance(m, Attention) and m.kv_quant is not None}
    if len(quants) > 1:
        return "KV caches quantized in different ways"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "norm") or not hasattr(inner, "embed_tokens"):
        return "not a Llama-family decoder stack"
    from kvflow.layers.moe import FusedMoE

    if any(isinstance(m, FusedMoE) for m in model.modules()):
        return "mixture-of-experts layers (the eager path reads the routed experts)"
    kinds = {_kind(layer) for layer in layers}
    if None in kinds or len(kinds) != 1:
        return "not a Llama-family decoder layer"
    eps = {m.eps for m in inner.modules() if hasattr(m, "eps") and hasattr(m, "weight")}
    if len(eps) != 1:
        return "norms with different eps"
    if speculative is not None and speculative.method == "medusa" and any(
            _special(layer.self_attn.attn) for layer in layers):
        # A tree token's window is not defined (the eager windowed attention refuses
        # trees too).
        return "Medusa candidate trees on windowed, soft-capped or own-rotary layers"
    if quants:  # int8 / fp8: written and read by the shared paged kernel
        head_dim = kv_caches.shape[-1]  # [L, 2, NB, BS, KVH, D]
        if head_dim % 8:
            return f"{quants.pop()} KV cache with head dim {head_dim} (the kernel needs " \
                "a multiple of 8)"
        return None
    if kv_caches.dtype != torch.float32 and kv_caches.dtype not in (torch.bfloat16,
                                                                     torch.float16):
        return f"KV cache dtype {kv_caches.dtype}"
    return None


@dataclass
class StackArgs:
    """The C++ step's constructor arguments besides the linears and caches: per layer
    [in, post] norms, [q, k, attention-out, MLP-out] norms (EMPTY: none), rotary table,
    score scale, window (0: none), soft cap (0: none); the final norm; whether norms are
    Gemma's (weights handed over as 1 + weight in float32) and the activation."""

    norms: list[torch.Tensor]
    extra_norms: list[torch.Tensor]
    cos_sins: list[torch.Tensor]
    scales: list[float]
    windows: list[int]
    softcaps: list[float]
    final_norm: torch.Tensor
    gemma: bool
    act: str
    special: bool  # some layer is windowed, soft-capped or rotates with its own table


def stack_args(model: nn.Module) -> StackArgs:
    inner = model.model
    gemma = _kind(inner.layers[0]) == "gemma"

    def w(norm: nn.Module | None) -> torch.Tensor:
        if norm is None:
            return EMPTY
        weight = norm.weight.detach()
        return 1.0 + weight.float() if gemma else weight  # as GemmaRMSNorm computes it

    norms, extra, cos_sins, scales, windows, caps = [], [], [], [], [], []
    for layer in inner.layers:
        sa = layer.self_attn
        attn = sa.attn
        if gemma:  # post_attention_layernorm norms the attention output there
            norms += [w(layer.input_layernorm), w(layer.pre_feedforward_layernorm)]
            outs = [w(layer.post_attention_layernorm), w(layer.post_feedforward_layernorm)]
        else:
            norms += [w(layer.input_layernorm), w(layer.post_attention_layernorm)]
            outs = [EMPTY, EMPTY]
        extra += [w(getattr(sa, "q_norm", None)), w(getattr(sa, "k_norm", None))] + outs
        cos_sins.append(attn.rotary.cos_sin_cache)
        scales.append(attn.scale)
        windows.append(attn.sliding_window or 0)
        caps.append(attn.logits_soft_cap or 0.0)
    return StackArgs(norms, extra, cos_sins, scales, windows, caps, w(inner.norm), gemma,
                     "gelu_tanh" if gemma else "silu",
                     any(_special(layer.self_attn.attn) for layer in inner.layers))


def embedder(model: nn.Module):
    """ids [T] -> the first layer's input [T, hidden]: the embedding, times Gemma's
    ``normalizer`` (sqrt(hidden) in the model dtype) where the model has one."""
    inner = model.model
    embed = inner.embed_tokens
    scale = getattr(inner, "normalizer", None)
    if scale is None:
        return embed
    return lambda ids: embed(ids) * scale
