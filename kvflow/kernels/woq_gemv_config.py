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

``KVFLOW_WOQ_GEMV_TABLE`` names a ``benchmarks/gpu/bench_woq_gemv.py`` result whose
``table`` replaces the built-in entries it has (a fresh measurement on this machine).

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

# The dense GEMV's dispatch bound, M buckets, SM count and table overlay: the low-bit GEMVs
# take the same decode rows and keep their tables the same way.
from kvflow.kernels.gemv_config import (DISPATCH_MAX_M, _bucket, _sms, check_tile,
                                        overlay_table)


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


def _c(bn: int, bk: int, split: int, warps: int, stages: int, deq: bool = False,
       xa: bool = False, promote: int = 0, rows: int = 0) -> WoqGemvConfig:
    return WoqGemvConfig(bn, bk, split, warps, stages, deq, xa, promote, rows)


# Measured tables: device-name token -> {(format, N, K): {M bucket: config or None}}; each
# entry the best config of a benchmarks/gpu/bench_woq_gemv.py sweep where it beat the
# format's previous path by >= 2 % (comment: its speed-up over that path), None where the
# previous path stays.
#
# H200: the woq-gemv stage at b861354 (results/woq-gemv-bench-h200.json; 40 s of sweep on
# M = 1, 8-18 configs per shape there; M = 2/4/8 mostly the heuristic). int4: 1.05-1.23x
# the register GEMV at M = 1 and 1.3-6.7x at M = 2-8 (which no longer collapses with M);
# FP8: 1.2-2.2x the quantize + _scaled_mm path at every M; int8: w8a16_gemm (mma.sync
# with x as the first operand) stays faster than the weight-first wgmma form everywhere.
#
# H100: the woq-gemv stage at 390faf4 (results/woq-gemv-bench-h100.json; 40 s of sweep, one
# config per shape: the H200's, re-timed against the H100's previous paths). GPU-A in the
# same call: int4 g128 318.1 tokens/s with it against 279.9 without (bf16 177.6), FP8 W8A8
# 250.1 against 181.2 (the dequant path); results/gpu-a-woq-*-h100.json.
MEASURED: dict[str, dict[tuple[str, int, int], dict[int, WoqGemvConfig | None]]] = {
    "H200": {
        # qkv w4g128
        ('w4g128', 6144, 4096): {
            1: _c(64, 256, 4, 4, 3, False),  # x1.15
            2: _c(64, 256, 3, 4, 3, False),  # x1.29
            4: _c(64, 256, 3, 4, 3, False),  # x2.21
            8: _c(64, 256, 3, 4, 3, False),  # x4.69
        },
        # qkv fp8
        ('fp8', 6144, 4096): {
            1: _c(64, 256, 1, 4, 4, False),  # x1.59
            2: _c(64, 256, 1, 4, 4, False),  # x1.54
            4: _c(64, 256, 1, 4, 3, False),  # x1.52
            8: _c(64, 256, 3, 4, 4, False),  # x1.09
        },
        # qkv int8
        ('int8', 6144, 4096): {
            1: None,  # x0.82 the previous path
            2: None,  # x0.59 the previous path
            4: None,  # x0.76 the previous path
            8: None,  # x0.59 the previous path
        },
        # o w4g128
        ('w4g128', 4096, 4096): {
            1: _c(64, 256, 4, 4, 3, False),  # x1.05
            2: _c(64, 256, 4, 4, 3, False),  # x1.39
            4: _c(64, 256, 4, 4, 3, False),  # x2.39
            8: _c(64, 256, 4, 4, 3, False),  # x5.10
        },
        # o fp8
        ('fp8', 4096, 4096): {
            1: _c(64, 256, 2, 4, 4, False),  # x1.64
            2: _c(64, 256, 2, 4, 3, False),  # x1.62
            4: _c(64, 256, 2, 4, 4, False),  # x1.61
            8: _c(64, 256, 4, 4, 4, False),  # x1.49
        },
        # o int8
        ('int8', 4096, 4096): {
            1: None,  # x0.88 the previous path
            2: None,  # x0.84 the previous path
            4: None,  # x0.84 the previous path
            8: None,  # x0.83 the previous path
        },
        # gate_up w4g128
        ('w4g128', 28672, 4096): {
            1: _c(64, 256, 2, 4, 3, True),  # x1.20
            2: _c(64, 256, 1, 4, 3, False),  # x2.10
            4: _c(64, 256, 1, 4, 3, False),  # x3.27
            8: _c(64, 256, 1, 4, 3, False),  # x6.56
        },
        # gate_up fp8
        ('fp8', 28672, 4096): {
            1: _c(64, 128, 1, 4, 3, False),  # x1.17
            2: _c(64, 128, 1, 4, 4, False),  # x1.13
            4: _c(64, 256, 1, 4, 4, False),  # x1.04
            8: _c(64, 256, 1, 4, 4, False),  # x1.05
        },
        # gate_up int8
        ('int8', 28672, 4096): {
            1: None,  # x0.80 the previous path
            2: None,  # x0.78 the previous path
            4: None,  # x0.69 the previous path
            8: None,  # x0.70 the previous path
        },
        # down w4g128
        ('w4g128', 4096, 14336): {
            1: _c(64, 256, 8, 4, 2, True),  # x1.23
            2: _c(64, 256, 8, 4, 3, False),  # x1.69
            4: _c(64, 256, 5, 4, 3, False),  # x3.11
            8: _c(64, 256, 5, 4, 3, False),  # x6.73
        },
        # down fp8
        ('fp8', 4096, 14336): {
            1: _c(64, 256, 2, 4, 4, False),  # x2.23
            2: _c(64, 256, 2, 4, 4, False),  # x2.22
            4: _c(64, 256, 5, 4, 4, False),  # x1.76
            8: _c(64, 256, 5, 4, 4, False),  # x1.57
        },
        # down int8
        ('int8', 4096, 14336): {
            1: None,  # x0.84 the previous path
            2: None,  # x0.77 the previous path
            4: None,  # x0.61 the previous path
            8: None,  # x0.62 the previous path
        },
        # FP8 W8A8 on the FP8 tensor cores (gemv_fp8.py; activations quantized per
        # token in the norm that precedes qkv and gate/up, by a quantize launch before o
        # and down): benchmarks/gpu/bench_fp8_gemv.py at 23106f0
        # (results/fp8-gemv-bench-h200.json, M = 1 and 8; buckets 2 and 4 take M = 1's
        # and M = 8's tile). promote 128 (a float32 promotion per 128 inputs, as
        # _scaled_mm's): 18-25x less error than the compiler's default, which sums all of K
        # in the MMA's reduced precision (0.12-0.35 % of the output's range), for 0-1.4 us.
        # Comments: the GEMV's time at promote 128 against the weight-dequant GEMV's.
        ('fp8a8', 6144, 4096): {  # qkv: 10.6 vs 14.4 us (M 1), 11.4 vs 19.8 (M 8)
            1: _c(64, 256, 1, 4, 6, promote=128), 2: _c(64, 256, 1, 4, 6, promote=128),
            4: _c(64, 256, 1, 4, 6, promote=128), 8: _c(64, 256, 1, 4, 6, promote=128),
        },
        # o: 9.2 + 3.1 us of quantize launch against 11.0 (M 1): the dequant GEMV stays
        ('fp8a8', 4096, 4096): {1: None, 2: None, 4: None, 8: None},
        ('fp8a8', 28672, 4096): {  # gate_up: 31.8 vs 42.6 (M 1), 32.9 vs 50.6 (M 8)
            1: _c(64, 128, 1, 4, 3, promote=128), 2: _c(64, 128, 1, 4, 3, promote=128),
            4: _c(128, 128, 1, 4, 4, promote=128), 8: _c(128, 128, 1, 4, 4, promote=128),
        },
        ('fp8a8-silu', 14336, 4096): {  # gate_up + SiLU: 31.6 vs 43.7 (M 1, promote 0)
            1: _c(64, 256, 1, 4, 4, promote=128), 2: _c(64, 256, 1, 4, 4, promote=128),
            4: _c(64, 256, 1, 4, 3, promote=128), 8: _c(64, 256, 1, 4, 3, promote=128),
        },
        ('fp8a8', 4096, 14336): {  # down: 19.8 vs 25.1 (M 1), 20.0 vs 33.1 (M 8)
            1: _c(64, 256, 4, 4, 3, promote=128), 2: _c(64, 256, 4, 4, 3, promote=128),
            4: _c(64, 256, 2, 4, 6, promote=128), 8: _c(64, 256, 2, 4, 6, promote=128),
        },
        # The gated MLP as one FP8 chain (fp8.py _apply_mlp): gate/up + SiLU writing FP8
        # per 128-input group, down reading the groups; bench_fp8_gemv.py --chain at
        # 1b011c1 (results/fp8-chain-bench-h200.json): 55.9 us at M = 1 (58.6 at M = 8)
        # against 64.4 (65.0) for gate/up + SiLU, the quantize launch and down.
        ('fp8a8-siluq', 14336, 4096): {
            1: _c(128, 256, 1, 8, 3, promote=128), 2: _c(128, 256, 1, 8, 3, promote=128),
            4: _c(128, 128, 1, 8, 6, promote=128), 8: _c(128, 128, 1, 8, 6, promote=128),
        },
        ('fp8a8-xg', 4096, 14336): {
            1: _c(64, 128, 6, 4, 4), 2: _c(64, 128, 6, 4, 4),
            4: _c(64, 128, 6, 4, 4), 8: _c(64, 128, 6, 4, 4),
        },
        # lm_head int8
        ('int8', 128256, 4096): {
            1: None,  # x0.85 the previous path
            2: None,  # x0.66 the previous path
            4: None,  # x0.77 the previous path
            8: None,  # x0.77 the previous path
        },
    },
    "H100": {
        # qkv w4g128
        ('w4g128', 6144, 4096): {
            1: _c(64, 256, 3, 4, 3, False),  # x1.02
            2: _c(64, 256, 3, 4, 3, False),  # x1.30
            4: _c(64, 256, 3, 4, 3, False),  # x2.28
            8: _c(64, 256, 3, 4, 3, False),  # x4.86
        },
        # qkv fp8
        ('fp8', 6144, 4096): {
            1: _c(64, 256, 1, 4, 4, False),  # x1.53
            2: _c(64, 256, 3, 4, 4, False),  # x1.08
            4: _c(64, 256, 3, 4, 4, False),  # x1.10
            8: _c(64, 256, 3, 4, 4, False),  # x1.04
        },
        # qkv int8
        ('int8', 6144, 4096): {
            1: None,  # x0.89 the previous path
            2: None,  # x0.64 the previous path
            4: None,  # x0.64 the previous path
            8: None,  # x0.64 the previous path
        },
        # o w4g128
        ('w4g128', 4096, 4096): {
            1: _c(64, 256, 4, 4, 3, False),  # x1.07
            2: _c(64, 256, 4, 4, 3, False),  # x1.39
            4: _c(64, 256, 4, 4, 3, False),  # x2.37
            8: _c(64, 256, 4, 4, 3, False),  # x5.18
        },
        # o fp8
        ('fp8', 4096, 4096): {
            1: _c(64, 256, 2, 4, 4, False),  # x1.60
            2: _c(64, 256, 4, 4, 4, False),  # x1.50
            4: _c(64, 256, 4, 4, 4, False),  # x1.52
            8: _c(64, 256, 4, 4, 4, False),  # x1.45
        },
        # o int8
        ('int8', 4096, 4096): {
            1: None,  # x0.94 the previous path
            2: None,  # x0.85 the previous path
            4: None,  # x0.87 the previous path
            8: None,  # x0.85 the previous path
        },
        # gate_up w4g128
        ('w4g128', 28672, 4096): {
            1: _c(64, 256, 2, 4, 3, False),  # x1.22
            2: _c(64, 256, 1, 4, 3, False),  # x2.19
            4: _c(64, 256, 1, 4, 3, False),  # x3.29
            8: _c(64, 256, 1, 4, 3, False),  # x6.67
        },
        # gate_up fp8
        ('fp8', 28672, 4096): {
            1: _c(64, 256, 2, 4, 3, False),  # x1.11
            2: None,  # x0.99 the previous path
            4: None,  # x1.01 the previous path
            8: None,  # x0.98 the previous path
        },
        # gate_up int8
        ('int8', 28672, 4096): {
            1: None,  # x0.90 the previous path
            2: None,  # x0.86 the previous path
            4: None,  # x0.84 the previous path
            8: None,  # x0.85 the previous path
        },
        # gate_up_silu w4g128-silu
        ('w4g128-silu', 14336, 4096): {
            1: _c(64, 256, 2, 4, 3, False),  # x1.17
            2: _c(64, 256, 2, 4, 3, False),  # x2.15
            4: _c(64, 256, 2, 4, 3, False),  # x3.21
            8: _c(64, 256, 2, 4, 3, False),  # x6.29
        },
        # gate_up_silu fp8-silu
        ('fp8-silu', 14336, 4096): {
            1: _c(64, 128, 2, 4, 3, False),  # x1.13
            2: _c(64, 128, 2, 4, 4, False),  # x1.08
            4: _c(64, 128, 2, 4, 4, False),  # x1.02
            8: _c(64, 128, 2, 4, 4, False),  # x1.03
        },
        # gate_up_silu int8-silu
        ('int8-silu', 14336, 4096): {
            1: None,  # x0.97 the previous path
            2: None,  # x0.90 the previous path
            4: None,  # x0.91 the previous path
            8: None,  # x0.91 the previous path
        },
        # down w4g128
        ('w4g128', 4096, 14336): {
            1: _c(64, 256, 8, 4, 3, False),  # x1.20
            2: _c(64, 256, 5, 4, 3, False),  # x1.69
            4: _c(64, 256, 5, 4, 3, False),  # x3.09
            8: _c(64, 256, 5, 4, 3, False),  # x7.36
        },
        # down fp8
        ('fp8', 4096, 14336): {
            1: _c(64, 256, 2, 4, 4, False),  # x2.01
            2: _c(64, 256, 5, 4, 4, False),  # x1.53
            4: _c(64, 256, 5, 4, 4, False),  # x1.56
            8: _c(64, 256, 5, 4, 4, False),  # x1.53
        },
        # down int8
        ('int8', 4096, 14336): {
            1: None,  # x0.93 the previous path
            2: None,  # x0.72 the previous path
            4: None,  # x0.72 the previous path
            8: None,  # x0.73 the previous path
        },
        # lm_head int8
        ('int8', 128256, 4096): {
            1: None,  # x0.94 the previous path
            2: None,  # x0.84 the previous path
            4: None,  # x0.84 the previous path
            8: None,  # x0.94 the previous path
        },
    },
}


