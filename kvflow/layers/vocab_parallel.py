"""Vocabulary-parallel embedding and LM head: each TP rank holds a contiguous slice of
the vocabulary (the last slice padded with zero rows when the vocabulary does not divide).

The embedding looks up the ids of its slice, zeroes the rows of other ids and sums over
the ranks with one all-reduce; the LM head computes the logits of its slice and gathers
the slices so every rank has the full row (only rank 0 samples from it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.distributed.parallel_state import GroupCoordinator
from kvflow.errors import ModelLoadError


class _VocabShard:
    """Rows [start, end) of the vocabulary live on this rank, padded to ``rows``."""

    def __init__(self, vocab_size: int, tp: GroupCoordinator) -> None:
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.world_size)
        self.start = min(vocab_size, tp.rank_in_group * self.rows)
        self.end = min(vocab_size, self.start + self.rows)

    def make_weight(self, hidden_size: int, dtype: torch.dtype, loader) -> nn.Parameter:
        w = nn.Parameter(torch.zeros(self.rows, hidden_size, dtype=dtype),
                         requires_grad=False)
        w.output_dim, w.input_dim = 0, 1
        w.weight_loader = loader
        return w

    def load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.vocab_size \
                or loaded.shape[1] != param.shape[1]:
            raise ModelLoadError(f"weight shape {tuple(loaded.shape)} does not match the "
                                 f"model's ({self.vocab_size}, {param.shape[1]})")
        n = self.end - self.start
        param.data[:n].copy_(loaded[self.start:self.end])
        param.data[n:].zero_()


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.tp = tp or GroupCoordinator.single(torch.get_default_device())
        self.vocab_size = vocab_size
        self.shard = _VocabShard(vocab_size, self.tp)
        self.weight = self.shard.make_weight(hidden_size, dtype, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        self.shard.load(param, loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)  # [T] -> [T, hidden]
        s = self.shard
        outside = (input_ids < s.start) | (input_ids >= s.end)  # [T]
        local = (input_ids - s.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)  # [T, hidden]

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, rows [{self.shard.start}, {self.shard.end})"


class ParallelLMHead(nn.Module):
    """hidden -> logits over the whole vocabulary; shares the embedding's (sharded)
    weight when tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tied_to: VocabParallelEmbedding | None = None,
                 tp: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.tp = tp or GroupCoordinator.single(torch.get_default_device())
        self.vocab_size = vocab_size
        self.shard = _VocabShard(vocab_size, self.tp)
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = self.shard.make_weight(hidden_size, dtype, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        self.shard.load(param, loaded)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)  # [N, hidden] -> [N, vocab / tp]
        if self.tp.world_size == 1:
            return logits[:, :self.vocab_size] if logits.shape[1] != self.vocab_size \
                else logits
        return self.tp.all_gather(logits, dim=-1)[:, :self.vocab_size]  # [N, vocab]
