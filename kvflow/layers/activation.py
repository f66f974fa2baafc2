"""SiLU-and-multiply on the merged gate/up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.layers.custom_op import CustomOp


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim -> silu(gate) * up.  # [..., 2d] -> [..., d]"""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_ref(x)

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        from kvflow.kernels.silu_and_mul import silu_and_mul

        return silu_and_mul(x)
