"""The SiLU-and-multiply epilogue of the low-bit decode GEMVs (``gemv_w4.py``,
``gemv_w8.py``) for a merged [gate (d rows); up (d rows)] weight: a program computes gate
rows n*BN.. and the matching up rows d + n*BN.. and writes ``silu(gate) * up`` [M, d], so
the [M, 2d] intermediate and the separate ``silu_and_mul`` launch disappear (as the dense
``gemv_silu_and_mul`` does). Rounding follows the unfused path (``gemv._store_silu_mul``:
gate and up rounded to the output dtype, silu rounded, product rounded).

Split-K: each split writes its gate and up partials to a workspace [split_k, 2, M, d]; the
tile's last-arriving program adds them in order and stores (deterministic, in-launch,
counters reset by the kernel; ``woq_config.split_buffers``'s counters).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.gemv import _store_silu_mul
from kvflow.kernels.woq_config import LOCK_SLOTS, split_buffers


@triton.jit
def store_silu_pair(gate, up, out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, D, stride_om,
                    tile, pid_k, split_k, SPLIT: tl.constexpr):
    """gate, up [BM, BN] float32 partials -> silu(gate) * up in out [M, D]."""
    o_mask = (offs_m < M)[:, None] & (offs_n < D)[None, :]
    if SPLIT:  # workspace [split_k, 2, M, D]: this split's gate and up partials
        ws = ws_ptr + offs_m[:, None] * D + offs_n[None, :]
        tl.store(ws + pid_k * 2 * M * D, gate, mask=o_mask)
        tl.store(ws + (pid_k * 2 + 1) * M * D, up, mask=o_mask)
        tl.debug_barrier()  # every thread's partials are written before the release
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            g = tl.zeros_like(gate)
            u = tl.zeros_like(up)
            for j in range(0, split_k):  # .cg: read at L2, where the other SMs wrote
                g += tl.load(ws + j * 2 * M * D, mask=o_mask, other=0.0, cache_modifier=".cg")
                u += tl.load(ws + (j * 2 + 1) * M * D, mask=o_mask, other=0.0,
                             cache_modifier=".cg")
            _store_silu_mul(g, u, out_ptr, offs_m, offs_n, stride_om, o_mask)
            tl.atomic_xchg(lock_ptr + tile, 0)  # zero again for the next launch
    else:
        _store_silu_mul(gate, up, out_ptr, offs_m, offs_n, stride_om, o_mask)


def silu_buffers(config, m: int, d: int, device: torch.device
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(workspace float32 [split_k, 2, m, d], arrival counters) of a split-K SiLU launch,
    or (None, None)."""
    if config.split_k == 1:
        return None, None
    tiles = triton.cdiv(d, config.block_n)
    assert tiles <= LOCK_SLOTS, f"{tiles} output tiles for split-K (at most {LOCK_SLOTS})"
    ws = torch.empty((config.split_k, 2, m, d), dtype=torch.float32, device=device)
    return ws, split_buffers(config, m, d, device)[1]
