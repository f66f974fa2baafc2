"""Token embedding and the language-model head (optionally tied to it).

Both take their storage from the model's ``QuantizationConfig`` by prefix: the embedding
through an embedding method (``create_weights``, ``embedding``,
``process_weights_after_loading``), the head as a linear layer with its linear method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.layers.linear import LinearBase, default_weight_loader, linear_method_for

if TYPE_CHECKING:
    from kvflow.layers.quantization import QuantizationConfig


class UnquantizedEmbeddingMethod:
    """A dense table [vocab, hidden] in the model dtype."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.vocab_size, layer.hidden_size,
                                                dtype=dtype), requires_grad=False)
        layer.weight.weight_loader = default_weight_loader
        layer.weight.output_dim, layer.weight.input_dim = 0, 1

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None = None,
                 prefix: str = "model.embed_tokens") -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.quant_method = UnquantizedEmbeddingMethod() if quant_config is None \
            else quant_config.embedding_method(prefix)
        self.quant_method.create_weights(self, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.quant_method.embedding(self, input_ids)  # [T] -> [T, hidden]


class LMHead(LinearBase):
    """hidden -> logits over the vocabulary; shares the embedding's weight when tied (a
    quantized head makes its own packed copy of it after loading)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tied_to: VocabEmbedding | None = None,
                 quant_config: QuantizationConfig | None = None,
                 prefix: str = "lm_head") -> None:
        tied_blocks = tied_to is not None and not hasattr(tied_to, "weight")
        method = linear_method_for(quant_config, prefix, tied_to if tied_blocks else None)
        super().__init__(hidden_size, [vocab_size], False, dtype, method, prefix=prefix)
        if tied_to is not None and not tied_blocks:
            self.weight = tied_to.weight  # the same Parameter: loaded once, by the embedding

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, hidden)  # [N, hidden] -> [N, vocab]
