"""int8 and int4 weight-only quantization at load (round to nearest) from float weights.

The layer first loads its dense checkpoint weight as usual (so merged q/k/v and gate/up
shards and tensor-parallel slicing work unchanged), then ``process_weights_after_loading``
quantizes it once and replaces it with the packed form the kernels read: the CPU's
(``packed.py``) or, for weights on CUDA, the Triton kernels' (``gpu.py``).
"""

from __future__ import annotations

import torch

from kvflow.errors import ModelLoadError
from kvflow.layers.linear import LinearBase, UnquantizedLinearMethod, set_param
from kvflow.layers.quantization import gpu
from kvflow.layers.quantization.packed import (CPU_ACT_DTYPE, PackedInt4, flatten_tokens,
                                               int4_mm, int8_mm, quantize_int4,
                                               quantize_int8, refine_top_logits)


class _QuantizeAfterLoad(UnquantizedLinearMethod):
    """Dense weight while loading; subclasses replace it after."""

    triton: gpu.TritonWeight | None = None
    """Set after loading when the weights went to the GPU kernels."""

    def _take_dense(self, layer: LinearBase) -> torch.Tensor:
        w = layer.weight.data  # [N, K] (for a tied head: the embedding's own weight)
        delattr(layer, "weight")  # the tied embedding keeps its parameter
        return w

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor, act) -> torch.Tensor:
        """Decode rows of a GPU weight-only gate/up layer: the low-bit GEMV with SiLU in
        its epilogue (``gpu.triton_silu_and_mul``); everything else unfused."""
        if self.triton is not None:
            y = gpu.triton_silu_and_mul(layer, self.triton, x)
            if y is not None:
                return y
        return act(layer(x))


class Int8LinearMethod(_QuantizeAfterLoad):
    """Symmetric int8 per output channel; ``aten._weight_int8pack_mm`` on CPU."""

    name = "int8"

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        dtype = layer.weight.dtype
        w = self._take_dense(layer)
        amax = w.float().abs().amax(-1)  # [N]
        if hasattr(layer, "row_max"):  # a row split over tensor-parallel ranks
            amax = layer.row_max(amax)
        q, scale = quantize_int8(w, amax)
        if gpu.use_triton(q.device):
            self.triton = gpu.repack_int8_channel(layer, q, scale, dtype)
            return
        set_param(layer, "qweight", q)  # int8 [N, K]
        set_param(layer, "scales", scale.to(CPU_ACT_DTYPE))  # [N]

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if self.triton is not None:
            # float32 accumulation, scaled per channel: no top-logit refinement needed
            return gpu.triton_apply(layer, self.triton, x)
        x2, lead = flatten_tokens(x)
        y = int8_mm(x2, layer.qweight, layer.scales)
        if layer.bias is not None:
            y = y + layer.bias
        if layer.prefix == "lm_head":  # exact top logits (see refine_top_logits)
            y = refine_top_logits(x2, y, lambda ids: layer.qweight[ids].float()
                                  * layer.scales[ids].float()[:, None])
        return y.view(*lead, -1)


class Int4LinearMethod(_QuantizeAfterLoad):
    """Group-wise int4 (symmetric or with a zero point per group);
    ``aten._weight_int4pack_mm_for_cpu`` on CPU."""

    name = "int4"

    def __init__(self, group_size: int, symmetric: bool) -> None:
        self.group_size = group_size
        self.symmetric = symmetric

    def create_weights(self, layer: LinearBase, dtype: torch.dtype) -> None:
        if layer.input_size % self.group_size:
            raise ModelLoadError(f"int4 group size {self.group_size} does not divide the "
                                 f"{layer.input_size} inputs of {layer.prefix or 'a layer'}; "
                                 f"use --quantization-group-size 32 or 64")
        super().create_weights(layer, dtype)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        dtype = layer.weight.dtype
        w = self._take_dense(layer)
        groups = quantize_int4(w, self.group_size, self.symmetric)
        if gpu.use_triton(w.device):
            del w  # the dense weight goes before the packed one is built (8B: 117 MB)
            self.triton = gpu.repack_groups(layer, groups, dtype, groups.values.device)
            return
        packed = PackedInt4(groups)
        for name, t in packed.tensors().items():
            set_param(layer, name, t)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if self.triton is not None:
            return gpu.triton_apply(layer, self.triton, x)
        x2, lead = flatten_tokens(x)
        y = int4_mm(x2, layer.qweight, layer.scales_and_zeros, self.group_size, False)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*lead, -1)
