"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.layers.custom_op import CustomOp


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in float32, scale in the input dtype."""
    if x.dtype == torch.float32:  # the same math without the dtype round trips
        return weight * (x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_())
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(CustomOp):
    """``norm(x)``, or with a residual: ``r = x + residual; return norm(r), r``."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        x = x + residual
        return rms_norm_ref(x, self.weight, self.eps), x

    def forward_kernel(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        from kvflow.kernels.rms_norm import fused_add_rms_norm, rms_norm

        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
