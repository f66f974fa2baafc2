"""The LoRA wrapper of a linear layer: its quantization method object is wrapped so the
layer's output gains each row's adapter delta, ``y += (x A_s^T) B_s^T`` for the slot s
of the row's adapter (scale folded into B). The model files do not change.

A merged layer (qkv, gate_up) has one slice per projection, each with its own A/B and
rank; its A matrices are stacked along the rank so one shrink serves all slices.
Tensor parallelism: a column-parallel layer holds every input, so A is whole and B keeps
this rank's output rows; a row-parallel layer holds a slice of the inputs, so A keeps
those columns and the partial delta joins the partial output in the all-reduce the base
already does (the delta is linear in x).

Steps without adapter rows go straight to the base method (its fused decode paths);
steps with some, and CUDA graphs captured with LoRA, run the unfused path plus the
delta. The C++ CPU step computes the deltas itself from these slots (``LoRAWeights``'
tensors read in place, the step map's ``token_slot``; kvflow/cpu/step.py), so on the
CPU this wrapper serves only steps that run eager. The delta here:
on CUDA two launches per layer over all the step's rows (``kvflow.kernels.lora``:
``LoRAStepMap.tiles``, which CUDA graphs replay too): the shrink a dense GEMM over every
slot's A for steps of few rows over a long input (down_proj), else a segmented Triton
kernel, then a Triton expand; on the CPU a grouped matmul per adapter
(``LoRAStepMap.groups``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvflow.layers.linear import LinearBase, LinearMethod

if TYPE_CHECKING:
    from kvflow.kernels.lora import LoRATiles


@dataclass
class LoRAStepMap:
    """Which rows of the current step use which slot (set by the worker per step): as
    groups for the torch path, or as the kernels' tiles."""

    # (slot, rows, rank): rows a slice (one contiguous run) or an index tensor [n]
    groups: list[tuple[int, slice | torch.Tensor, int]] = field(default_factory=list)
    max_rank: int = 0
    # The C++ CPU step's inputs (kvflow/cpu/step.py), set with the groups on the CPU:
    # each row's slot ([T] int32, -1: the base model) and each slot's rank ([S] int32);
    # None when no row uses an adapter.
    token_slot: torch.Tensor | None = None
    slot_rank: torch.Tensor | None = None
    tiles: LoRATiles | None = None  # the Triton kernels' rows by slot (device buffers)

    @property
    def active(self) -> bool:
        return bool(self.groups) or self.tiles is not None


class LoRAWeights:
    """One layer's adapter slots.

    ``a``: [S, n_slices * R, in_local]; ``b[i]``: [S, out_i, R] for slice i, whose output
    columns are ``offsets[i]:offsets[i] + out_i`` of the layer's (local) output: a view
    of ``b_all`` [S, out, R], which the expand kernel reads in one launch.
    A slot of rank r < R is zero past r in both (``slots._Target.write``).
    """

    def __init__(self, in_features: int, out_sizes: list[int], num_slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.rank = rank
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.a = torch.zeros(num_slots, len(out_sizes) * rank, in_features, dtype=dtype,
                             device=device)
        self.b_all = torch.zeros(num_slots, sum(out_sizes), rank, dtype=dtype, device=device)
        self.b = [self.b_all[:, off:off + n] for off, n in zip(self.offsets, out_sizes)]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.a, self.b_all])


def add_lora_delta(x: torch.Tensor, y: torch.Tensor, w: LoRAWeights, step: LoRAStepMap
                   ) -> torch.Tensor:
    """y [T, out] += each adapter row's delta from x [T, in]; returns y.

    Per slot in the step: gather its rows, shrink by A (all slices at once, cut to the
    slot's rank), expand by each slice's B, add into the slice's columns: a segmented
    GEMM of one segment per adapter (the CPU's path). With ``step.tiles`` set, the
    Triton kernels do the same for every row in two launches."""
    if step.tiles is not None:
        from kvflow.kernels.lora import (lora_expand_add, lora_shrink, lora_shrink_dense,
                                         use_dense_shrink)

        if use_dense_shrink(x, w.a.shape[0]):  # few rows, long input: one GEMM, every slot's A
            xa = lora_shrink_dense(x, w.a)  # [T, S * n_slices * R]
            return lora_expand_add(y, xa, w.b_all, w.offsets, w.rank, step.tiles,
                                   dense=True)
        xa = lora_shrink(x, w.a, step.tiles)  # [T, n_slices * R] fp32
        return lora_expand_add(y, xa, w.b_all, w.offsets, w.rank, step.tiles)
    ns = len(w.b)
    for slot, rows, r in step.groups:
        xs = x[rows]  # [n, in]
        a = w.a[slot].view(ns, w.rank, -1)[:, :r]  # [ns, r, in]
        xa = torch.matmul(xs, a.transpose(1, 2))  # [ns, n, r]
        for i, (off, n) in enumerate(zip(w.offsets, w.out_sizes)):
            d = xa[i] @ w.b[i][slot, :, :r].T  # [n, out_i]
            if isinstance(rows, slice):
                y[rows, off:off + n] += d
            else:
                y[:, off:off + n].index_add_(0, rows, d)
    return y


class LoRALinearMethod(LinearMethod):
    """Wraps a layer's method: the base product, plus the delta on adapter rows."""

    def __init__(self, base: LinearMethod, weights: LoRAWeights, step: LoRAStepMap) -> None:
        self.base = base
        self.weights = weights
        self.step = step

    def __getattr__(self, name: str):  # attributes of the base method (its kernels' plans)
        if name in ("base", "weights", "step"):
            raise AttributeError(name)
        return getattr(self.base, name)

    def create_weights(self, layer: LinearBase, dtype: torch.dtype) -> None:
        self.base.create_weights(layer, dtype)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        self.base.process_weights_after_loading(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        y = self.base.apply(layer, x)
        if not self.step.active:
            return y
        # the delta stays in the activation dtype over any base (int4, FP8, GGUF)
        return add_lora_delta(x, y, self.weights, self.step)

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor,
                           act: nn.Module) -> torch.Tensor:
        if not self.step.active:
            return self.base.apply_silu_and_mul(layer, x, act)
        return act(layer(x))

    def apply_normed(self, layer: LinearBase, x: torch.Tensor,
                     residual: torch.Tensor | None, norm: nn.Module,
                     act: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.step.active:
            return self.base.apply_normed(layer, x, residual, norm, act)
        return LinearMethod.apply_normed(self, layer, x, residual, norm, act)

    def apply_mlp(self, layer: LinearBase, x: torch.Tensor, residual: torch.Tensor | None,
                  norm: nn.Module, act: nn.Module, down: LinearBase
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.step.active:
            return self.base.apply_mlp(layer, x, residual, norm, act, down)
        return LinearMethod.apply_mlp(self, layer, x, residual, norm, act, down)
