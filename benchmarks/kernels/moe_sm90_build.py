"""Build the fused MoE grouped GEMM (``kvflow/kernels/fused_moe.py``) for sm_90 (H100/H200)
without a GPU, for every expert weight form (bf16, int8, int4 with and without offsets at
tiles of one and of several groups, float8), gated (gate_up) and not (down), and check
the machine code: no register spills, shared memory within a Hopper block's 227 KiB. A
cheap check that the quantized-expert paths compile before GPU time is spent on them.

    python benchmarks/kernels/moe_sm90_build.py          # JSON lines, one per kernel

Run it without TRITON_INTERPRET (the interpreter replaces the compiler).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from decode_sm90_build import _build  # noqa: E402

from kvflow.kernels import fused_moe  # noqa: E402

SIG = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "scale_ptr": "*fp32",
       "offset_ptr": "*bf16", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
       "num_padded_ptr": "*i32", "topk_w_ptr": "*fp32", "N": "i32", "K": "i32",
       "num_pairs": "i32", "a_row_div": "i32", "stride_am": "i32", "stride_we": "i32",
       "stride_wn": "i32", "stride_om": "i32", "stride_se": "i32", "stride_sg": "i32"}

# (name, weight type, scale type, int4 group, offsets, float8, block_k)
FORMS = [("bf16", "*bf16", "*fp32", 0, False, False, 64),
         ("int8", "*i8", "*fp32", 0, False, False, 64),
         ("int4 g128 asym", "*u8", "*bf16", 128, True, False, 64),
         ("int4 g32 sym, tile of 2 groups", "*u8", "*bf16", 32, False, False, 64),
         ("fp8", "*fp8e4nv", "*fp32", 0, False, True, 64)]


def main() -> int:
    rows = []
    for name, wt, st, group, offset, fp8, bk in FORMS:
        for gated in (True, False):
            sig = dict(SIG, w_ptr=wt, scale_ptr=st)
            rows.append(_build(f"moe_gemm {name} {'gate_up' if gated else 'down'}",
                               fused_moe._moe_gemm_kernel, sig,
                               dict(GATED=gated, MUL_WEIGHT=not gated,
                                    HAS_SCALE=name != "bf16", W4_GROUP=group,
                                    HAS_OFFSET=offset, W_FP8=fp8, BLOCK_M=16, BLOCK_N=64,
                                    BLOCK_K=bk, UPCAST=False, DOT_PRECISION="tf32"), 4, 3))
    for r in rows:
        print(json.dumps(r))
    return 0 if all(r.get("fits") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
