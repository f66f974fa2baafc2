"""Vocabulary-parallel embedding and LM head: each TP rank holds a contiguous slice of
the vocabulary (the last slice padded with zero rows when the vocabulary does not divide).

The embedding looks up the ids of its slice, zeroes the rows of other ids and sums over
the ranks with one all-reduce; the LM head computes the logits of its slice and gathers
the slices so every rank has the full row (only one rank samples from it).

Quantized storage plugs in as for the one-rank layers: the embedding takes an embedding
method and the head a linear method from the model's QuantizationConfig, and every
checkpoint tensor is cut to this rank's rows (padded) before the method's loader sees it,
so a GGUF table's blocks, or an int8 head quantized after loading, cover the slice only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.distributed.parallel_state import GroupCoordinator
from kvflow.errors import ModelLoadError
from kvflow.layers.embedding import LMHead, VocabEmbedding
from kvflow.layers.linear import LinearBase, default_weight_loader, linear_method_for


class _VocabShard:
    """Rows [start, end) of the vocabulary live on this rank, padded to ``rows``."""

    def __init__(self, vocab_size: int, tp: GroupCoordinator) -> None:
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.world_size)
        self.start = min(vocab_size, tp.rank_in_group * self.rows)
        self.end = min(vocab_size, self.start + self.rows)

    def narrow(self, loaded: torch.Tensor) -> torch.Tensor:
        """The full checkpoint table [vocab, ...] -> this rank's rows [rows, ...], zero
        rows after the vocabulary's end (0-d metadata passes unchanged)."""
        if loaded.dim() == 0:
            return loaded
        if loaded.shape[0] != self.vocab_size:
            raise ModelLoadError(f"weight shape {tuple(loaded.shape)} does not match the "
                                 f"model's vocabulary of {self.vocab_size}")
        part = loaded[self.start:self.end]
        if part.shape[0] == self.rows:
            return part
        pad = torch.zeros((self.rows - part.shape[0], *part.shape[1:]), dtype=part.dtype,
                          device=part.device)
        return torch.cat([part, pad])

    def make_weight(self, hidden_size: int, dtype: torch.dtype, loader) -> nn.Parameter:
        w = nn.Parameter(torch.zeros(self.rows, hidden_size, dtype=dtype),
                         requires_grad=False)
        w.output_dim, w.input_dim = 0, 1
        w.weight_loader = loader
        return w

    def load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dim() != 2 or loaded.shape[1] != param.shape[1]:
            raise ModelLoadError(f"weight shape {tuple(loaded.shape)} does not match the "
                                 f"model's ({self.vocab_size}, {param.shape[1]})")
        default_weight_loader(param, self.narrow(loaded))


def _narrow_loaders(module: nn.Module, shard: _VocabShard) -> None:
    """Quantization methods' own loaders get this rank's rows of each tensor."""
    for p in module.parameters(recurse=False):
        own = getattr(p, "weight_loader", None)
        if own is None or isinstance(getattr(own, "__self__", None), nn.Module):
            continue  # a layer's own loader (this one's, or a tied embedding's) narrows

        def narrowed(param, loaded, shard_id=None, _own=own):
            return _own(param, shard.narrow(loaded), shard_id)

        p.weight_loader = narrowed


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp: GroupCoordinator | None = None, quant_config=None,
                 prefix: str = "model.embed_tokens") -> None:
        super().__init__()
        self.tp = tp or GroupCoordinator.single(torch.get_default_device())
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.shard = _VocabShard(vocab_size, self.tp)
        self.quant_method = None  # dense table
        kind = "none" if quant_config is None else quant_config.method_for(prefix)
        if kind == "none":
            self.weight = self.shard.make_weight(hidden_size, dtype, self.weight_loader)
            return
        self.num_rows = self.shard.rows  # the method's table: this rank's rows
        self.quant_method = quant_config.embedding_method(prefix)
        self.quant_method.create_weights(self, dtype)
        _narrow_loaders(self, self.shard)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        self.shard.load(param, loaded)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is None:
            return F.embedding(ids, self.weight)
        return self.quant_method.embedding(self, ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(input_ids)  # [T] -> [T, hidden]
        s = self.shard
        outside = (input_ids < s.start) | (input_ids >= s.end)  # [T]
        local = (input_ids - s.start).masked_fill(outside, 0)
        out = self._lookup(local).masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)  # [T, hidden]

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, rows [{self.shard.start}, {self.shard.end})"


class ParallelLMHead(LinearBase):
    """hidden -> logits over the whole vocabulary; shares the embedding's (sharded)
    weight when tied. A linear layer over this rank's rows of the vocabulary, stored as
    the quantization config says for ``lm_head`` (dense without one)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tied_to: VocabParallelEmbedding | None = None,
                 tp: GroupCoordinator | None = None, quant_config=None,
                 prefix: str = "lm_head") -> None:
        tp = tp or GroupCoordinator.single(torch.get_default_device())
        shard = _VocabShard(vocab_size, tp)
        tied_blocks = tied_to is not None and not hasattr(tied_to, "weight")
        method = linear_method_for(quant_config, prefix, tied_to if tied_blocks else None)
        super().__init__(hidden_size, [shard.rows], False, dtype, method, prefix=prefix)
        self.tp = tp
        self.shard = shard
        self.vocab_size = vocab_size
        if tied_to is not None and not tied_blocks:
            self.weight = tied_to.weight  # the same Parameter: loaded once, by the embedding
        elif hasattr(self, "weight"):
            self.weight.data.zero_()  # padded rows stay zero
        _narrow_loaders(self, shard)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        self.shard.load(param, loaded)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden)  # [N, hidden] -> [N, vocab / tp]
        if self.tp.world_size == 1:
            return logits[:, :self.vocab_size] if logits.shape[1] != self.vocab_size \
                else logits
        return self.tp.all_gather(logits, dim=-1)[:, :self.vocab_size]  # [N, vocab]


def make_embedding(vocab_size: int, hidden_size: int, dtype, tp, config, prefix: str):
    """The token embedding: vocabulary-parallel (dense, or stored as its method says when
    split over several ranks), or on one rank the embedding whose storage its method
    picks."""
    if config is None or (tp is not None and tp.world_size > 1):
        return VocabParallelEmbedding(vocab_size, hidden_size, dtype, tp, config, prefix)
    return VocabEmbedding(vocab_size, hidden_size, dtype, config, prefix)


def make_lm_head(vocab_size: int, hidden_size: int, dtype, tied_to, tp, config):
    """The lm_head, tied to ``tied_to`` when given; quantized as the config says, and
    vocabulary-parallel over several ranks."""
    if config is None or (tp is not None and tp.world_size > 1):
        return ParallelLMHead(vocab_size, hidden_size, dtype, tied_to=tied_to, tp=tp,
                              quant_config=config)
    return LMHead(vocab_size, hidden_size, dtype, tied_to=tied_to, quant_config=config)
