"""Which decode row counts of a dense linear layer take the GEMV (``kvflow/kernels/gemv.py``).

Called once per layer after its weights are loaded (``UnquantizedLinearMethod``); the
answer is two dicts {M: GemvConfig} the layer keeps, so the hot path is one dict lookup
on a Python int. Empty (cuBLAS everywhere) off CUDA, with Triton disabled, for weights
that are not a contiguous bf16/fp16 [N, K], and wherever the table in ``gemv_config``
has no measured win.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from kvflow import envs

if TYPE_CHECKING:  # the tables (and Triton) load only where a layer plans its GEMVs
    from kvflow.kernels.gemv_config import GemvConfig

KINDS = ("linear", "silu_mul", "norm_linear", "norm_silu_mul")
# a layer without decode GEMV configurations (CPU, quantized, unmeasured shapes)
NO_GEMV: dict[str, dict] = {kind: {} for kind in KINDS}


def plan_gemv(layer: nn.Module) -> dict[str, dict[int, GemvConfig]]:
    """Per form ("linear": x W^T; "silu_mul": silu(gate) * up of a merged [gate; up]
    layer; "norm_*": the same with residual add + RMSNorm in the prologue), {M: config}."""
    from kvflow.kernels.gemv_config import dispatch_configs

    plan: dict[str, dict[int, GemvConfig]] = {kind: {} for kind in KINDS}
    w = getattr(layer, "weight", None)
    if (w is None or w.device.type != "cuda" or w.dim() != 2 or not w.is_contiguous()
            or envs.disable_triton()):
        return NO_GEMV
    mode = envs.gemv_mode()
    n, k = w.shape
    plan["linear"] = dispatch_configs("linear", n, k, w.dtype, w.device, mode)
    if getattr(layer, "bias", None) is None:  # the fused forms take no bias
        plan["norm_linear"] = dispatch_configs("norm_linear", n, k, w.dtype, w.device, mode)
        sizes = getattr(layer, "output_sizes", [])
        if len(sizes) == 2 and sizes[0] == sizes[1] and n == 2 * sizes[0]:
            for kind in ("silu_mul", "norm_silu_mul"):
                plan[kind] = dispatch_configs(kind, n // 2, k, w.dtype, w.device, mode)
    return plan if any(plan.values()) else NO_GEMV  # NO_GEMV: one identity test per call


def describe(model: nn.Module) -> str:
    """How many layers use the GEMV at batch 1 (a log line)."""
    counts = dict.fromkeys(KINDS, 0)
    for m in model.modules():
        for kind, configs in getattr(m, "gemv", {}).items():
            counts[kind] += 1 in configs
    return "decode GEMV layers at M=1 by form: " + ", ".join(f"{k} {v}" for k, v in
                                                             counts.items())
