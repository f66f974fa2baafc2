"""Launch configurations of the dense decode GEMV (``kvflow/kernels/gemv.py``) and the
per-shape table that decides, per GPU, where it replaces cuBLAS.

The dense linear path (``UnquantizedLinearMethod``) asks ``dispatch_configs`` once per layer
after loading; it gets {M: config} for the activation row counts 1..8 where the GEMV
measured faster than cuBLAS on this GPU at this (N, K), and keeps cuBLAS (``F.linear``)
for every other M and shape. The table holds only measured entries: the ``gemv`` part of
the GPU's data file in ``kvflow/kernels/tuning/`` (written by ``benchmarks/gpu/bench_gemv.py
--sweep --write-tuning`` on that GPU, overlaid by ``KVFLOW_TUNING_FILE``); an unmeasured
GPU or shape keeps cuBLAS. ``KVFLOW_GEMV`` (``kvflow.envs.gemv_mode``) overrides: ``off`` keeps cuBLAS
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
    o_proj (its tuning data, ``kvflow/kernels/tuning/h200.json``)."""
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


def balanced_rows(n: int, programs: int) -> int:
    """Rows per program that spread n rows over at most ``programs`` programs as evenly
    as whole rows allow (``GemvConfig.rows``)."""
    return -(-n // programs)


def _bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    raise ValueError(f"no GEMV bucket for {m} rows")


def device_table(tuning) -> dict[tuple[str, int, int], dict[int, GemvConfig | None]]:
    """A device's measured table (``kvflow.kernels.tuning``) as {(kind, N, K): {M bucket:
    config, or None for cuBLAS}}."""
    return {key: {m: None if c is None else GemvConfig(**c) for m, c in buckets.items()}
            for key, buckets in tuning.gemv.items()}


@functools.lru_cache(maxsize=16)
def _device_table(name: str, overrides: str | None = None) -> dict:
    from kvflow.kernels import tuning

    return device_table(tuning.for_device(name, overrides))


def dispatch_configs(kind: str, n: int, k: int, dtype: torch.dtype, device: torch.device,
                     mode: str) -> dict[int, GemvConfig]:
    """{M: config} for the row counts 1..DISPATCH_MAX_M that take the GEMV at this shape
    (empty: cuBLAS for all). ``mode`` is ``kvflow.envs.gemv_mode()``."""
    if mode == "off" or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return {}
    from kvflow import envs

    table = _device_table(torch.cuda.get_device_name(device),
                          envs.tuning_file()).get((kind, n, k), {})
    out = {}
    for m in range(1, DISPATCH_MAX_M + 1):
        cfg = table.get(_bucket(m))
        if cfg is None and mode == "force":  # force: the heuristic where none was measured
            cfg = default_config(m, n, k, device, pairs=kind.endswith("silu_mul"))
        if cfg is not None:
            out[m] = cfg
    return out
