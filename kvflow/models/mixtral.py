"""Mixtral: Mistral's attention with a sparse MoE block (softmax top-2 over 8 experts,
always renormalized). Checkpoints name the block ``block_sparse_moe`` and its experts'
weights ``w1`` (gate), ``w3`` (up) and ``w2`` (down); transformers 5 saves its own
stacked layout under ``mlp.experts``, which loads too."""

from __future__ import annotations

import re

from kvflow.models.qwen_moe import MoeDecoderLayer, QwenMoeForCausalLM

_MLP = re.compile(r"^(model\.layers\.\d+)\.mlp\.")


class MixtralDecoderLayer(MoeDecoderLayer):
    mlp_name = "block_sparse_moe"


class MixtralForCausalLM(QwenMoeForCausalLM):
    layer_cls = MixtralDecoderLayer

    def checkpoint_name(self, name: str) -> str:
        return _MLP.sub(r"\1.block_sparse_moe.", name)
