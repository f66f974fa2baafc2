"""Linear layers whose parameters know how to load themselves (docs/architecture.md rule 6).

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``. Merged
layers (QKV as one GEMM, gate/up as one GEMM) place each checkpoint tensor into its
slice of the merged weight. Quantization plugs in as a method object (``create_weights``,
``apply``, ``process_weights_after_loading``), chosen by module prefix from the model's
``QuantizationConfig`` (``kvflow.layers.quantization``); the models never branch on it.

Every parameter a method creates says how it lies: ``output_dim`` and ``input_dim`` (which
tensor dimension is the layer's output / input), and for packed tensors ``packed_dim`` and
``pack_factor`` (logical elements per stored element along it). Merged shards are placed
along ``output_dim``, and tensor-parallel slicing can read the same attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.errors import ModelLoadError
from kvflow.kernels.gemv_dispatch import NO_GEMV

if TYPE_CHECKING:
    from kvflow.layers.quantization import QuantizationConfig



def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape."""
    if param.shape != loaded.shape:
        raise ModelLoadError(f"weight shape {tuple(loaded.shape)} does not match the "
                             f"model's parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def set_param(layer: nn.Module, name: str, t: torch.Tensor) -> None:
    """Register ``t`` as a frozen parameter (so weight memory counts it): how a method
    replaces a layer's dense weight with its packed form after loading."""
    if hasattr(layer, name):
        delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(t, requires_grad=False))


