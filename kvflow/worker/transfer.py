"""Host-to-device copies that never block the host on queued GPU work.

A plain ``tensor.to("cuda")`` from pageable memory synchronizes the stream, so the CPU
would wait for the step in flight; staging through pinned memory with ``non_blocking``
keeps the copy in stream order instead. PyTorch's caching host allocator keeps a pinned
buffer alive until its copy has run, so the buffers can be dropped right away.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(data, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A numpy array or list as a tensor on ``device`` (async on CUDA)."""
    array = np.asarray(data)
    host = torch.from_numpy(np.ascontiguousarray(array))
    if host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host
    pinned = torch.empty(host.shape, dtype=dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor to pinned host memory; read it after an event."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
