"""Launch configurations shared by the weight-only GEMM kernels (``w4a16_gemm``,
``w8a16_gemm``): which path a given M takes, the tile sizes and the split-K factor.

Two paths, picked from the number of activation rows M (tokens in the step):

- **decode, M <= 8** (``split-K GEMV``): the weight is read once and nothing else moves,
  so the kernel must keep every SM busy streaming it. N / BLOCK_N column tiles alone are
  too few programs (N = 4096 with BLOCK_N = 64 is 64 programs for 132 SMs), so the K
  loop is split over ``split_k`` programs as well; each writes its float32 partial sums
  to a workspace slice and the tile's last program (an arrival counter) adds them and
  stores the output, all in the one launch (``store_output``). int8 pads the M
  rows to 16 for ``tl.dot`` (tensor cores are idle at this size anyway); int4 takes
  the register GEMV (``dot=False``: broadcast multiply-add in float32, ``tl.sum``).
- **GEMM, M > 8** (prefill, large batches): int8 runs classic tiles, the weight tile
  converted in registers and fed to ``tl.dot`` (split-K only when the output tiles
  cannot fill the SMs); int4 dequantizes the whole weight into the activation dtype and
  calls cuBLAS (``dequant``): by traffic its Triton tiles should lose to it at every M
  (their H200 figures: 0.22-0.35x bf16 cuBLAS at M = 16 and 256).

Everything is decided from shapes (Python ints): no host synchronisation, so the launch
can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DECODE_MAX_M = 8


@dataclass(frozen=True)
class WoqConfig:
    """Tile sizes of one weight-only GEMM launch."""

    block_m: int
    """Activation rows per program (>= 16 when ``dot``)."""
    block_n: int
    """Output columns per program."""
    block_k: int
    """Inputs per K step (a power of two; nested with the group size either way). The
    int4 kernel always steps by its packing's 256 and reads this only for split sizing."""
    split_k: int = 1
    """Programs sharing one output tile's K loop (> 1: float32 atomics + a cast)."""
    dot: bool = True
    """tl.dot on tensor cores; False: the register GEMV (broadcast multiply, float32
    sums, ``tl.sum``; block_m at most ``DECODE_MAX_M``)."""
    num_warps: int = 4
    num_stages: int = 3
    scale_after: bool = True
    """int4: scale each plane's float32 partial sums (few rows) instead of dequantizing
    every weight before the dot (many rows)."""
    dequant: bool = False
    """int4: dequantize the whole weight into x's dtype (``int4_dequant``) and multiply
    with cuBLAS instead of running a Triton tile (the tile sizes are then unused)."""

    def __post_init__(self) -> None:
        for v in (self.block_m, self.block_n, self.block_k):
            if v & (v - 1):
                raise ValueError(f"tile sizes must be powers of two: {self}")
        if self.dot and min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError(f"tl.dot tiles must be at least 16: {self}")
        if not self.dot and self.block_m > DECODE_MAX_M:
            raise ValueError(f"the register GEMV path takes at most {DECODE_MAX_M} rows per "
                             f"program: {self}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1: {self}")


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached: a host query, no sync)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small shapes, exercise split-K a little
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def choose_config(m: int, n: int, k: int, device: torch.device, bits: int,
                  sms: int | None = None) -> WoqConfig:
    """The launch configuration for x [m, k] @ W[n, k]^T with ``bits``-bit weights.

    Hopper sizing: a decode tile of 64 outputs x 256 int4 inputs is 8 KiB (int8: 64 x
    128, 8 KiB), loaded as 16 contiguous bytes per thread, three stages deep. Splits aim
    at about 4 programs per SM so the HBM queue stays full (4.8 TB/s needs many
    outstanding loads). ``sms`` overrides the device's multiprocessor count."""
    sms = sms or _sms(device)
    # Picked from sm_90 builds (ptxas register and shared-memory use, no spills); the
    # speed on the H200 is for benchmarks/gpu/bench_woq.py --sweep to settle.
    dot = True
    if bits == 4:  # 256-input tiles (8 nibble planes)
        bk = 256
        if m <= DECODE_MAX_M:
            # The register GEMV: the first (tl.dot) decode ran at 0.35 TB/s on the H200,
            # bound by the per-plane conversions into the dot's operand layout. Rows are
            # padded to a power of two; more rows per program shrink BN so the per-row
            # float32 partials stay in registers.
            dot, bm = False, triton.next_power_of_2(m)
            bn, warps, stages = (64, 4, 3) if bm <= 2 else (32, 4, 3)
        else:
            # Dequantize + cuBLAS: the Triton GEMM below (still there for explicit
            # configs) ran at 0.22-0.35x bf16 cuBLAS at M = 16 and 256 on the H200; the
            # dense weight costs 2.5 bytes per weight once, then the GEMM runs at cuBLAS
            # speed (see int4_dequant).
            bm = max(16, min(128, triton.next_power_of_2(m)))
            bn, warps, stages = (64, 8 if bm == 16 else 4, 2) if bm <= 64 else (128, 8, 2)
            return WoqConfig(bm, bn, bk, 1, True, warps, stages, scale_after=bm <= 16,
                             dequant=True)
    else:
        bk = 128 if m <= DECODE_MAX_M else 64
        if m <= DECODE_MAX_M:
            bm, bn, warps, stages = 16, 64, 4, 3
        elif m <= 64:
            bm, bn, warps, stages = max(16, triton.next_power_of_2(m)), 64, 4, 4
        else:
            bm, bn, warps, stages = 128, 128, 8, 3
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    k_tiles = triton.cdiv(k, bk)
    split = 1
    target = 4 * sms if m <= DECODE_MAX_M else sms
    if tiles < target:
        # at least 2 K tiles per split, so each program still streams a few tiles
        split = max(1, min(triton.cdiv(target, tiles), k_tiles // 2, 16))
        split = triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))  # no split left empty
    return WoqConfig(bm, bn, bk, split, dot, warps, stages, scale_after=bm <= 16)


