"""Which decode row counts of a dense linear layer take the GEMV (``kvflow/kernels/gemv.py``).

Called once per layer after its weights are loaded (``UnquantizedLinearMethod``); the
answer is two dicts {M: GemvConfig} the layer keeps, so the hot path is one dict lookup
on a Python int. Empty (cuBLAS everywhere) off CUDA, with Triton disabled, for weights
that are not a contiguous bf16/fp16 [N, K], and wherever the table in ``gemv_config``
has no measured win.
"""

from __future__ import annotations

from torch import nn

from kvflow import envs
from kvflow.kernels.gemv_config import GemvConfig, dispatch_configs


def plan_gemv(layer: nn.Module) -> tuple[dict[int, GemvConfig], dict[int, GemvConfig]]:
    """(configs of the plain product, configs of the silu_and_mul-fused product) by M."""
    w = getattr(layer, "weight", None)
    if (w is None or w.device.type != "cuda" or w.dim() != 2 or not w.is_contiguous()
            or envs.disable_triton()):
        return {}, {}
    mode = envs.gemv_mode()
    n, k = w.shape
    plain = dispatch_configs("linear", n, k, w.dtype, w.device, mode)
    fused: dict[int, GemvConfig] = {}
    sizes = getattr(layer, "output_sizes", [])
    if (len(sizes) == 2 and sizes[0] == sizes[1] and getattr(layer, "bias", None) is None
            and n == 2 * sizes[0]):
        fused = dispatch_configs("silu_mul", n // 2, k, w.dtype, w.device, mode)
    return plain, fused


def describe(model: nn.Module) -> str:
    """How many layers use the GEMV at batch 1 (a log line)."""
    plain = fused = 0
    for m in model.modules():
        plain += 1 in getattr(m, "gemv_configs", {})
        fused += 1 in getattr(m, "gemv_silu_configs", {})
    return f"decode GEMV at M=1 in {plain} linear layers ({fused} with silu_and_mul fused)"
