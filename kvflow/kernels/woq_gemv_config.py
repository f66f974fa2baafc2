"""Launch configurations of the low-bit decode GEMVs (``gemv_w4.py``: int4 groups,
``gemv_w8.py``: int8 / FP8 per channel) and which row counts take them.

The CUDA quantized-linear paths (``layers/quantization/gpu.py`` for int4 / int8
weight-only, ``fp8.py`` for FP8) ask ``plan`` once per layer after the weights are
repacked; they get {M: config} for M = 1..8 and keep their previous path (the register
GEMV or tiled ``w4a16``/``w8a16`` kernels; ``torch._scaled_mm`` for FP8) for every
other M. ``KVFLOW_WOQ_GEMV`` (``kvflow.envs.woq_gemv_mode``) picks: ``off`` (the previous
paths everywhere), ``auto`` (default: the measured table's entries for this GPU, and
``default_config`` for shapes the table lacks, except int8, which keeps ``w8a16_gemm``
there, and the fused-SiLU forms, which stay unfused there; a bucket measured slower than the previous path, stored as None, keeps that path) or ``force`` (the new kernels at every
M <= 8: table config where there is one, else the heuristic).

The table is the ``woq_gemv`` part of the GPU's data file in ``kvflow/kernels/tuning/``
(written by ``benchmarks/gpu/bench_woq_gemv.py --write-tuning``); ``KVFLOW_TUNING_FILE``
overlays a fresh measurement (a bench result file) on it.

Table keys: (format, N, K) with format ``w4g<G>`` (int4, G inputs per group), ``int8``,
``fp8`` (the weight-dequant GEMV) or ``fp8a8`` (FP8 W8A8, ``gemv_fp8.py``; chosen by
``KVFLOW_FP8_DECODE``, see ``plan``; ``fp8a8-siluq``: gate/up + SiLU writing FP8 in
128-wide groups, ``fp8a8-xg``: down reading them), and ``<format>-silu`` for a merged
[gate; up] layer with SiLU-and-multiply in the epilogue (N = d, the output width); values
{M bucket (1, 2, 4, 8): config or None}.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

# The dense GEMV's dispatch bound, M buckets and SM count: the low-bit GEMVs take the same
# decode rows.
from kvflow.kernels.gemv_config import DISPATCH_MAX_M, _bucket, _sms, check_tile


@dataclass(frozen=True)
class WoqGemvConfig:
    """Tile sizes of one low-bit GEMV launch."""

    block_n: int
    """Weight rows (outputs) per program (the MMA's M side: 64 per warpgroup)."""
    block_k: int = 256
    """Inputs per K step (8-bit: bytes per row per step; int4 always steps by 256)."""
    split_k: int = 1
    """Programs sharing one output tile's K range (> 1: in-launch float32 reduction)."""
    num_warps: int = 4
    num_stages: int = 3
    deq: bool = False
    """int4: dequantize each plane to bf16 (one rounding per weight) before the dot
    instead of scaling the group's float32 partial sums."""
    xa: bool = False
    """8-bit: x as the MMA's first operand (16 rows: mma.sync from registers) and the
    converted weight as the second, instead of the weight first (wgmma at BN >= 64)."""
    promote: int = 0
    """``fp8a8`` (FP8 x FP8 on the tensor cores, ``gemv_fp8.py``): inputs the MMA sums in
    its reduced precision before a float32 promotion (``max_num_imprecise_acc``); 0: once
    per K step of ``block_k``."""
    rows: int = 0
    """Output rows a program owns, when fewer than ``block_n`` (0: ``block_n``), as
    ``GemvConfig.rows``: a grid of cdiv(N, rows) programs that fills the SMs evenly where
    N / block_n would leave some idle or a ragged last wave (qkv's 6144 rows: 96 tiles of
    64 on 132 SMs, or 131 programs of 47 rows in 64-row tiles); the tile's lanes past
    ``rows`` load and store nothing. Last field, so positional configs keep their
    meaning. Not for ``fp8a8-siluq``: its FP8 output is quantized per ``block_n``-wide
    group of the tile (``gemv_fp8`` refuses it)."""

    def __post_init__(self) -> None:
        check_tile(self)

    @property
    def tile_rows(self) -> int:
        """Output rows per program (``rows`` or the whole tile)."""
        return self.rows or self.block_n

    @property
    def block_m(self) -> int:
        """x rows of the MMA tile (``split_buffers`` counts output tiles with it)."""
        return 16

    @property
    def dot(self) -> bool:
        return True

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def default_config(fmt: str, m: int, n: int, k: int, device: torch.device,
                   sms: int | None = None) -> WoqGemvConfig:
    """``fmt`` ending in ``-silu``: the gate/up form, ``n`` = the output width d."""
    if fmt.endswith("-silu"):
        cfg = default_config(fmt.removesuffix("-silu"), m, n, k, device, sms)
        if not fmt.startswith("w4"):  # two 8-bit tiles of 256 spill on sm_90: 128
            cfg = replace(cfg, block_k=min(cfg.block_k, 128), promote=min(cfg.promote, 128))
        return cfg
    if fmt == "fp8a8-siluq":  # gate/up + SiLU with FP8 output: 128-wide groups, no split
        return WoqGemvConfig(128, 128, 1, 4, 4, promote=128)
    cfg = _default(fmt, m, n, k, device, sms)
    if fmt == "fp8a8":  # FP8 x FP8: a float32 promotion per 128 inputs (as _scaled_mm)
        cfg = replace(cfg, promote=min(128, cfg.block_k))
    return cfg


def _default(fmt: str, m: int, n: int, k: int, device: torch.device,
             sms: int | None) -> WoqGemvConfig:
    """The heuristic: 64-row tiles (one warpgroup), 256 inputs per step (int4: 128 B per
    row; 8-bit: 256 B), split-K until about two programs per SM so each SM has loads of
    a second program in flight while one converts (the weight is read once: nothing
    else keeps HBM busy). Picked from sm_90 builds (no spills; 3.2-3.8 SASS instructions
    per int4 weight and thread in the main loop against 7.3 for the register GEMV);
    ``bench_woq_gemv.py`` measures the rest."""
    sms = sms or _sms(device)
    bn, bk = 64, 256 if k >= 512 else max(16, triton.next_power_of_2(k) // 2)
    if fmt.startswith("w4"):
        bk = 256
    if fmt == "fp8a8-xg":  # x in 128-wide groups: one group per K step
        bk = 128
    tiles = triton.cdiv(n, bn)
    k_tiles = triton.cdiv(k, bk)
    split = 1
    if tiles < 2 * sms:
        split = max(1, min(triton.cdiv(2 * sms, tiles), k_tiles // 2, 16))
        split = triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))  # no split left empty
    # groups under 128 inputs: the scale-after form's per-group epilogue ([BN, 16] FMAs
    # per plane at G = 32) costs more than dequantizing each weight
    deq = fmt.startswith("w4g") and int(fmt[3:]) < 128
    return WoqGemvConfig(bn, bk, split, 4, 3 if fmt.startswith("w4") else 4, deq)


def device_table(tuning) -> dict[tuple[str, int, int], dict[int, WoqGemvConfig | None]]:
    """A device's measured table (``kvflow.kernels.tuning``) as {(format, N, K): {M bucket:
    config, or None where the previous path stays}} (configs written before a field
    existed lack it: its default)."""
    return {key: {m: None if c is None else WoqGemvConfig(**c) for m, c in buckets.items()}
            for key, buckets in tuning.woq_gemv.items()}


@functools.lru_cache(maxsize=16)
def _device_table(name: str, overrides: str | None = None) -> dict:
    from kvflow.kernels import tuning

    return device_table(tuning.for_device(name, overrides))


def plan(fmt: str, n: int, k: int, device: torch.device) -> dict[int, WoqGemvConfig]:
    """{M: config} for the row counts 1..DISPATCH_MAX_M that take the low-bit GEMV for a
    layer of format ``fmt`` (see the module docstring) and shape [N, K] on ``device``;
    empty off CUDA, with KVFLOW_WOQ_GEMV=off or KVFLOW_DISABLE_TRITON=1."""
    from kvflow import envs

    mode = envs.woq_gemv_mode()
    if mode == "off" or device.type != "cuda" or envs.disable_triton():
        return {}
    table = _device_table(torch.cuda.get_device_name(device), envs.tuning_file())
    buckets = table.get((fmt, n, k))
    if fmt.startswith("fp8a8"):
        # FP8 W8A8 decode rows follow KVFLOW_FP8_DECODE: ``auto`` only where the table
        # measured them faster than the weight-dequant GEMV; ``w8a8`` everywhere
        fp8_mode = envs.fp8_decode_mode()
        if fp8_mode == "dequant" or (fp8_mode == "auto" and buckets is None):
            return {}
        mode = "force" if fp8_mode == "w8a8" else "auto"
    if buckets is None and mode == "auto" and (fmt.startswith("int8") or fmt.endswith("-silu")):
        # int8 per channel: w8a16_gemm beat this kernel at every 8B shape on the H200, so
        # an unmeasured shape keeps it; the fused SiLU form measured level with GEMM +
        # silu_and_mul there (and its end-to-end run was not faster), so it too runs only
        # where a table measured a win (force still takes both)
        return {}
    out = {}
    for m in range(1, DISPATCH_MAX_M + 1):
        if buckets is not None and _bucket(m) in buckets:
            cfg = buckets[_bucket(m)]
            if cfg is None and mode == "force":
                cfg = default_config(fmt, m, n, k, device)
        else:
            cfg = default_config(fmt, m, n, k, device)
        if cfg is not None:
            out[m] = cfg
    return out
