"""Megatron-style tensor-parallel linear layers (DESIGN rule 6: parallelism lives here).

A column-parallel layer splits its output features over the TP ranks (each rank computes
its slice, no communication); a row-parallel layer splits its input features and sums
the partial products with one all-reduce. Attention puts QKV (split by heads) before o_proj
and the MLP puts gate/up before down_proj, so a decoder layer costs two all-reduces.

Each parameter's weight loader narrows the full checkpoint tensor to this rank's slice.
It reads the slicing dimensions from the parameter (``output_dim``, ``input_dim`` and,
for packed quantized weights, ``packed_dim``/``pack_factor``) so quantization methods'
parameters shard the same way; a dense weight is output_dim=0, input_dim=1. With a
one-rank group these layers are the plain ones: same shapes, no collectives. Extra
keyword arguments (the quantization config and prefix) pass through to LinearBase.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.distributed.parallel_state import GroupCoordinator
from kvflow.errors import ModelLoadError
from kvflow.layers.linear import LinearBase, LinearMethod, default_weight_loader


def _single_group() -> GroupCoordinator:
    return GroupCoordinator.single(torch.get_default_device())


def _set_default_dims(layer: nn.Module) -> None:
    """Dense weight [out, in] and bias [out] say which dims are which unless the
    quantization method already did."""
    for name, p in layer.named_parameters(recurse=False):
        if hasattr(p, "output_dim") or hasattr(p, "input_dim"):
            continue
        if name == "weight" and p.dim() == 2:
            p.output_dim, p.input_dim = 0, 1
        elif name == "bias" and p.dim() == 1:
            p.output_dim = 0


def _packing(param: nn.Parameter, dim: int) -> int:
    """How many logical elements one stored element holds along ``dim``."""
    return getattr(param, "pack_factor", 1) if getattr(param, "packed_dim", None) == dim else 1


def _divide(n: int, k: int, what: str) -> int:
    if n % k:
        raise ModelLoadError(f"{what} ({n}) is not divisible by the tensor-parallel size {k}")
    return n // k


class ColumnParallelLinear(LinearBase):
    """Output features split over the TP ranks: rank r holds rows
    ``[shard_starts[i], shard_starts[i] + output_sizes[i])`` of every shard i."""

    def __init__(self, input_size: int, full_output_sizes: list[int], bias: bool,
                 dtype: torch.dtype, quant_method: LinearMethod | None = None,
                 tp: GroupCoordinator | None = None,
                 shard_ids: list[str | int] | None = None,
                 local_sizes: list[int] | None = None,
                 shard_starts: list[int] | None = None, **quant) -> None:
        tp = tp or _single_group()
        if local_sizes is None:
            local_sizes = [_divide(s, tp.world_size, "output size") for s in full_output_sizes]
        if shard_starts is None:
            shard_starts = [tp.rank_in_group * n for n in local_sizes]
        super().__init__(input_size, local_sizes, bias, dtype, quant_method, shard_ids,
                         **quant)
        self.tp = tp
        self.full_output_sizes = list(full_output_sizes)
        self.shard_starts = list(shard_starts)
        _set_default_dims(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:  # a per-tensor value (e.g. a scale): the same on every rank
            default_weight_loader(param, loaded)
            return
        if shard_id is None:
            if len(self.output_sizes) != 1:
                raise ModelLoadError("a merged linear layer loads shard by shard")
            idx = 0
        elif shard_id in self.shard_ids:
            idx = self.shard_ids.index(shard_id)
        else:
            raise ModelLoadError(f"unknown shard {shard_id!r} for a merged linear layer")
        pack = _packing(param, dim)
        size = self.output_sizes[idx] // pack
        if loaded.shape[dim] * pack != self.full_output_sizes[idx]:
            raise ModelLoadError(f"weight shape {tuple(loaded.shape)} does not match the "
                                 f"model's output size {self.full_output_sizes[idx]}")
        src = loaded.narrow(dim, self.shard_starts[idx] // pack, size)
        dst = param.data.narrow(dim, sum(self.output_sizes[:idx]) // pack, size)
        default_weight_loader(dst, src)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v as one column-parallel GEMM split by attention heads. With more ranks than
    KV heads each rank keeps one KV head, shared (replicated) by tp / num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, dtype: torch.dtype, quant_method: LinearMethod | None = None,
                 tp: GroupCoordinator | None = None, **quant) -> None:
        tp = tp or _single_group()
        n, r = tp.world_size, tp.rank_in_group
        if num_heads % n or (num_kv_heads % n and n % num_kv_heads):
            raise ModelLoadError(f"{num_heads} attention heads and {num_kv_heads} KV heads "
                                 f"cannot be split over {n} tensor-parallel ranks")
        self.num_heads = num_heads // n  # this rank's
        self.num_kv_heads = max(1, num_kv_heads // n)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        kv_start = (r * num_kv_heads) // n * head_dim  # first KV head of this rank
        super().__init__(hidden_size,
                         [num_heads * head_dim, num_kv_heads * head_dim,
                          num_kv_heads * head_dim],
                         bias, dtype, quant_method, tp, shard_ids=["q", "k", "v"],
                         local_sizes=[self.q_size, self.kv_size, self.kv_size],
                         shard_starts=[r * self.q_size, kv_start, kv_start], **quant)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of one input (gate/up) as one column-parallel GEMM; each
    rank's output is [its slice of shard 0, its slice of shard 1, ...]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype, quant_method: LinearMethod | None = None,
                 tp: GroupCoordinator | None = None, **quant) -> None:
        super().__init__(input_size, output_sizes, bias, dtype, quant_method, tp, **quant)


class RowParallelLinear(LinearBase):
    """Input features split over the TP ranks; the partial outputs are summed with one
    all-reduce, so every rank ends with the full output. A bias is added once (rank 0
    holds it, the others hold zeros)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 quant_method: LinearMethod | None = None,
                 tp: GroupCoordinator | None = None, **quant) -> None:
        tp = tp or _single_group()
        super().__init__(_divide(input_size, tp.world_size, "input size"), [output_size],
                         bias, dtype, quant_method, **quant)
        self.tp = tp
        self.full_input_size = input_size
        _set_default_dims(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is None:
            if param is self.bias and not self.tp.is_first:
                param.data.zero_()  # summed by the all-reduce: added once
                return
            default_weight_loader(param, loaded)
            return
        size = param.shape[dim]
        if loaded.shape[dim] != size * self.tp.world_size:
            raise ModelLoadError(f"weight shape {tuple(loaded.shape)} does not match the "
                                 f"model's input size {self.full_input_size}")
        default_weight_loader(param.data,
                              loaded.narrow(dim, self.tp.rank_in_group * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, in / tp] -> partial [T, out] -> summed [T, out]
        return self.tp.all_reduce(self.quant_method.apply(self, x))
