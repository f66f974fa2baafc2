"""Layers with a pure-torch reference forward and an optional fused-kernel forward."""

from __future__ import annotations

from torch import nn


class CustomOp(nn.Module):
    """``forward_native`` is the reference (CPU, tests); ``forward_kernel`` the fused GPU
    path. ``use_kernels`` picks one for the life of the model, so the hot path has no
    branches."""

    def __init__(self) -> None:
        super().__init__()
        self._impl = self.forward_native
        self.uses_kernels = False  # read by layers that fuse this op into their kernels

    def forward(self, *args, **kwargs):
        return self._impl(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_kernel(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def use_kernels(self, enabled: bool) -> None:
        self._impl = self.forward_kernel if enabled else self.forward_native
        self.uses_kernels = enabled


def use_kernels(model: nn.Module, enabled: bool) -> None:
    """Switch every CustomOp in ``model`` to its fused kernels (or back)."""
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.use_kernels(enabled)
