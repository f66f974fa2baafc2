"""Launch configurations of the dense decode GEMV (``kvflow/kernels/gemv.py``) and the
per-shape table that decides, per GPU, where it replaces cuBLAS.

The dense linear path (``UnquantizedLinearMethod``) asks ``dispatch_configs`` once per layer
after loading; it gets {M: config} for the activation row counts 1..8 where the GEMV
measured faster than cuBLAS on this GPU at this (N, K), and keeps cuBLAS (``F.linear``)
for every other M and shape. The table holds only measured entries (``MEASURED``, filled
from ``benchmarks/gpu/bench_gemv.py --sweep`` on the named GPU): an unmeasured GPU or shape
keeps cuBLAS. ``KVFLOW_GEMV`` (``kvflow.envs.gemv_mode``) overrides: ``off`` keeps cuBLAS
everywhere, ``force`` takes the GEMV for every M <= 8 (the table's config where it
measured a win, else the heuristic ``default_config``; benchmarks, tests), ``auto``
(default) the table's wins only.

Everything is decided from Python ints at load and at the call: no host sync, so the
launches capture in CUDA graphs (one graph per batch size, each with its static M).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

DISPATCH_MAX_M = 8  # the decode batch sizes the dense path sends to the GEMV
M_BUCKETS = (1, 2, 4, 8)  # measured row counts; M = 3 takes 4's entry, 5..8 take 8's


@dataclass(frozen=True)
class GemvConfig:
    """Tile sizes of one GEMV launch."""

    block_n: int
    """Weight rows (outputs) per program; with ``silu_and_mul``, gate rows (and as many
    up rows)."""
    block_k: int
    """Inputs per K step (a power of two >= 16)."""
    split_k: int = 1
    """Programs sharing one output tile's K range (> 1: in-launch float32 reduction)."""
    dot: bool = True
    """tl.dot with the weight as the wide operand and x padded to 16 rows; False: the
    register form (float32 multiply and tl.sum), for M = 1 only."""
    num_warps: int = 4
    num_stages: int = 4
    rows: int = 0
    """Output rows a program owns, when fewer than ``block_n`` (0: ``block_n``). The grid
    is cdiv(N, rows): a count that fills the SMs evenly where N / block_n would leave
    some idle or a ragged last wave (qkv's 6144 rows: 96 tiles of 64 on 132 SMs, or 131
    programs of 47 rows in 64-row tiles). The tile's lanes past ``rows`` load and store
    nothing."""

    def __post_init__(self) -> None:
        check_tile(self)

    @property
    def tile_rows(self) -> int:
        """Output rows per program (``rows`` or the whole tile)."""
        return self.rows or self.block_n

    @property
    def block_m(self) -> int:
        """Activation rows per program: one MMA tile of 16, or the single row."""
        return 16 if self.dot else 1

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def check_tile(cfg) -> None:
    """A GEMV launch configuration's bounds (dense and low-bit configs alike)."""
    for v in (cfg.block_n, cfg.block_k):
        if v < 16 or v & (v - 1):
            raise ValueError(f"GEMV tile sizes must be powers of two >= 16: {cfg}")
    if cfg.split_k < 1 or cfg.num_warps < 1 or cfg.num_stages < 1:
        raise ValueError(f"split_k, num_warps and num_stages must be >= 1: {cfg}")
    if not 0 <= cfg.rows <= cfg.block_n:
        raise ValueError(f"rows must be in 0..block_n: {cfg}")


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small shapes, exercise split-K a little
    from kvflow.kernels.woq_config import num_sms

    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def default_config(m: int, n: int, k: int, device: torch.device, pairs: bool = False,
                   sms: int | None = None) -> GemvConfig:
    """A heuristic configuration (``force`` mode outside the table, tests).

    Tiles of 256 bf16 inputs (16-byte loads per thread), four stages deep (pairs: gate +
    up per program, three). BLOCK_N 64 or 32, whichever fills the last wave of programs
    better (ties: 64). Split-K only when even 32-row tiles leave over half the SMs idle:
    on the H200 the in-launch reduction cost more than idle SMs at every 8B shape but
    o_proj (``MEASURED``)."""
    sms = sms or _sms(device)
    bk = 256 if k >= 512 else max(16, triton.next_power_of_2(k) // 2)

    def fill(bn: int) -> float:
        tiles = triton.cdiv(n, bn)
        return tiles / (triton.cdiv(tiles, sms) * sms)
    bn = 64 if fill(64) >= fill(32) else 32
    tiles = triton.cdiv(n, bn)
    k_tiles = triton.cdiv(k, bk)
    split = 1
    if tiles < sms // 2:
        split = max(1, min(sms // tiles, k_tiles // 2, 16))
        split = triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))  # no split left empty
    return GemvConfig(bn, bk, split, True, 4, 3 if pairs else 4)


def _c(bn: int, bk: int, split: int, warps: int, stages: int, dot: bool = True,
       rows: int = 0) -> GemvConfig:
    return GemvConfig(bn, bk, split, dot, warps, stages, rows)


def balanced_rows(n: int, programs: int) -> int:
    """Rows per program that spread n rows over at most ``programs`` programs as evenly
    as whole rows allow (``GemvConfig.rows``)."""
    return -(-n // programs)


# Measured tables: device-name token -> {(kind, N, K): {M bucket: config, or None for
# cuBLAS}}. kind "linear" (y = x W^T), "silu_mul" (gate/up with the activation fused,
# N = d, the output width), "norm_linear" / "norm_silu_mul" (the same with residual add +
# RMSNorm folded in, against cuBLAS + fused_add_rms_norm). Each entry is the best
# configuration of a sweep on that GPU where it beat cuBLAS (for silu_mul: cuBLAS + the
# silu_and_mul kernel) by >= 2 % at that M.
#
# H200 (132 SMs, 4.8 TB/s): benchmarks/gpu/bench_gemv.py --sweep (budget 100 s) at commit
# 5d978fb, results/gemv-bench-sweep-h200.json. What the sweep taught: split-K rarely pays
# here (its workspace round trip and last-program tail cost more than idle SMs: qkv at 96
# programs beats 288; only down at M = 1 and 8 keeps 2-3 splits), BLOCK_N 32 wins where
# 64 leaves too few programs (o_proj), and the 1 GB lm_head reaches 4.39 TB/s (the
# launch's fixed cost is what holds the 33-50 MB layers near 3 TB/s). The norm-folded
# gate_up lost then (its x side was not pipelined). The M = 1 buckets are overlaid from
# the later bench at e3b684715 (results/gemv-bench-m1-h200.json: every table config per
# shape re-timed, a 20 s sweep of the norm-folded gate_up, which now wins 1.15x with its
# x side prefetched; down at M = 1 fell under 2 % and kept cuBLAS). The M = 1 buckets of
# qkv, o, gate_up and down are then overlaid from the balanced-grid bench at 44f39f6
# (results/gemv-rows-*-h200.json: each table config against configs with
# GemvConfig.rows): no balanced grid won anywhere; the table configs won again, down's
# 32 x 256 GEMV now by 3 % over cuBLAS + its split-K reduce (so it leaves cuBLAS: +1.7-1.9 %
# GPU-A decode in alternation, results/decode-rows-h200.json), and the unfused gate_up
# GEMV lost (x0.92; the model takes the SiLU-fused forms there anyway).
#
# H100 (132 SMs, 3.35 TB/s): benchmarks/gpu/run.sh gemv-fresh at 4bcaf0b (bench_gemv.py --sweep,
# budget 120 s; results/gemv-bench-sweep-h100.json). cuBLAS streams the 8B decode layers at
# 1.9-2.9 TB/s there; the GEMV wins at every shape but a few M = 2..8 buckets (o 1.16x,
# the 1 GB lm_head 1.27x at M = 1, qkv with the norm folded in 1.22x). GPU-A with this table
# 165.1 -> 176.0 tokens/s, alternated in one process (results/decode-levers-fresh-h100.json).
MEASURED: dict[str, dict[tuple[str, int, int], dict[int, GemvConfig | None]]] = {
    "H200": {
        # qkv
        ("linear", 6144, 4096): {
            1: _c(64, 256, 1, 4, 4),
            2: _c(64, 256, 1, 4, 4),
            4: _c(64, 256, 1, 4, 5),
            8: _c(64, 128, 1, 4, 5),
        },
        # o
        ("linear", 4096, 4096): {
            1: _c(32, 256, 1, 4, 5),
            2: _c(64, 256, 2, 4, 3),
            4: _c(32, 256, 1, 4, 5),
            8: _c(32, 256, 1, 4, 5),
        },
        # gate_up (unfused: the gated MLP takes the silu_mul forms)
        ("linear", 28672, 4096): {
            1: None,
            2: None,
            4: _c(128, 256, 1, 8, 3),
            8: _c(64, 128, 1, 4, 4),
        },
        # gate_up + silu_and_mul
        ("silu_mul", 14336, 4096): {
            1: _c(64, 128, 1, 4, 3),
            2: None,
            4: _c(64, 128, 1, 4, 3),
            8: _c(64, 128, 1, 4, 3),
        },
        # down
        ("linear", 4096, 14336): {
            1: _c(32, 256, 1, 4, 5),
            2: None,
            4: _c(32, 256, 1, 4, 5),
            8: _c(32, 128, 3, 4, 4),
        },
        # lm_head
        ("linear", 128256, 4096): {
            1: _c(32, 256, 1, 4, 4),
            2: _c(64, 128, 1, 4, 5),
            4: _c(128, 128, 1, 8, 3),
            8: _c(128, 128, 1, 4, 3),
        },
        # add + norm + qkv
        ("norm_linear", 6144, 4096): {
            1: _c(64, 256, 1, 4, 4),
            2: None,
            4: None,
            8: None,
        },
        # add + norm + gate_up + silu
        ("norm_silu_mul", 14336, 4096): {
            1: _c(64, 128, 1, 4, 3),
            2: None,
            4: None,
            8: None,
        },
    },
    "H100": {
        # qkv
        ("linear", 6144, 4096): {
            1: _c(64, 256, 1, 4, 4),
            2: _c(64, 256, 1, 4, 4),
            4: _c(64, 256, 1, 4, 3),
            8: _c(64, 128, 1, 4, 5),
        },
        # o
        ("linear", 4096, 4096): {
            1: _c(32, 256, 1, 4, 4),
            2: _c(32, 256, 1, 4, 4),
            4: _c(32, 256, 1, 4, 4),
            8: _c(32, 256, 1, 4, 5),
        },
        # gate_up (unfused: the gated MLP takes the silu_mul forms)
        ("linear", 28672, 4096): {
            1: None,
            2: _c(64, 128, 1, 4, 4),
            4: None,
            8: _c(64, 256, 1, 4, 4),
        },
        # gate_up + silu_and_mul
        ("silu_mul", 14336, 4096): {
            1: _c(64, 128, 1, 4, 3),
            2: _c(64, 256, 1, 4, 3),
            4: _c(64, 128, 1, 4, 3),
            8: _c(64, 256, 1, 4, 3),
        },
        # down
        ("linear", 4096, 14336): {
            1: _c(16, 256, 1, 4, 5),
            2: _c(32, 256, 1, 4, 5),
            4: _c(32, 256, 1, 4, 5),
            8: _c(32, 256, 1, 4, 5),
        },
        # lm_head
        ("linear", 128256, 4096): {
            1: _c(64, 256, 1, 4, 4),
            2: _c(64, 256, 1, 4, 4),
            4: _c(128, 128, 1, 8, 4),
            8: _c(128, 128, 1, 4, 4),
        },
        # add + norm + qkv
        ("norm_linear", 6144, 4096): {
            1: _c(64, 256, 1, 4, 3),
            2: None,
            4: _c(64, 256, 1, 8, 3),
            8: None,
        },
        # add + norm + gate_up + silu
        ("norm_silu_mul", 14336, 4096): {
            1: _c(64, 256, 1, 4, 3),
            2: None,
            4: None,
            8: _c(64, 128, 1, 4, 3),
        },
    },
}


def _bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    raise ValueError(f"no GEMV bucket for {m} rows")


def table_from_bench(path: str) -> dict[tuple[str, int, int], dict[int, GemvConfig | None]]:
    """The ``table`` of a ``bench_gemv.py`` result file, in ``MEASURED``'s form."""
    import json

    with open(path) as f:
        rows = json.load(f)["table"]
    out: dict[tuple[str, int, int], dict[int, GemvConfig | None]] = {}
    for r in rows:
        n = r["n"] // 2 if r["kind"].endswith("silu_mul") else r["n"]  # key: output width
        cfg = r["config"]
        out.setdefault((r["kind"], n, r["k"]), {})[r["m"]] = (
            None if cfg is None else GemvConfig(**cfg))
    return out


@functools.lru_cache(maxsize=16)
def _device_table(name: str) -> dict:
    from kvflow import envs

    path = envs.gemv_table()
    return overlay_table(MEASURED, name, table_from_bench(path) if path else {})


def overlay_table(measured: dict[str, dict], gpu_name: str, fresh: dict) -> dict:
    """The built-in table of the first ``measured`` GPU whose token is in ``gpu_name``
    (empty if none), with the buckets of a fresh measurement (``fresh``, in the same
    {key: {bucket: config}} form) replacing the built-in buckets they have."""
    table: dict = {}
    for token, entries in measured.items():
        if token in gpu_name:
            table = dict(entries)
            break
    for key, buckets in fresh.items():
        table[key] = {**table.get(key, {}), **buckets}
    return table


def dispatch_configs(kind: str, n: int, k: int, dtype: torch.dtype, device: torch.device,
                     mode: str) -> dict[int, GemvConfig]:
    """{M: config} for the row counts 1..DISPATCH_MAX_M that take the GEMV at this shape
    (empty: cuBLAS for all). ``mode`` is ``kvflow.envs.gemv_mode()``."""
    if mode == "off" or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return {}
    table = _device_table(torch.cuda.get_device_name(device)).get((kind, n, k), {})
    out = {}
    for m in range(1, DISPATCH_MAX_M + 1):
        cfg = table.get(_bucket(m))
        if cfg is None and mode == "force":  # force: the heuristic where none was measured
            cfg = default_config(m, n, k, device, pairs=kind.endswith("silu_mul"))
        if cfg is not None:
            out[m] = cfg
    return out
