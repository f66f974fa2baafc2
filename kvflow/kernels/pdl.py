"""Programmatic dependent launch (PDL) for the batch-1 decode kernels, with an optional L2
weight prefetch before the wait.

A batch-1 decode step on an 8B model is ~260 kernels replayed from one CUDA graph; every
one of them ramps up (launch, first loads in flight) and drains (the last programs
finishing while most SMs idle) on its own. With PDL (Hopper and later) a kernel launched
with the ``launch_pdl`` attribute may start while the previous kernel still runs: its
programs become resident once every program of the previous kernel has called
``griddepcontrol.launch_dependents`` (or exited), and they block in
``griddepcontrol.wait`` until the previous kernel has finished and its writes are
visible. Work that does not depend on the previous kernel can go before the wait: for a
GEMV that is the weight, so each program issues L2 prefetches of its first weight tiles
(``prefetch_tiles``), and the HBM keeps streaming through the previous kernel's tail
(a paged-attention launch at batch 1 is latency-bound and leaves the HBM mostly idle).
Measured on the H200 (docs/decode-gemv.md): PDL without the prefetch is even with plain
launches at GPU-A, every prefetched tile makes it slower, and launching the next kernel
at once (not in the tail) was slower too; so it is off by default.

The protocol every kernel launched with PDL follows (``pdl_enter``, or ``pdl_wait`` then
``pdl_trigger``):

* nothing before ``gdc_wait`` reads data another kernel writes or writes anything (a
  graph reuses buffers, so even a fresh output may still be read by the previous kernel);
  only reads of weights, which no kernel writes, may go there;
* every program calls ``gdc_wait``, before any early return, so a kernel's completion
  still implies its predecessor's (kernels further down wait only on their direct
  predecessor);
* ``gdc_launch_dependents``: right after the wait in the short kernels; after the main
  loop in the streaming ones (GEMVs, attention), so the next kernel's programs become
  resident, prefetch and wait only during this one's tail.

Kernels launched without the attribute (cuBLAS, torch ops) serialize as usual, so mixing
is safe. ``KVFLOW_PDL`` (``kvflow.envs.pdl_mode``) switches it: ``auto`` (default: on
where ``decode_defaults.MEASURED`` says it measured faster on this GPU), ``on``
(compute capability >= 9 with a Triton that has the intrinsics), ``off``. The decision
is made once per process, so every launch of a captured graph agrees with its capture.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3; CPU interpreter runs never take the PDL branches
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # pragma: no cover - old Triton
    gdc_launch_dependents = gdc_wait = None
    HAVE_GDC = False


@functools.lru_cache(maxsize=8)
def _enabled(index: int) -> bool:
    from kvflow import envs
    from kvflow.kernels.decode_defaults import switch_on

    on = switch_on(envs.pdl_mode(), "pdl", torch.device("cuda", index))
    return on and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` carry the PDL attribute (and wait inside); read
    once per device and process (``_enabled.cache_clear()`` re-reads the environment)."""
    if device.type != "cuda" or not HAVE_GDC:
        return False
    return _enabled(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=1)
def prefetch_tiles_default() -> int:
    """Weight tiles a GEMV program prefetches before its wait (``KVFLOW_PDL_PREFETCH``,
    else the GPU's measured default)."""
    from kvflow import envs
    from kvflow.kernels.decode_defaults import measured

    value = envs.pdl_prefetch_tiles()
    return measured()["pdl_prefetch"] if value is None else value


def launch_kw(pdl: bool) -> dict:
    """Extra launch keywords: ``launch_pdl`` only when on (the interpreter never sees it)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel, then let the next one launch at once: for the short
    kernels (rotary, norms, the merge), whose few programs leave most SMs free."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel (the streaming kernels; ``pdl_trigger`` comes later)."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """Let the next kernel launch: the streaming kernels call it after their main loop, so
    the next kernel's programs become resident in this one's tail only (launched at once,
    they took SM slots and prefetched weights that this kernel's stream evicted again:
    slower end to end on the H200, results/decode-levers-run1-h200.json)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """``prefetch.global.L2`` of every address in ``ptrs`` (a weight, read-only)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_tiles(w_ptr, rows_w, n_ok, t_start, t_end, BLOCK_K: tl.constexpr,
                   TILES: tl.constexpr):
    """Prefetch into L2 the first TILES [BN, BLOCK_K] weight tiles of K range
    [t_start, t_end) of rows ``rows_w`` (row offsets [BN, 1]): one address per 128 bytes."""
    LINE: tl.constexpr = 64  # bf16/fp16 elements per 128-byte line
    if BLOCK_K >= LINE:
        offs = tl.arange(0, BLOCK_K // LINE) * LINE  # [BK / 64]
        for i in tl.static_range(TILES):
            t = t_start + i
            ok = n_ok[:, None] & (t < t_end)
            ptrs = w_ptr + rows_w + (t * BLOCK_K + offs)[None, :]  # [BN, BK / 64]
            prefetch_l2(tl.where(ok, ptrs, w_ptr))
