"""Gemma 2 and Gemma 3 (text): local (sliding-window) and global layers, RMSNorm with
(1 + weight), embeddings scaled by sqrt(hidden) in the activation dtype, GeGLU (tanh
GELU), four norms per layer (input, post-attention, pre- and post-feedforward),
attention scaled by ``query_pre_attn_scalar`` ** -0.5.

Gemma 2 soft-caps attention scores and final logits; Gemma 3 instead normalizes q and
k per head and rotates its local layers with their own base (``rope_local_base_freq``,
unscaled) while the global layers use ``rope_theta`` and its scaling.

Module names follow Hugging Face's; q/k/v and gate/up load shard by shard into merged
GEMMs as in models/llama.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.config import ModelArchConfig
from kvflow.distributed.parallel_state import GroupCoordinator
from kvflow.layers.attention import Attention, AttentionBackend, AttentionMetadata
from kvflow.layers.parallel_linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear)
from kvflow.layers.pipeline import make_layers
from kvflow.layers.quantization import QuantizationConfig
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.layers.vocab_parallel import make_embedding, make_lm_head
from kvflow.models.llama import LlamaForCausalLM, model_rotary


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32 (the checkpoint stores
    weight - 1: zeros mean identity)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend,
                 rotary: RotaryEmbedding, window: int | None, own_rotary: bool,
                 quant: QuantizationConfig | None, tp: GroupCoordinator | None,
                 prefix: str) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim,
                                          cfg.num_attention_heads, cfg.num_key_value_heads,
                                          cfg.attention_bias, dtype, None, tp,
                                          quant_config=quant, prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim,
                                        cfg.hidden_size, False, dtype, None, tp,
                                        quant_config=quant, prefix=f"{prefix}.o_proj")
        if cfg.qk_norm:  # Gemma 3
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.attn = Attention(self.num_heads, cfg.head_dim, self.num_kv_heads, rotary, backend,
                              sliding_window=window, scale=scalar ** -0.5,
                              logits_soft_cap=cfg.attn_logit_softcapping,
                              own_rotary=own_rotary)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size,
                                          self.qkv_proj.kv_size], dim=-1)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, -1)
        return self.o_proj(self.attn(positions, q, k, v, meta))


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype,
                 quant: QuantizationConfig | None, tp: GroupCoordinator | None,
                 prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, False, dtype, None, tp,
            quant_config=quant, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False,
                                           dtype, None, tp, quant_config=quant,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend,
                 rotary: RotaryEmbedding, window: int | None, own_rotary: bool,
                 quant: QuantizationConfig | None, tp: GroupCoordinator | None,
                 prefix: str) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, dtype, backend, rotary, window, own_rotary,
                                        quant, tp, f"{prefix}.self_attn")
        self.mlp = GemmaMLP(cfg, dtype, quant, tp, f"{prefix}.mlp")
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend,
                 max_position: int, quant: QuantizationConfig | None,
                 tp: GroupCoordinator | None, pp: GroupCoordinator | None) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(cfg.vocab_size, cfg.hidden_size, dtype, tp, quant,
                                           "model.embed_tokens")
        # sqrt(hidden) rounded to the activation dtype first, as transformers does
        self.register_buffer("normalizer", torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype),
                             persistent=False)
        glob = model_rotary(cfg, max_position)
        local = glob
        if cfg.rope_local_base_freq is not None:  # Gemma 3: unscaled, its own base
            local = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_local_base_freq)
        windows = cfg.layer_windows
        if None not in windows:  # no global layer: the local table is the step's table
            glob = local

        def layer(i: int) -> GemmaDecoderLayer:
            rot = local if windows[i] is not None else glob
            return GemmaDecoderLayer(cfg, dtype, backend, rot, windows[i], rot is not glob,
                                     quant, tp, f"model.layers.{i}")

        self.layers, self.start_layer, self.end_layer = make_layers(cfg.num_hidden_layers,
                                                                    pp, layer)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.normalizer  # [T, hidden]
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden = layer(positions, hidden, meta)
        return self.norm(hidden)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text). Loading is Llama's (same names,
    same merged GEMMs); the stack and the logit soft-cap are Gemma's."""

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend,
                 max_position: int, quant: QuantizationConfig | None = None,
                 tp: GroupCoordinator | None = None,
                 pp: GroupCoordinator | None = None) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = GemmaModel(cfg, dtype, backend, max_position, quant, tp, pp)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = make_lm_head(cfg.vocab_size, cfg.hidden_size, dtype, tied, tp, quant)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in float32, soft-capped (Gemma 2)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