LOCK_SLOTS = 4096  # output tiles of one split-K launch (splits need tiles < 4 per SM)
_locks: dict[torch.device, torch.Tensor] = {}


def split_buffers(cfg: WoqConfig, m: int, n: int, device: torch.device
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(workspace float32 [split_k, m, n], per-tile arrival counters) of a split-K launch,
    or (None, None). The workspace needs no zeroing (each split writes its own slice
    before the tile's last program reads them all), and the counters are zeroed once
    and reset by the kernel, so a launch adds no memset or cast kernel and captures in
    a CUDA graph (the counters are allocated by the first, uncaptured, warm-up call)."""
    if cfg.split_k == 1:
        return None, None
    # a decode GEMV's balanced rows (GemvConfig.rows, WoqGemvConfig.rows): a program
    # (and its arrival counter) per that many output rows; the GEMMs' WoqConfig has none
    rows = getattr(cfg, "rows", 0) or cfg.block_n
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, rows)
    assert tiles <= LOCK_SLOTS, f"{tiles} output tiles for split-K (at most {LOCK_SLOTS})"
    locks = _locks.get(device)
    if locks is None:
        locks = _locks[device] = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=device)
    return torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=device), locks


@triton.jit
def store_output(acc, out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_om, tile,
                 pid_k, split_k, SPLIT: tl.constexpr):
    """Write a program's [BM, BN] float32 sums: directly, or (split-K) into its slice of
    the workspace, the tile's last-arriving program then adding the slices in order and
    storing the result (deterministic: the sum order does not depend on arrival)."""
    o_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT:
        ws = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws + pid_k * M * N, acc, mask=o_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros_like(acc)
            for j in range(0, split_k):  # .cg: read at L2, where the other SMs wrote
                total += tl.load(ws + j * M * N, mask=o_mask, other=0.0, cache_modifier=".cg")
            tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=o_mask)
            tl.atomic_xchg(lock_ptr + tile, 0)  # zero again for the next launch
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
