"""Build the FP8 W8A8 kernels (``kvflow/kernels/fp8_gemm.py``, ``fp8_quant.py``) for sm_90
(H100/H200) without a GPU, with the ptxas Triton ships, and report registers, spills and
shared memory of the default configurations (JSON lines), as ``woq_sm90_build.py`` does for
the weight-only GEMMs: a compile check before GPU time is spent (it also catches what the
interpreter lets through, e.g. a plain global read inside a kernel).

    python benchmarks/kernels/fp8_sm90_build.py

Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from woq_sm90_build import H200_SMS, _build  # noqa: E402

from kvflow.kernels.fp8_gemm import _fp8_gemm_kernel, choose_config  # noqa: E402
from kvflow.kernels.fp8_quant import _quant_kernel  # noqa: E402

# (M, N, K, block rows or None): decode and prefill sizes at Llama-3.1-8B's shapes
# (kept to the three kernel variants the engine launches most: each build takes seconds)
CASES = [(1, 4096, 4096, None), (1, 28672, 4096, 128), (4096, 28672, 4096, 128),
         (256, 4096, 14336, 128)]  # the last: 128 x 64 tiles promoted every instruction


def build_gemm(m: int, n: int, k: int, rows: int | None) -> dict:
    group = None if rows is None else 128
    cfg = choose_config(m, n, k, group, torch.device("cuda"), sms=H200_SMS)
    quant_x = m <= 16  # fp8_linear: in-kernel quantization up to SMALL_M
    sig = {"x_ptr": "*bf16" if quant_x else "*fp8e4nv", "sx_ptr": "*fp32",
           "w_ptr": "*fp8e4nv", "sw_ptr": "*fp32", "out_ptr": "*bf16", "ws_ptr": "*fp32",
           "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
           "stride_sxm": "i32", "stride_swn": "i32", "stride_om": "i32", "split_k": "i32"}
    pro_m = min(cfg.block_m, 1 << (m - 1).bit_length())
    consts = dict(QUANT_X=quant_x, GROUP=group or 0, W_ROWS=rows or 1, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRO_M=pro_m,
                  PRO_K=max(16, min(1 << (k - 1).bit_length(), 8192 // pro_m)),
                  SWAP=cfg.swap_ab, SPLIT=cfg.split_k > 1, EMULATE=False,
                  PROMOTE_K=min(cfg.promote_k, cfg.block_k))
    row = {"kernel": "fp8_gemm", "m": m, "n": n, "k": k, "block_rows": rows,
           "config": cfg.__dict__, **_build(_fp8_gemm_kernel, sig, consts, cfg)}
    # the FP8 dot promotes its tensor-core partial to float32 as the config asks (the
    # interpreter cannot see it): every PROMOTE_K inputs, or (0) sm_90's default, 2^30
    row["promotion_as_configured"] = (row["max_num_imprecise_acc"]
                                      == [consts["PROMOTE_K"] or 2 ** 30])
    return row


def build_quant(group: int) -> dict:
    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32",
           "stride_xm": "i32", "stride_qm": "i32", "stride_sm": "i32"}

    class _Warps:  # what _build reads of a config
        num_warps, num_stages = (4 if group == 0 else 1), 1
    return {"kernel": "fp8_quant", "group": group,
            **_build(_quant_kernel, sig, dict(GROUP=group, BLOCK=4096, EMULATE=False),
                     _Warps)}


def main() -> int:
    for case in CASES:
        print(json.dumps(build_gemm(*case)), flush=True)
    print(json.dumps(build_quant(0)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
