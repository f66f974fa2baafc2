"""Host memory for a CPU engine: how large its KV cache may be (what the machine has
available), and zero-filled tensors that cost no memory until written."""

from __future__ import annotations

import math
import mmap

import torch

from kvflow.config import GiB
from kvflow.errors import OutOfMemoryError
from kvflow.logger import init_logger

logger = init_logger(__name__)

CPU_DEFAULT_KV_BYTES = 4 * GiB


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor in its own anonymous mapping: no memset at startup and no
    resident memory until used, and zero whatever allocator the process runs with."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)  # the tensor keeps a reference to the mapping
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def available_host_memory() -> int | None:
    """Bytes of memory the OS can still give without swapping (Linux MemAvailable), or
    None where that is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_kv_budget(requested: int | None) -> int:
    """The CPU KV cache budget: ``requested`` (--kv-cache-memory) if the machine has that
    much memory available, else an error; by default 4 GiB, or half of what is available
    when that is less (the cache is committed as it fills, and an over-committed cache
    would get the process killed mid-run instead of refused at start)."""
    available = available_host_memory()
    if requested is None:
        if available is not None and available // 2 < CPU_DEFAULT_KV_BYTES:
            logger.warning("only %.2f GiB of memory available: the KV cache gets half of it "
                           "(set --kv-cache-memory to choose)", available / GiB)
            return available // 2
        return CPU_DEFAULT_KV_BYTES
    if available is not None and requested > available:
        raise OutOfMemoryError(
            f"--kv-cache-memory asks for {requested / GiB:.2f} GiB but only "
            f"{available / GiB:.2f} GiB of memory is available; lower --kv-cache-memory")
    return requested
