"""One pipeline stage's part of a forward pass (pipeline parallelism).

The first stage embeds the tokens, every stage runs its contiguous range of decoder
layers, and each stage but the last sends its hidden states and residual to the same
tensor-parallel rank of the next stage (point-to-point over the pipeline group); the last
stage applies the final norm and returns the hidden states for the logits. The model
file stays free of pipeline branches: this module drives its parts
(``embed_tokens``, ``layers[start_layer:end_layer]``, ``norm``), which every Llama-family
model in kvflow has.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.distributed.parallel_state import GroupCoordinator
from kvflow.layers.attention import AttentionMetadata


class PipelineStage:
    def __init__(self, model: nn.Module, pp: GroupCoordinator) -> None:
        self.model = model
        self.pp = pp
        self.hidden_size = model.config.hidden_size
        self.dtype = model.model.norm.weight.dtype

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor | None:
        """input_ids, positions [T] -> final hidden states [T, hidden] on the last stage,
        None on the others."""
        m, pp = self.model.model, self.pp
        t = input_ids.shape[0]
        if pp.is_first:
            hidden, residual = m.embed_tokens(input_ids), None  # [T, hidden]
        else:
            both = pp.recv((2, t, self.hidden_size), self.dtype, src=pp.rank_in_group - 1)
            hidden, residual = both[0], both[1]
        for layer in m.layers[m.start_layer:m.end_layer]:
            hidden, residual = layer(positions, hidden, residual, meta)
        if pp.is_last:
            hidden, _ = m.norm(hidden, residual)
            return hidden
        pp.send(torch.stack([hidden, residual]), dst=pp.rank_in_group + 1)  # [2, T, hidden]
        return None
