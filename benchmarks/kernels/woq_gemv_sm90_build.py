"""Build the low-bit decode GEMVs (``kvflow/kernels/gemv_w4.py``, ``gemv_w8.py``,
``gemv_fp8.py``) for sm_90 (H100/H200) without a GPU, with the ptxas Triton ships:
registers, spill bytes, shared memory and the main loop's SASS length per launch
configuration (JSON lines). The inline PTX of the int4 conversion is assembled here too,
so a syntax error shows before GPU time is spent.

    python benchmarks/kernels/woq_gemv_sm90_build.py

Run it without TRITON_INTERPRET (the interpreter replaces the compiler).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.dirname(__file__))

from woq_sm90_build import _build  # noqa: E402

from kvflow.kernels import gemv_fp8, gemv_w4, gemv_w8  # noqa: E402
from kvflow.kernels.woq_gemv_config import WoqGemvConfig  # noqa: E402

W4_SIG = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16",
          "out_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32",
          "K": "i32", "KW": "i32", "stride_xm": "i32", "stride_om": "i32", "split_k": "i32"}
W8_SIG = {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "out_ptr": "*bf16",
          "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
          "stride_xm": "i32", "stride_om": "i32", "split_k": "i32"}
FP8A8_SIG = {"xq_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "w_ptr": "*fp8e4nv", "sw_ptr": "*fp32",
             "out_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32",
             "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32",
             "split_k": "i32", "stride_sxm": "i32", "oscale_ptr": "*fp32"}
# (format, config): the heuristic's tiles and the larger ones the sweep tries, then one
# balanced grid (WoqGemvConfig.rows) per kernel: int4 qkv's 6144 rows as 131 programs of
# 47 (split-K), gate_up + SiLU's 14336 as 261 of 55 in the weight-dequant and the W8A8
# GEMV, in 64-row tiles
CASES = [("w4g128", WoqGemvConfig(64, 256, 2, 4, 3, False)),
         ("w4g128", WoqGemvConfig(64, 256, 2, 4, 3, True)),
         ("w4g128", WoqGemvConfig(128, 256, 1, 4, 3, False)),
         ("w4g32", WoqGemvConfig(64, 256, 1, 4, 3, True)),
         ("fp8", WoqGemvConfig(64, 256, 2, 4, 4)),
         ("int8", WoqGemvConfig(64, 256, 2, 4, 4)),
         ("w4g128-silu", WoqGemvConfig(64, 256, 2, 4, 3, False)),  # gate/up + SiLU epilogue
         ("fp8-silu", WoqGemvConfig(64, 128, 2, 4, 4)),
         ("fp8", WoqGemvConfig(64, 256, 2, 4, 4, xa=True)),  # x first: mma.sync
         ("w4g128", WoqGemvConfig(32, 256, 2, 2, 3, True)),  # 32 rows: mma.sync
         ("w4g128", WoqGemvConfig(64, 256, 2, 4, 3, False, rows=47)),
         ("fp8-silu", WoqGemvConfig(64, 128, 1, 4, 4, rows=55)),
         ("fp8a8-silu", WoqGemvConfig(64, 256, 1, 4, 4, promote=128, rows=55))]


def build(fmt: str, cfg: WoqGemvConfig) -> dict:
    split = cfg.split_k > 1
    silu = fmt.endswith("-silu")
    fmt = fmt.removesuffix("-silu")
    if fmt.startswith("w4"):
        group = int(fmt[3:])
        consts = dict(GROUP=group, SPAN=min(group, 256) // 32, HAS_BIAS=True, BLOCK_N=cfg.block_n, SPLIT=split,
                      ASM=True, DEQ=cfg.deq, SILU=silu, EVEN_K=True, UPCAST=False,
                      ROWS=cfg.tile_rows)
        return _build(gemv_w4._gemv_w4_kernel, W4_SIG, consts, cfg)
    if fmt == "fp8a8":  # FP8 x FP8 (gemv_fp8), per-token activation scales
        consts = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=True, SPLIT=split,
                      SILU=silu, PROMOTE=cfg.promote, UPCAST=False, ROWS=cfg.tile_rows,
                      XGROUP=False, OUT_FP8=False)
        row = _build(gemv_fp8._gemv_fp8_kernel, FP8A8_SIG, consts, cfg)
        # the FP8 dot promotes to float32 every `promote` inputs (0: sm_90's default, 2^30)
        row["promotion_as_configured"] = row["max_num_imprecise_acc"] == [cfg.promote
                                                                          or 2 ** 30]
        return row
    sig = {**W8_SIG, "w_ptr": "*fp8e4nv" if fmt == "fp8" else "*i8"}
    consts = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=True, SPLIT=split,
                  ASM=True, FP8=fmt == "fp8", SILU=silu, XA=cfg.xa, UPCAST=False,
                  ROWS=cfg.tile_rows)
    return _build(gemv_w8._gemv_w8_kernel, sig, consts, cfg)


def main() -> int:
    for fmt, cfg in CASES:
        print(json.dumps({"format": fmt, "config": cfg.as_dict(), **build(fmt, cfg)}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
