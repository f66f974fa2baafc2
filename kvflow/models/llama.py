"""The Llama family in one implementation: Llama 2/3/3.1, Mistral, Qwen2/2.5 (QKV bias),
Qwen3 (q/k RMSNorm), SmolLM2 (tied embeddings).

Module names follow Hugging Face's so checkpoints load by name; q/k/v and gate/up are
merged into one GEMM each and load shard by shard.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.config import ModelArchConfig
from kvflow.errors import ModelLoadError
from kvflow.layers.activation import SiluAndMul
from kvflow.layers.attention import Attention, AttentionBackend, AttentionMetadata
from kvflow.distributed.parallel_state import GroupCoordinator
from kvflow.layers.linear import default_weight_loader
from kvflow.layers.pipeline import make_layers
from kvflow.layers.parallel_linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear)
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.layers.vocab_parallel import make_embedding, make_lm_head
from kvflow.layers.quantization import QuantizationConfig

# (merged parameter, checkpoint name, shard) for the merged GEMMs.
STACKED_PARAMS = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend,
                 rotary: RotaryEmbedding, quant: QuantizationConfig | None,
                 tp: GroupCoordinator | None, prefix: str) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim,
                                          cfg.num_attention_heads, cfg.num_key_value_heads,
                                          cfg.attention_bias, dtype, None, tp,
                                          quant_config=quant, prefix=f"{prefix}.qkv_proj")
        # Heads of this rank (all of them on one rank).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim,
                                        cfg.hidden_size, False, dtype, None, tp,
                                        quant_config=quant, prefix=f"{prefix}.o_proj")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        window = cfg.layer_windows[int(prefix.split(".")[-2])]  # "...layers.{i}.self_attn"
        self.attn = Attention(self.num_heads, cfg.head_dim, self.num_kv_heads, rotary, backend,
                              sliding_window=window)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, norm: RMSNorm, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention output, residual): ``norm`` (the layer's input norm, with the residual
        add) is applied by the QKV projection, which may fold it into its GEMM."""
        qkv, residual = self.qkv_proj.forward_normed(hidden, residual, norm)  # [T, (H+2KVH)D]
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size,
                             self.qkv_proj.kv_size], dim=-1)
        if hasattr(self, "q_norm"):
            t = hidden.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, -1)
        return self.o_proj(self.attn(positions, q, k, v, meta)), residual


class LlamaMLP(nn.Module):
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
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual) of ``norm(x, residual)``: the add, the norm and the
        activation go through gate_up_proj, which may fold them into one launch."""
        return self.gate_up_proj.forward_mlp(x, residual, norm, self.act_fn, self.down_proj)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend,
                 rotary: RotaryEmbedding, quant: QuantizationConfig | None,
                 tp: GroupCoordinator | None, prefix: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, dtype, backend, rotary, quant, tp,
                                        f"{prefix}.self_attn")
        self.mlp = LlamaMLP(cfg, dtype, quant, tp, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata):
        # Each norm (with the residual add before it) is applied by the projection that
        # consumes it: the seam where the decode GEMV folds it into its own launch.
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm,
                                          meta)
        return self.mlp(hidden, residual, self.post_attention_layernorm)


def model_rotary(cfg: ModelArchConfig, max_position: int) -> RotaryEmbedding:
    """The model's rotary table as its config scales it (every rope type, the context
    that longrope and dynamic NTK choose by)."""
    return RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling_dict,
                           cfg.max_position_embeddings, cfg.rope_context_len)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend,
                 max_position: int, quant: QuantizationConfig | None,
                 tp: GroupCoordinator | None, pp: GroupCoordinator | None) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(cfg.vocab_size, cfg.hidden_size, dtype, tp, quant,
                                           "model.embed_tokens")
        rotary = model_rotary(cfg, max_position)  # one table shared by every layer
        # This pipeline stage's layers [start_layer, end_layer) (all of them on one stage).
        self.layers, self.start_layer, self.end_layer = make_layers(
            cfg.num_hidden_layers, pp,
            lambda i: LlamaDecoderLayer(cfg, dtype, backend, rotary, quant, tp,
                                        f"model.layers.{i}"))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend,
                 max_position: int, quant: QuantizationConfig | None = None,
                 tp: GroupCoordinator | None = None,
                 pp: GroupCoordinator | None = None) -> None:
        """``tp``: the tensor-parallel group the layers split over; ``pp``: the pipeline
        stages (None: one rank)."""
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, dtype, backend, max_position, quant, tp, pp)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = make_lm_head(cfg.vocab_size, cfg.hidden_size, dtype, tied, tp, quant)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in float32."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by Hugging Face name; every parameter must be filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for merged, ckpt, shard in STACKED_PARAMS:
                if f".{ckpt}." in name:
                    target = name.replace(f".{ckpt}.", f".{merged}.")
                    if target not in params:
                        break
                    param = params[target]
                    param.weight_loader(param, tensor, shard)
                    loaded.add(f"{target}:{shard}")
                    break
            else:
                if name not in params:
                    continue  # extra tensors some checkpoints carry
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        self._check_complete(params, loaded)

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            merged = [s for m, _, s in STACKED_PARAMS if f".{m}." in name]
            if merged:
                missing += [f"{name}:{s}" for s in merged if f"{name}:{s}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} weights: {shown}")
