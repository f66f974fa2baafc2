"""Mixture-of-experts decoders: Qwen2-MoE (shared expert behind a sigmoid gate, QKV bias)
and Qwen3-MoE (q/k RMSNorm); Mixtral reuses this stack under its own module names
(``models/mixtral.py``).

Attention and the dense MLP of ``mlp_only_layers`` / off-``decoder_sparse_step`` layers
are Llama's blocks; each MoE layer is a router (``gate``), the routed experts as one
``FusedMoE`` (``experts``) and, for Qwen2-MoE, ``shared_expert`` + ``shared_expert_gate``.
Module names follow Hugging Face's so checkpoints load by name; per-expert checkpoint
tensors are stacked by the experts layer's own weight loader.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import torch
from torch import nn

from kvflow.config import ModelArchConfig
from kvflow.distributed.parallel_state import GroupCoordinator
from kvflow.errors import ModelLoadError
from kvflow.layers.attention import AttentionBackend, AttentionMetadata
from kvflow.layers.linear import default_weight_loader
from kvflow.layers.moe import FusedMoE
from kvflow.layers.norm import RMSNorm
from kvflow.layers.pipeline import make_layers
from kvflow.layers.quantization import QuantizationConfig
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.layers.vocab_parallel import make_embedding, make_lm_head
from kvflow.models.llama import STACKED_PARAMS, LlamaAttention, LlamaMLP, model_rotary

# experts.{e}.<name>.weight -> the expert shard kind FusedMoE's loader takes
_EXPERT_KINDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",
                 "w1": "w1", "w3": "w3", "w2": "w2"}
# (GGUF blocks kept: ``qweight_type`` then ``qweight`` per expert, for GGUFMoEMethod;
# fp8 checkpoints: ``weight_scale`` to the experts' scales, ``input_scale`` ignored, as
# the experts are weight-only: Fp8CheckpointMoEMethod)
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)"
                         r"\.(weight|qweight|qweight_type|weight_scale|input_scale)$")
# transformers' own stacked layout: experts.gate_up_proj [E, 2I, H], experts.down_proj
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's gated shared expert)."""

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype,
                 quant: QuantizationConfig | None, tp: GroupCoordinator | None,
                 expert_parallel: bool, prefix: str) -> None:
        super().__init__()
        # The router stays dense and replicated: [E, H] is small and its top-k decides
        # which weights are read at all.
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False, dtype=dtype)
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.moe_intermediate_size, dtype,
                                scoring=cfg.scoring_func, renormalize=cfg.norm_topk_prob,
                                tp=tp, expert_parallel=expert_parallel, quant_config=quant,
                                prefix=f"{prefix}.experts")
        if cfg.shared_expert_intermediate_size:
            shared = dataclasses.replace(
                cfg, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert = LlamaMLP(shared, dtype, quant, tp, f"{prefix}.shared_expert")
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as LlamaMLP: (output, residual) of ``norm(x, residual)``."""
        h, residual = norm(x, residual)  # [T, H]
        out = self.experts(h, self.gate(h))
        if hasattr(self, "shared_expert"):
            s = self.shared_expert
            y = s.down_proj(s.act_fn(s.gate_up_proj(h)))
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * y
        return out, residual


class MoeDecoderLayer(nn.Module):
    mlp_name = "mlp"

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend,
                 rotary: RotaryEmbedding, quant: QuantizationConfig | None,
                 tp: GroupCoordinator | None, expert_parallel: bool, prefix: str,
                 index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, dtype, backend, rotary, quant, tp,
                                        f"{prefix}.self_attn")
        mlp_prefix = f"{prefix}.{self.mlp_name}"
        mlp = (SparseMoeBlock(cfg, dtype, quant, tp, expert_parallel, mlp_prefix)
               if cfg.is_moe_layer(index) else LlamaMLP(cfg, dtype, quant, tp, mlp_prefix))
        setattr(self, self.mlp_name, mlp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata):
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm,
                                          meta)
        return getattr(self, self.mlp_name)(hidden, residual, self.post_attention_layernorm)


class MoeModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend,
                 max_position: int, quant: QuantizationConfig | None,
                 tp: GroupCoordinator | None, pp: GroupCoordinator | None,
                 expert_parallel: bool, layer_cls: type[MoeDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(cfg.vocab_size, cfg.hidden_size, dtype, tp, quant,
                                           "model.embed_tokens")
        rotary = model_rotary(cfg, max_position)
        self.layers, self.start_layer, self.end_layer = make_layers(
            cfg.num_hidden_layers, pp,
            lambda i: layer_cls(cfg, dtype, backend, rotary, quant, tp, expert_parallel,
                                f"model.layers.{i}", i))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class QwenMoeForCausalLM(nn.Module):
    """Qwen2MoeForCausalLM and Qwen3MoeForCausalLM (the config says which parts exist)."""

    layer_cls = MoeDecoderLayer
    supports_expert_parallel = True

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend,
                 max_position: int, quant: QuantizationConfig | None = None,
                 tp: GroupCoordinator | None = None, pp: GroupCoordinator | None = None,
                 expert_parallel: bool = False) -> None:
        """``expert_parallel``: shard the experts whole over ``tp`` instead of slicing
        each expert's intermediate dimension."""
        super().__init__()
        self.config = cfg
        self.model = MoeModel(cfg, dtype, backend, max_position, quant, tp, pp,
                              expert_parallel, self.layer_cls)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = make_lm_head(cfg.vocab_size, cfg.hidden_size, dtype, tied, tp, quant)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in float32."""
        return self.lm_head(hidden).float()

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name in this model (Mixtral renames its MoE block)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by Hugging Face name; every parameter must be filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if "rotary_emb.inv_freq" in name or (
                    name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            if m := _PER_EXPERT.match(name):
                kind = _EXPERT_KINDS[m.group(3)]
                if m.group(4) == "input_scale":  # static W8A8 scales: weight-only experts
                    continue
                suffix = "_weight_scale" if m.group(4) == "weight_scale" else "_weight"
                target = f"{m.group(1)}.{'w2' if kind == 'w2' else 'w13'}{suffix}"
                if target in params:
                    params[target].weight_loader(params[target], tensor,
                                                 (int(m.group(2)), kind))
                    loaded.add(f"{target}:{int(m.group(2))}:{kind}")
                continue
            if m := _STACKED.match(name):
                kinds = ("w1", "w3") if m.group(2) == "gate_up_proj" else ("w2",)
                target = f"{m.group(1)}.{'w13' if len(kinds) == 2 else 'w2'}_weight"
                if target in params:
                    params[target].weight_loader(params[target], tensor,
                                                 (None, "w13" if len(kinds) == 2 else "w2s"))
                    loaded.update(f"{target}:{e}:{k}" for e in range(tensor.shape[0])
                                  for k in kinds)
                continue
            for merged, ckpt, shard in STACKED_PARAMS:
                if f".{ckpt}." in name:
                    target = name.replace(f".{ckpt}.", f".{merged}.")
                    if target in params:
                        params[target].weight_loader(params[target], tensor, shard)
                        loaded.add(f"{target}:{shard}")
                    break
            else:
                if name in params:
                    param = params[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                    loaded.add(name)
        self._check_complete(params, loaded)

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name.endswith(("experts.w13_weight", "experts.w2_weight",
                              "experts.w13_weight_scale", "experts.w2_weight_scale")):
                kinds = ("w2",) if ".experts.w2_" in name else ("w1", "w3")
                moe = self.get_submodule(name.rsplit(".", 1)[0])
                want = [f"{name}:{moe.expert_start + e}:{k}"
                        for e in range(moe.num_local_experts) for k in kinds]
                missing += [w for w in want if w not in loaded]
                continue
            merged = [s for m, _, s in STACKED_PARAMS if f".{m}." in name]
            if merged:
                missing += [f"{name}:{s}" for s in merged if f"{name}:{s}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} weights: {shown}")
