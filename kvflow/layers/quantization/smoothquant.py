"""INT8 W8A8: weights int8 per output channel, activations int8 per token (dynamic), one
``torch._int_mm`` per linear (``int8_gemm.py``).

Two sources of weights, one layer format (``weight`` int8 [N, K], ``weight_scale``
float32 [N], ``w = weight * weight_scale[:, None]``):

* ``--quantization w8a8-int8`` on a float checkpoint: each dense weight is quantized once
  at load, without smoothing (SmoothQuant's alpha = 0), so the smoothing's benefit can be
  measured against it;
* a checkpoint written by ``kvflow quantize --method smoothquant`` (config.json
  ``quantization_config.quant_method: "smoothquant"``, docs/quantization.md): the
  per-channel smoothing factors are folded into the preceding RMSNorm weights (qkv,
  gate_up) and linears (v_proj rows for o_proj, up_proj rows for down_proj) before the
  weights were quantized, so the model computes exactly the float model's function and
  these layers multiply as above. A layer listed in ``smooth_inputs`` (a fold that was
  not possible or not asked for) also carries ``input_smooth`` float32 [K] (= 1 / s) and
  multiplies its input by it before quantizing.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.errors import ModelLoadError
from kvflow.layers.linear import LinearBase, LinearMethod, set_param
from kvflow.layers.quantization.int8_gemm import Int8Weight, prepare_weight, w8a8_apply
from kvflow.layers.quantization.packed import flatten_tokens
from kvflow.layers.quantization.rtn import _QuantizeAfterLoad
from kvflow.layers.quantization.int8_gemm import quantize_int8_rows


def _apply(layer: LinearBase, w: Int8Weight, x: torch.Tensor) -> torch.Tensor:
    x2, lead = flatten_tokens(x)  # [M, K]
    smooth = getattr(layer, "input_smooth", None)
    if smooth is not None:  # the explicit per-channel activation scale (no fold)
        x2 = x2 * smooth
    y = w8a8_apply(x2, w, x.dtype)
    if layer.bias is not None:
        y = y + layer.bias
    return y.view(*lead, -1)


class Int8W8A8LinearMethod(_QuantizeAfterLoad):
    """``--quantization w8a8-int8``: the float weight quantized per output channel at
    load; activations quantized per token at each call."""

    name = "w8a8-int8"
    w: Int8Weight | None = None

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        wd = self._take_dense(layer)  # [N, K]
        if hasattr(layer, "row_max"):  # a row split over tensor-parallel ranks
            amax = layer.row_max(wd.float().abs().amax(-1))
            scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
            q = torch.round(wd.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        else:
            q, scale = quantize_int8_rows(wd)
        set_param(layer, "weight", q)  # int8 [N, K]: counted by weight memory
        set_param(layer, "weight_scale", scale)
        self.w = prepare_weight(layer.weight.data, layer.weight_scale.data,
                                layer.prefix or "a layer")

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return _apply(layer, self.w, x)


class Int8W8A8CheckpointLinearMethod(LinearMethod):
    """Pre-quantized int8 W8A8 weights (a SmoothQuant checkpoint): ``weight`` int8 [N, K],
    ``weight_scale`` [N] (or [N, 1]), and ``input_smooth`` [K] when ``smooth_input``."""

    name = "w8a8-int8"
    w: Int8Weight | None = None

    def __init__(self, smooth_input: bool) -> None:
        self.smooth_input = smooth_input

    def create_weights(self, layer: LinearBase, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        w = nn.Parameter(torch.empty(n, k, dtype=torch.int8), requires_grad=False)
        w.weight_loader = lambda p, t, shard=None: self._load_weight(layer, p, t, shard)
        w.output_dim, w.input_dim = 0, 1
        layer.register_parameter("weight", w)
        s = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        s.weight_loader = lambda p, t, shard=None: self._load_scale(layer, p, t, shard)
        s.output_dim = 0
        layer.register_parameter("weight_scale", s)
        if self.smooth_input:
            m = nn.Parameter(torch.empty(k, dtype=dtype), requires_grad=False)
            m.weight_loader = lambda p, t, shard=None: self._load_smooth(layer, p, t, shard)
            m.input_dim = 0
            layer.register_parameter("input_smooth", m)

    def _load_weight(self, layer: LinearBase, param, t: torch.Tensor, shard) -> None:
        if t.dtype != torch.int8:
            raise ModelLoadError(f"{layer.prefix}: W8A8 checkpoint weight has dtype "
                                 f"{t.dtype} (a smoothquant checkpoint stores int8)")
        layer.weight_loader(param, t, shard)

    def _load_scale(self, layer: LinearBase, param, t: torch.Tensor, shard) -> None:
        size = layer.output_size if shard is None else layer.output_sizes[
            layer.shard_ids.index(shard)]
        if t.dim() == 2 and t.shape[1] == 1:
            t = t[:, 0]
        if tuple(t.shape) != (size,):
            raise ModelLoadError(
                f"{layer.prefix}: weight_scale{'' if shard is None else f' ({shard})'} has "
                f"shape {tuple(t.shape)}; an int8 W8A8 layer takes one scale per output "
                f"channel: ({size},) or ({size}, 1)")
        layer.weight_loader(param, t.float(), shard)

    def _load_smooth(self, layer: LinearBase, param, t: torch.Tensor, shard) -> None:
        if tuple(t.shape) != (param.shape[0],) and not hasattr(layer, "full_input_size"):
            raise ModelLoadError(f"{layer.prefix}: input_smooth has shape {tuple(t.shape)}, "
                                 f"the layer has {param.shape[0]} inputs")
        if shard is not None and getattr(layer, "_smooth_loaded", False):
            # Merged shards share their input, so they must share its smoothing.
            if not torch.equal(param.data, t.to(param.dtype)):
                raise ModelLoadError(f"{layer.prefix}: merged shards have different "
                                     f"input_smooth vectors")
            return
        layer.weight_loader(param, t.to(param.dtype))
        layer._smooth_loaded = True

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        smooth = getattr(layer, "input_smooth", None)
        if smooth is not None and (not bool(torch.isfinite(smooth).all())
                                   or bool((smooth <= 0).any())):
            raise ModelLoadError(f"{layer.prefix}: input_smooth must be positive and finite")
        self.w = prepare_weight(layer.weight.data, layer.weight_scale.data,
                                layer.prefix or "a layer")

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return _apply(layer, self.w, x)