def table_from_bench(path: str) -> dict[tuple[str, int, int], dict[int, WoqGemvConfig | None]]:
    """The ``table`` of a ``bench_woq_gemv.py`` result file, in ``MEASURED``'s form (every
    field a config has, ``rows`` included; files written before it existed lack it: 0)."""
    import json

    with open(path) as f:
        rows = json.load(f)["table"]
    out: dict[tuple[str, int, int], dict[int, WoqGemvConfig | None]] = {}
    for r in rows:
        cfg = r["config"]
        out.setdefault((r["format"], r["n"], r["k"]), {})[r["m"]] = (
            None if cfg is None else WoqGemvConfig(**cfg))
    return out


@functools.lru_cache(maxsize=16)
def _device_table(name: str, path: str | None) -> dict:
    return overlay_table(MEASURED, name, table_from_bench(path) if path else {})


def plan(fmt: str, n: int, k: int, device: torch.device) -> dict[int, WoqGemvConfig]:
    """{M: config} for the row counts 1..DISPATCH_MAX_M that take the low-bit GEMV for a
    layer of format ``fmt`` (see the module docstring) and shape [N, K] on ``device``;
    empty off CUDA, with KVFLOW_WOQ_GEMV=off or KVFLOW_DISABLE_TRITON=1."""
    from kvflow import envs

    mode = envs.woq_gemv_mode()
    if mode == "off" or device.type != "cuda" or envs.disable_triton():
        return {}
    table = _device_table(torch.cuda.get_device_name(device), envs.woq_gemv_table())
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