class LinearMethod:
    """How a linear layer stores and applies its weight (the quantization hook)."""

    def create_weights(self, layer: "LinearBase", dtype: torch.dtype) -> None:
        raise NotImplementedError

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        pass

    def apply_silu_and_mul(self, layer: "LinearBase", x: torch.Tensor,
                           act: nn.Module) -> torch.Tensor:
        """``act(layer(x))`` for a merged [gate; up] layer; a method with a fused form
        (the activation in the GEMM's epilogue) overrides it. The unfused path calls the
        module, so its forward hooks (SmoothQuant calibration) still see the input."""
        return act(layer(x))

    def apply_normed(self, layer: "LinearBase", x: torch.Tensor,
                     residual: torch.Tensor | None, norm: nn.Module,
                     act: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``h, r = norm(x, residual)`` (without a residual: ``r = x``, ``h = norm(x)``),
        then this layer (and ``act``) on h -> (output, r). A method that folds the norm
        into its GEMM overrides it."""
        if residual is None:
            h, r = norm(x), x
        else:
            h, r = norm(x, residual)
        y = layer(h) if act is None else self.apply_silu_and_mul(layer, h, act)
        return y, r  # (layer(h): through the module, so its forward hooks fire)


    def apply_mlp(self, layer: "LinearBase", x: torch.Tensor, residual: torch.Tensor | None,
                  norm: nn.Module, act: nn.Module, down: "LinearBase"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """A gated MLP from this merged [gate; up] layer: ``h, r = norm(x, residual)``,
        then ``down(act(layer(h)))`` -> (output, r). A method that hands its activation
        to ``down`` in a form of its own (FP8 with group scales) overrides it."""
        h, r = layer.forward_normed(x, residual, norm, act)
        return down(h), r


class UnquantizedLinearMethod(LinearMethod):
    """A dense weight [out_features, in_features] in the model dtype; y = x W^T + b."""

    def create_weights(self, layer: "LinearBase", dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size, dtype=dtype),
                              requires_grad=False)
        weight.weight_loader = layer.weight_loader
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)
        # per fused form, decode row counts M -> GEMV config where it beats cuBLAS
        # (kvflow/kernels/gemv_dispatch.py; set after loading, empty off CUDA)
        layer.gemv = NO_GEMV
        # CPU: the C++ step's float32 GEMV (x, weight, bias) -> y for up to 16 rows, set
        # on a dense lm_head by cpu/step.py once its self-check has passed.
        layer.cpu_gemv = None
        # --deterministic on CUDA: the batch-invariant matmul (x, weight, bias) -> y for
        # every row count (kvflow/kernels/batch_invariant.py), set by use_batch_invariant
        layer.bi_matmul = None

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        from kvflow.kernels.gemv_dispatch import plan_gemv

        layer.gemv = plan_gemv(layer)

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        bi = layer.bi_matmul
        if bi is not None:  # --deterministic: one reduction order whatever M is
            return bi(x, layer.weight, layer.bias)
        fn = getattr(layer, "cpu_gemv", None)
        if fn is not None and x.dim() == 2 and x.shape[0] <= 16 and x.dtype == torch.float32:
            return fn(x, layer.weight, layer.bias)
        plan = layer.gemv  # NO_GEMV itself on CPU and wherever nothing was planned
        cfg = plan["linear"].get(x.shape[0]) if plan is not NO_GEMV and x.dim() == 2 else None
        if cfg is not None:  # decode batch on CUDA (kvflow/kernels/gemv.py)
            from kvflow.kernels.gemv import gemv

            return gemv(x, layer.weight, layer.bias, cfg)
        return F.linear(x, layer.weight, layer.bias)

    def apply_silu_and_mul(self, layer: "LinearBase", x: torch.Tensor,
                           act: nn.Module) -> torch.Tensor:
        plan = layer.gemv
        cfg = plan["silu_mul"].get(x.shape[0]) if plan is not NO_GEMV and x.dim() == 2 else None
        if cfg is not None:  # one launch: gate/up GEMV with silu(gate) * up as epilogue
            from kvflow.kernels.gemv import gemv_silu_and_mul

            return gemv_silu_and_mul(x, layer.weight, cfg)
        return act(layer(x))

    def apply_normed(self, layer: "LinearBase", x: torch.Tensor,
                     residual: torch.Tensor | None, norm: nn.Module,
                     act: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
        plan = layer.gemv
        kind = "norm_linear" if act is None else "norm_silu_mul"
        cfg = plan[kind].get(x.shape[0]) if plan is not NO_GEMV and x.dim() == 2 else None
        if cfg is not None and getattr(norm, "uses_kernels", False):
            # one launch: residual add + RMSNorm folded into the GEMV (kvflow/kernels/gemv_norm.py)
            from kvflow.kernels.gemv_norm import gemv_rms_norm

            return gemv_rms_norm(x, residual, norm.weight, norm.eps, layer.weight, cfg,
                                 silu_and_mul=act is not None)
        return super().apply_normed(layer, x, residual, norm, act)


def linear_method_for(quant_config: "QuantizationConfig | None", prefix: str,
                      tied_to=None) -> LinearMethod:
    """The method of the layer named ``prefix``: its config's (``tied_to``: the embedding
    a tied lm_head shares), or the unquantized one without a config."""
    return UnquantizedLinearMethod() if quant_config is None \
        else quant_config.linear_method(prefix, tied_to)


def use_batch_invariant(model: nn.Module) -> tuple[int, list[str]]:
    """``--deterministic`` on CUDA: every dense linear layer (the lm_head included) runs
    the batch-invariant matmul for any row count, and its decode GEMV plans are dropped
    (their split-K and fused norm sum in another order than the GEMM, docs/determinism.md).
    Returns (layers switched, names of linear layers of other methods, which are not)."""
    from kvflow.kernels.batch_invariant import matmul

    switched, others = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        method = module.quant_method
        base = getattr(method, "base", method)  # a LoRA wrapper's base method
        if type(base) is UnquantizedLinearMethod:
            module.gemv = NO_GEMV
            module.bi_matmul = matmul
            switched += 1
        else:
            others.append(name)
    return switched, others


class LinearBase(nn.Module):
    """y = x W^T (+ b). ``output_sizes`` splits the output into independently loaded
    shards (one entry for a plain layer)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype, quant_method: LinearMethod | None = None,
                 shard_ids: list[str | int] | None = None, *,
                 quant_config: "QuantizationConfig | None" = None, prefix: str = "") -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.shard_ids = shard_ids or list(range(len(output_sizes)))
        self.prefix = prefix
        if quant_method is None:
            quant_method = linear_method_for(quant_config, prefix)
        self.quant_method = quant_method
        self.quant_method.create_weights(self, dtype)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size, dtype=dtype),
                                     requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.output_dim = 0
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded)
            return
        if shard_id not in self.shard_ids:
            raise ModelLoadError(f"unknown shard {shard_id!r} for a merged linear layer")
        idx = self.shard_ids.index(shard_id)
        start = sum(self.output_sizes[:idx])
        size = self.output_sizes[idx]
        dim = getattr(param, "output_dim", 0)
        if getattr(param, "packed_dim", None) == dim:  # e.g. zero points packed along N
            start, size = start // param.pack_factor, size // param.pack_factor
        default_weight_loader(param.data.narrow(dim, start, size), loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """This layer's output from what its method computed on this rank: ``y`` itself; a
        row-parallel layer sums the ranks' partials. Paths that compute a layer's product
        outside ``forward`` (``apply_mlp``) finish with it."""
        return y

    def forward_silu_and_mul(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """``act(self(x))`` where this layer is a merged [gate; up] projection and ``act``
        SiLU-and-multiply: the seam for the fused decode GEMV (no communication, so for
        column-parallel layers only)."""
        return self.quant_method.apply_silu_and_mul(self, x, act)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm: nn.Module, act: nn.Module | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h, r = norm(x, residual)`` then ``self(h)`` (``act(self(h))`` with ``act``)
        -> (output, r): the seam for the decode GEMV with the residual add and RMSNorm in
        its prologue (no communication, so for column-parallel layers only)."""
        return self.quant_method.apply_normed(self, x, residual, norm, act)

    def forward_mlp(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module,
                    act: nn.Module, down: "LinearBase") -> tuple[torch.Tensor, torch.Tensor]:
        """This merged [gate; up] layer and ``down`` as a gated MLP: ``(down(act(self(
        norm(x, residual)))), r)``; the seam for decode rows whose activation goes from
        the gate/up GEMV's epilogue to the down GEMV quantized (FP8)."""
        return self.quant_method.apply_mlp(self, x, residual, norm, act, down)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """A plain linear layer."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 quant_method: LinearMethod | None = None, **quant) -> None:
        super().__init__(input_size, [output_size], bias, dtype, quant_method, **quant)


class QKVLinear(LinearBase):
    """q, k and v projections as one GEMM; loads shards 'q', 'k', 'v'."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, dtype: torch.dtype,
                 quant_method: LinearMethod | None = None, **quant) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias, dtype,
                         quant_method, shard_ids=["q", "k", "v"], **quant)


class MergedLinear(LinearBase):
    """Several projections of the same input as one GEMM (gate/up); shards 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype, quant_method: LinearMethod | None = None,
                 **quant) -> None:
        super().__init__(input_size, output_sizes, bias, dtype, quant_method, **quant)
