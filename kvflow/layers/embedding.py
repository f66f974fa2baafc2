"""Token embedding and the language-model head (optionally tied to it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [T] -> [T, hidden]


class LMHead(nn.Module):
    """hidden -> logits over the vocabulary; shares the embedding's weight when tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                       requires_grad=False)
            self.weight.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)  # [N, hidden] -> [N, vocab]
