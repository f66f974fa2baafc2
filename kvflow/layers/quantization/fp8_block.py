"""Block-wise FP8 (E4M3) W8A8, DeepSeek-style: one float32 scale per R x G weight block
(128 x 128), activations quantized dynamically with one scale per 1 x G slice of a token.

Layer format: ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` float32
[ceil(N / R), ceil(K / G)] with ``w[n, k] = weight[n, k] * weight_scale_inv[n // R, k // G]``
(the ``_inv`` is the checkpoints' name for the multiplier that dequantizes).

* ``--quantization fp8-block`` on a float checkpoint: each dense weight (merged layers as
  one [N, K]) is quantized once at load in 128 x 128 blocks, ``s = max|block| / 448``.
* Pre-quantized checkpoints: the ``fp8`` quantization_config with ``weight_block_size``
  (``weight`` + ``weight_scale_inv`` per block) and compressed-tensors ``float-quantized``
  with the ``block`` strategy (``weight`` + ``weight_scale``, ``block_structure``). Each
  shard of a merged layer (q, k, v; gate, up) brings its own blocks: when every shard's
  row count is a multiple of R they stack as they are; otherwise (small test models)
  each output row gets its block's scales (R = 1), which the kernel reads the same way.

The product sums each K group in float32, scales it by the group's activation scale and
the block's weight scale, and adds the groups: ``fp8_gemm`` (Triton; the activations are
quantized inside it at small M, by ``quantize_fp8`` above) on FP8 GPUs, ``fp8_gemm_ref``
on the CPU (emulated, logged), which gives the same numbers up to the summation order.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.errors import ModelLoadError
from kvflow.layers.linear import LinearBase, LinearMethod, set_param
from kvflow.layers.quantization.fp8 import (FP8_MAX, _check_device, load_fp8_weight,
                                            log_emulated, shard_rows, use_fp8_kernels)
from kvflow.layers.quantization.packed import flatten_tokens
from kvflow.layers.quantization.rtn import _QuantizeAfterLoad

DEFAULT_BLOCK = (128, 128)
BLOCK_INPUTS = (32, 64, 128, 256)  # G: the kernel's K step (a power of two, >= the dot's 32)


def check_block(block: tuple[int, int], where: str) -> tuple[int, int]:
    """A weight block size [rows, inputs] the kernels take, or a ModelLoadError."""
    try:
        r, g = (int(v) for v in block)
    except (TypeError, ValueError):
        raise ModelLoadError(f"{where}: weight_block_size must be two integers [rows, "
                             f"inputs], got {block!r}") from None
    if r < 1 or g not in BLOCK_INPUTS:
        raise ModelLoadError(f"{where}: weight_block_size {[r, g]} is not supported (rows "
                             f">= 1, inputs one of {list(BLOCK_INPUTS)}; DeepSeek's is "
                             f"[128, 128])")
    return r, g


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], float32 [ceil(N / R), ceil(K / G)])."""
    r, g = block
    n, k = w.shape
    nb, kb = -(-n // r), -(-k // g)
    wp = torch.nn.functional.pad(w.float(), (0, kb * g - k, 0, nb * r - n))
    blocks = wp.view(nb, r, kb, g)
    s = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [Nb, Kb]
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (blocks / s[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).view(nb * r, kb * g)
    return q[:n, :k].to(torch.float8_e4m3fn), s


def block_apply(layer: LinearBase, block: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N] through the layer's block-scaled FP8 weight."""
    # (kernel modules imported here: Triton reads TRITON_INTERPRET when they load)
    from kvflow.kernels.fp8_gemm import fp8_gemm_ref
    from kvflow.kernels.fp8_quant import quantize_fp8_ref

    x2, lead = flatten_tokens(x)  # [M, K]
    if use_fp8_kernels(x2.device):
        from kvflow.kernels.fp8_gemm import fp8_linear

        y = fp8_linear(x2 if x2.stride(-1) == 1 else x2.contiguous(), layer.weight,
                       layer.weight_scale_inv, block)
    else:
        log_emulated(x2.device)
        xq, sx = quantize_fp8_ref(x2, block[1])  # [M, K], [M, Kb]
        y = fp8_gemm_ref(xq, sx, layer.weight, layer.weight_scale_inv, block, x.dtype)
    if layer.bias is not None:
        y = y + layer.bias
    return y.view(*lead, -1)


class Fp8BlockLinearMethod(_QuantizeAfterLoad):
    """``--quantization fp8-block``: the float weight quantized in blocks at load."""

    name = "fp8-block"

    def __init__(self, block: tuple[int, int] = DEFAULT_BLOCK) -> None:
        self.block = check_block(block, "fp8-block")

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        w = self._take_dense(layer)  # [N, K]
        _check_device(layer, w)
        q, scale = quantize_fp8_blocks(w, self.block)
        set_param(layer, "weight", q)
        set_param(layer, "weight_scale_inv", scale)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return block_apply(layer, self.block, x)


class Fp8BlockCheckpointLinearMethod(LinearMethod):
    """Pre-quantized block FP8: ``weight`` float8_e4m3fn [N, K] and a scale per block,
    named ``scale_name`` in the checkpoint (``weight_scale_inv`` in the fp8 layout,
    ``weight_scale`` in compressed-tensors)."""

    name = "fp8-block"

    def __init__(self, block: tuple[int, int], scale_name: str) -> None:
        self.ckpt_block = check_block(block, "fp8 checkpoint")
        self.scale_name = scale_name

    def create_weights(self, layer: LinearBase, dtype: torch.dtype) -> None:
        n, k = layer.output_size, layer.input_size
        r, g = self.ckpt_block
        # Shards that do not start on a block boundary: every row holds its block's scales.
        rows = r if all(s % r == 0 for s in layer.output_sizes) else 1
        self.block = (rows, g)
        w = nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
        w.weight_loader = lambda p, t, shard=None: load_fp8_weight(layer, p, t, shard)
        w.output_dim, w.input_dim = 0, 1
        layer.register_parameter("weight", w)
        s = nn.Parameter(torch.empty(-(-n // rows), -(-k // g), dtype=torch.float32),
                         requires_grad=False)
        s.weight_loader = lambda p, t, shard=None: self._load_scale(layer, p, t, shard)
        s.output_dim, s.input_dim = 0, 1
        layer.register_parameter(self.scale_name, s)

    def _load_scale(self, layer, param, t: torch.Tensor, shard) -> None:
        start, size = shard_rows(layer, shard)
        r, g = self.ckpt_block
        want = (-(-size // r), -(-layer.input_size // g))
        if tuple(t.shape) != want:
            raise ModelLoadError(
                f"{layer.prefix}: {self.scale_name} has shape {tuple(t.shape)}; a "
                f"{size}x{layer.input_size} weight in blocks of {r}x{g} needs {want}")
        t = t.float()
        rows = self.block[0]
        if rows == 1:  # each row takes its block's scales
            t = t.repeat_interleave(r, 0)[:size]
        param.data.narrow(0, start // rows, t.shape[0]).copy_(t)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        _check_device(layer, layer.weight)
        s = getattr(layer, self.scale_name)
        if self.scale_name != "weight_scale_inv":  # one name for apply
            delattr(layer, self.scale_name)
            set_param(layer, "weight_scale_inv", s.data)
        if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
            raise ModelLoadError(f"{layer.prefix}: {self.scale_name} must be positive and "
                                 f"finite")

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return block_apply(layer, self.block, x)
