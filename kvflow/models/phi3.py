"""Phi-3 / Phi-3.5 (Phi3ForCausalLM): Llama's stack (windowed when the config sets
``sliding_window``, longrope scaling in layers/rotary.py) with q/k/v and gate/up fused
in the checkpoint. The fused tensors are split by name here and load shard by shard
into the same merged GEMMs as Llama's separate ones."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvflow.errors import ModelLoadError
from kvflow.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """qkv_proj [(H + 2 KVH) D, hidden] -> q/k/v_proj; gate_up_proj [2 I, hidden] ->
        gate/up_proj (rows in that order in the checkpoint)."""
        cfg = self.config
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        for name, tensor in weights:
            if ".self_attn.qkv_proj." in name:
                parts, names = (q, kv, kv), ("q_proj", "k_proj", "v_proj")
                fused = "qkv_proj"
            elif ".mlp.gate_up_proj." in name:
                parts = (cfg.intermediate_size,) * 2
                names, fused = ("gate_proj", "up_proj"), "gate_up_proj"
            else:
                yield name, tensor
                continue
            if tensor.dim() == 0:  # a GGUF matrix's type tag: the same for each part
                for part in names:
                    yield name.replace(f".{fused}.", f".{part}."), tensor
                continue
            if tensor.shape[0] != sum(parts):
                raise ModelLoadError(f"{name} has {tensor.shape[0]} rows, expected "
                                     f"{sum(parts)} for this config")
            for piece, part in zip(tensor.split(list(parts), dim=0), names):
                yield name.replace(f".{fused}.", f".{part}."), piece
