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


def _narrow_own_loaders(layer: LinearBase) -> None:
    """Parameters with a loader of their own (a quantization method's: GGUF block bytes,
    a checkpoint's metadata) receive this rank's slice of each checkpoint tensor too:
    the layer narrows it (``layer.narrow``) before their loader sees it. Parameters that
    load through the layer's ``weight_loader`` narrow there."""
    if layer.tp.world_size == 1:
        return
    for p in layer.parameters(recurse=False):
        own = getattr(p, "weight_loader", None)
        if own is None or isinstance(getattr(own, "__self__", None), nn.Module):
            continue  # a layer's own loader (this one's, or a tied embedding's) narrows

        def narrowed(param, loaded, shard_id=None, _own=own):
            return _own(param, layer.narrow(param, loaded, shard_id), shard_id)

        p.weight_loader = narrowed


def _check_groups(local: int, full: int, tp: int, quant: dict) -> None:
    """A row-parallel layer splits its inputs; quantization groups must not straddle the
    split (each rank's scales cover whole groups of its own inputs)."""
    config = quant.get("quant_config")
    if tp == 1 or config is None:
        return
    kind = config.method_for(quant.get("prefix", ""))
    group = config.group_size if kind in ("int4", "gptq", "awq", "compressed-tensors") \
        else 1
    if group > 0 and local % group:
        raise ModelLoadError(
            f"{quant.get('prefix') or 'a layer'}: {tp} tensor-parallel ranks would hold "
            f"{local} of its {full} inputs each, which is not a whole number of "
            f"{kind} groups of {group}; use a tensor-parallel size (or "
            f"--quantization-group-size) whose shards hold whole groups")


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
        _narrow_own_loaders(self)

    def _shard_index(self, shard_id: str | int | None) -> int:
        if shard_id is None:
            if len(self.output_sizes) != 1:
                raise ModelLoadError("a merged linear layer loads shard by shard")
            return 0
        if shard_id in self.shard_ids:
            return self.shard_ids.index(shard_id)
        raise ModelLoadError(f"unknown shard {shard_id!r} for a merged linear layer")

    def narrow(self, param: nn.Parameter, loaded: torch.Tensor,
               shard_id: str | int | None = None) -> torch.Tensor:
        """This rank's rows of the full checkpoint tensor of one shard."""
        dim = getattr(param, "output_dim", None)
        if dim is None or loaded.dim() == 0:  # per-tensor values: the same on every rank
            return loaded
        idx = self._shard_index(shard_id)
        pack = _packing(param, dim)
        if loaded.shape[dim] * pack != self.full_output_sizes[idx]:
            raise ModelLoadError(f"weight shape {tuple(loaded.shape)} does not match the "
                                 f"model's output size {self.full_output_sizes[idx]}")
        return loaded.narrow(dim, self.shard_starts[idx] // pack, self.output_sizes[idx] // pack)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:  # a per-tensor value (e.g. a scale): the same on every rank
            default_weight_loader(param, loaded)
            return
        idx = self._shard_index(shard_id)
        src = self.narrow(param, loaded, shard_id)
        dst = param.data.narrow(dim, sum(self.output_sizes[:idx]) // _packing(param, dim),
                                src.shape[dim])
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
        local = _divide(input_size, tp.world_size, "input size")
        _check_groups(local, input_size, tp.world_size, quant)
        super().__init__(local, [output_size], bias, dtype, quant_method, **quant)
        self.tp = tp
        self.full_input_size = input_size
        _set_default_dims(self)
        _narrow_own_loaders(self)

    def narrow(self, param: nn.Parameter, loaded: torch.Tensor,
               shard_id: str | int | None = None) -> torch.Tensor:
        """This rank's input columns of the full checkpoint tensor."""
        dim = getattr(param, "input_dim", None)
        if dim is None or loaded.dim() == 0:
            return loaded
        block = getattr(param, "input_block", 1)  # e.g. a GGUF block: never split
        if self.input_size % block:
            raise ModelLoadError(
                f"{self.prefix or 'a layer'}: each of the {self.tp.world_size} "
                f"tensor-parallel ranks would hold {self.input_size} of its "
                f"{self.full_input_size} inputs, not a whole number of the checkpoint's "
                f"{block}-element quantization blocks; use a tensor-parallel size that "
                f"keeps the blocks whole")
        pack = _packing(param, dim)
        size = self.input_size / pack if pack != 1 else param.shape[dim]
        if size != int(size) or loaded.shape[dim] != int(size) * self.tp.world_size:
            raise ModelLoadError(f"weight shape {tuple(loaded.shape)} does not match the "
                                 f"model's input size {self.full_input_size}")
        size = int(size)
        return loaded.narrow(dim, self.tp.rank_in_group * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is None:
            if param is self.bias and not self.tp.is_first:
                param.data.zero_()  # summed by the all-reduce: added once
                return
            default_weight_loader(param, loaded)
            return
        default_weight_loader(param.data, self.narrow(param, loaded))

    def row_max(self, local: torch.Tensor) -> torch.Tensor:
        """A per-output-row maximum over this rank's inputs [out] -> over all the inputs
        (so a per-channel quantization scale is the one of the whole row)."""
        return self.tp.all_reduce_max(local.contiguous())

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(y)  # partial [T, out] -> summed [T, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, in / tp] -> partial [T, out] -> summed [T, out]
        return self.reduce_output(self.quant_method.apply(self, x))
