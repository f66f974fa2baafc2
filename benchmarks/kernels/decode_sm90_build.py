"""Build the batch-1 decode kernels (the dense GEMVs with their norm and SiLU forms, split-KV
decode attention with and without the rotary inside, the split merge, RMSNorm, the rotary
+ cache write; --deterministic's fixed-split attention and merge and its batch-invariant
matmul at both tile shapes) for sm_90 (H100/H200) without a GPU, and check the machine code: no
register spills, shared memory within a Hopper block's 227 KiB. A cheap check that a
Triton version (the GPU image runs 3.6) compiles them before GPU time is spent.

    python benchmarks/kernels/decode_sm90_build.py          # JSON lines, one per kernel

Run it without TRITON_INTERPRET (the interpreter replaces the compiler).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvflow.kernels import (batch_invariant, gemv, gemv_norm, paged_attention,  # noqa: E402
                           rms_norm, rotary_kv)

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SMEM_LIMIT = 227 * 1024
ONLY = [""]  # --only=SUBSTRING: build the kernels whose name contains it


def _build(name: str, kernel, sig: dict, consts: dict, warps: int, stages: int) -> dict:
    if ONLY[0] and ONLY[0] not in name:
        return {}
    # every constexpr given explicitly: a direct compile applies no defaults
    sig = {**sig, **{c: "constexpr" for c in consts}}
    names = list(sig)
    # What a real launch specializes: 16-aligned pointers, ints divisible by 16 (row
    # counts, split counts, positions and scales left generic).
    generic = {"M", "split_k", "split_tokens", "num_splits", "req_offset", "n_rows", "n_slots", "eps",
               "qk_scale", "out_scale", "k_inv_scale", "v_inv_scale", "num_kv_heads"}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n] != "constexpr" and not sig[n].startswith("fp") and n not in generic}
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    fields = dict(kv.split(":", 1) for kv in usage.split("Function", 1)[1].split()[1:]
                  if ":" in kv)
    return {"kernel": name, "triton": triton.__version__, "registers": int(fields["REG"]),
            "spill_bytes": int(fields["STACK"]), "shared_bytes": k.metadata.shared,
            "fits": int(fields["STACK"]) == 0 and k.metadata.shared <= SMEM_LIMIT}


def _gemv_sig() -> dict:
    return {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
            "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
            "stride_xm": "i32", "stride_om": "i32", "split_k": "i32"}


def main() -> int:
    only = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")), "")
    ONLY[0] = only
    rows = []
    common = dict(BLOCK_M=16, EVEN_K=True, DOT=True, UPCAST=False)
    rows.append(_build("gemv qkv", gemv._gemv_kernel, _gemv_sig(),
                       dict(HAS_BIAS=False, BLOCK_N=64, BLOCK_K=256, SPLIT=False, ROWS=64,
                            **common), 4, 4))
    rows.append(_build("gemv down split2", gemv._gemv_kernel, _gemv_sig(),
                       dict(HAS_BIAS=False, BLOCK_N=64, BLOCK_K=256, SPLIT=True, ROWS=64,
                            **common), 4, 4))
    sig = _gemv_sig()
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "wu_ptr": "*bf16", "out_ptr": "*bf16",
           "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "D": "i32", "K": "i32",
           "stride_xm": "i32", "stride_om": "i32", "split_k": "i32"}
    rows.append(_build("gemv silu_mul", gemv._gemv_silu_mul_kernel, sig,
                       dict(BLOCK_N=64, BLOCK_K=128, SPLIT=False, ROWS=64, **common), 4, 3))
    nsig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*bf16",
            "wu_ptr": "*bf16", "out_ptr": "*bf16", "r_out_ptr": "*bf16", "ws_ptr": "*fp32",
            "ssq_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
            "stride_xm": "i32", "stride_rm": "i32", "stride_om": "i32", "split_k": "i32",
            "eps": "fp32"}
    ncommon = dict(HAS_RES=True, BLOCK_M=16, EVEN_K=True, SPLIT=False, UPCAST=False)
    for bn in (64, 32, 16):
        rows.append(_build(f"gemv_norm qkv bn{bn}", gemv_norm._gemv_norm_kernel, nsig,
                           dict(ACT=False, BLOCK_N=bn, BLOCK_K=256, ROWS=bn,
                                **ncommon), 4, 4))
    # balanced grids (GemvConfig.rows): qkv's 6144 rows as 131 programs of 47, gate_up's
    # 14336 as 261 of 55, in 64-row tiles
    rows.append(_build("gemv_norm qkv bn64 rows47", gemv_norm._gemv_norm_kernel, nsig,
                       dict(ACT=False, BLOCK_N=64, BLOCK_K=256, ROWS=47,
                            **ncommon), 4, 4))
    rows.append(_build("gemv_norm gate_up rows55", gemv_norm._gemv_norm_kernel, nsig,
                       dict(ACT=True, BLOCK_N=64, BLOCK_K=128, ROWS=55,
                            **ncommon), 4, 3))
    rows.append(_build("gemv_norm gate_up", gemv_norm._gemv_norm_kernel, nsig,
                       dict(ACT=True, BLOCK_N=64, BLOCK_K=128, ROWS=64, **ncommon),
                       4, 3))
    asig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
            "bt_ptr": "*i32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32",
            "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "req_offset": "i32",
            "num_splits": "i32", "qk_scale": "fp32", "stride_qt": "i32", "stride_qh": "i32",
            "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32", "stride_kb": "i32",
            "stride_kt": "i32", "stride_kh": "i32", "ks_ptr": "*bf16", "vs_ptr": "*bf16",
            "out_scale": "fp32", "stride_sb": "i32", "stride_st": "i32", "stride_sh": "i32",
            "tree_bits_ptr": "*i32", "tree_start_ptr": "*i32", "cs_ptr": "*fp32",
            "stride_cs": "i32",
            "kn_ptr": "*bf16", "vn_ptr": "*bf16", "stride_knt": "i32", "stride_knh": "i32",
            "stride_vnt": "i32", "stride_vnh": "i32", "slot_ptr": "*i64", "n_slots": "i32",
            "split_tokens": "i32"}
    # (rope, fixed splits, window, soft cap): the window/cap pair is Gemma 2's local layer
    for rope, fixed, window, cap in ((False, False, 0, 0.0), (True, False, 0, 0.0),
                                     (False, True, 0, 0.0), (False, False, 4096, 50.0)):
        rows.append(_build("paged_attn decode split" + (" rope" if rope else "")
                           + (" fixed" if fixed else "") + (" window cap" if window else ""),
                           paged_attention._paged_attn_kernel, asig,
                           dict(GROUP=4, G_PAD=16, BLOCK_Q=1, BLOCK_N=64, BLOCK_SIZE=16,
                                HEAD_DIM=128, D_PAD=128, SPLIT=True, DOT_PREC="tf32",
                                UPCAST=False, QUANT=0, TREE=False, ROPE=rope,
                                FIXED_SPLIT=fixed, ALL_MASKED=False, WINDOW=window,
                                SOFTCAP=cap), 4, 3))
    msig = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16",
            "qsl_ptr": "*i32", "num_splits": "i32", "stride_ot": "i32", "stride_oh": "i32",
            "seq_lens_ptr": "*i32", "split_tokens": "i32"}
    for fixed in (False, True):
        rows.append(_build("merge_splits" + (" fixed" if fixed else ""),
                           paged_attention._merge_splits_kernel, msig,
                           dict(HEAD_DIM=128, D_PAD=128, S_PAD=16, FIXED_SPLIT=fixed,
                                WINDOW=0), 4, 1))
    bsig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16",
            "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_xk": "i32",
            "stride_wn": "i32", "stride_wk": "i32", "stride_ym": "i32", "stride_yn": "i32"}
    for m in (1, 256):  # the two tile shapes
        cfg = batch_invariant.matmul_config(m, batch_invariant.torch.bfloat16)
        rows.append(_build(f"bi_matmul {cfg.block_m}x{cfg.block_n}x{cfg.block_k}",
                           batch_invariant._bi_matmul_kernel, bsig,
                           dict(stride_xk=1, stride_wk=1, stride_yn=1,  # as launched
                                HAS_BIAS=False, EVEN_K=True, BLOCK_M=cfg.block_m,
                                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8,
                                DOT_PREC="tf32", UPCAST=False), cfg.num_warps,
                           cfg.num_stages))
    rsig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "res_out_ptr": "*bf16", "n_rows": "i32", "n_inner": "i32", "hidden": "i32",
            "stride_xa": "i32", "stride_xb": "i32", "eps": "fp32", "scale_ptr": "*fp32"}
    rows.append(_build("rms_norm", rms_norm._rms_norm_kernel, rsig,
                       dict(HAS_RESIDUAL=True, ROWS=1, BLOCK_N=4096,
                            FP8_OUT=False, EMULATE=False), 8, 1))
    # the FP8-output form (rms_norm_fp8: the input of the FP8 W8A8 decode GEMV)
    rows.append(_build("rms_norm fp8 out", rms_norm._rms_norm_kernel,
                       {**rsig, "out_ptr": "*fp8e4nv"},
                       dict(HAS_RESIDUAL=True, ROWS=1, BLOCK_N=4096,
                            FP8_OUT=True, EMULATE=False), 8, 1))
    qsig = {"pos_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
            "cs_ptr": "*fp32", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "slot_ptr": "*i64",
            "q_out_ptr": "*bf16", "k_out_ptr": "*bf16", "ks_ptr": "*bf16", "vs_ptr": "*bf16",
            "k_inv_scale": "fp32", "v_inv_scale": "fp32", "n_slots": "i32",
            "num_heads": "i32", "num_kv_heads": "i32", "half": "i32", "stride_qt": "i32",
            "stride_qh": "i32", "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32",
            "stride_vh": "i32", "stride_cs": "i32", "stride_c_slot": "i32",
            "stride_c_head": "i32", "stride_s_slot": "i32"}
    rows.append(_build("rotary_cache", rotary_kv._rotary_cache_kernel, qsig,
                       dict(H_PAD=32, KVH_PAD=8, HALF_PAD=64, QUANT=0, EMULATED=False),
                       4, 1))
    rows = [r for r in rows if r]
    for r in rows:
        print(json.dumps(r), flush=True)
    bad = [r for r in rows if not r["fits"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
