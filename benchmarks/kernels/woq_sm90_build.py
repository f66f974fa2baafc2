"""Build the weight-only GEMMs for sm_90 (H100/H200) on a machine without a GPU, with the
ptxas Triton ships, and report registers, spill bytes and shared memory per launch
configuration: a cheap first filter for tile configurations before GPU time is spent.

    python benchmarks/kernels/woq_sm90_build.py                 # the defaults (JSON lines)
    python benchmarks/kernels/woq_sm90_build.py --bits 4 --m 1 --block-n 128 --warps 4

Run it without TRITON_INTERPRET (the interpreter replaces the compiler).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvflow.kernels import w4a16_gemm, w8a16_gemm  # noqa: E402
from kvflow.kernels.woq_config import WoqConfig, choose_config  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SMEM_LIMIT = 227 * 1024  # a Hopper block's most shared memory
H200_SMS = 132  # so the split-K choice (atomic output) is the H200's
DEFAULT_CASES = [(1, 4096, 4096), (16, 4096, 4096), (256, 28672, 4096)]


def _build(kernel, sig: dict, consts: dict, cfg: WoqConfig) -> dict:
    sig = {**sig, **{c: "constexpr" for c in consts}}
    names = list(sig)
    # What a real launch specializes: 16-aligned pointers, shapes divisible by 16 (M and
    # split_k are left generic).
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n] != "constexpr" and n not in ("M", "split_k")}
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    fields = dict(kv.split(":", 1) for kv in usage.split("Function", 1)[1].split()[1:]
                  if ":" in kv)
    # FP8 dots: how many K the tensor cores sum before a float32 promotion (2^30: never)
    imprecise = sorted({int(v) for v in re.findall(r"maxNumImpreciseAcc = (\d+)", k.asm["ttgir"])})
    return {"registers": int(fields["REG"]), "spill_bytes": int(fields["STACK"]),
            "shared_bytes": k.metadata.shared, "fits": int(fields["STACK"]) == 0
            and k.metadata.shared <= SMEM_LIMIT, "max_num_imprecise_acc": imprecise,
            **_sass_counts(k.asm["cubin"])}


def _sass_counts(cubin: bytes) -> dict:
    """Tensor-core instructions in the machine code (the whole kernel, prologue included):
    wgmma (HGMMA) and the waits for their results (WARPGROUP.DEPBAR: a wait after every
    wgmma group serializes the K loop), mma.sync (HMMA), CTA memory barriers."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name],
                              capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M)
    return {"sass_instructions": len(ops),
            "sass_hgmma": sum(o.startswith("HGMMA") for o in ops),
            "sass_wgmma_waits": sum(o.startswith("WARPGROUP.DEPBAR") for o in ops),
            "sass_hmma": sum(o.startswith("HMMA") for o in ops),
            "sass_membar": sum(o.startswith("MEMBAR") for o in ops)}


def build_w4(cfg: WoqConfig, bias: bool = True, group: int = 128) -> dict:
    split = cfg.split_k > 1
    sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16",
           "out_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32",
           "K": "i32", "KW": "i32", "stride_xm": "i32", "stride_om": "i32", "split_k": "i32"}
    consts = dict(GROUP=group, HAS_BIAS=bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  SPLIT=split)
    if not cfg.dot:
        return _build(w4a16_gemm._w4a16_gemv_kernel, sig, consts, cfg)
    consts.update(SCALE_AFTER=cfg.scale_after, UPCAST=False)
    return _build(w4a16_gemm._w4a16_kernel, sig, consts, cfg)


def build_int4_dequant(group: int = 128, bias: bool = True, block_n: int = 64) -> dict:
    from kvflow.kernels import int4_dequant

    sig = {"qw_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
           "N": "i32", "K": "i32", "KW": "i32"}
    consts = dict(GROUP=group, HAS_BIAS=bias, BLOCK_N=block_n)
    return _build(int4_dequant._int4_dequant_kernel, sig, consts,
                  WoqConfig(16, block_n, 256, num_warps=4, num_stages=1))


def build_w8(cfg: WoqConfig, group: int | None = None) -> dict:
    split = cfg.split_k > 1
    sig = {"x_ptr": "*bf16", "qw_ptr": "*i8", "s_ptr": "*fp32" if group is None else "*bf16",
           "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32", "split_k": "i32"}
    consts = dict(GROUP=group or cfg.block_k, PER_CHANNEL=group is None,
                  HAS_BIAS=group is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, SPLIT=split, DOT=cfg.dot, UPCAST=False)
    return _build(w8a16_gemm._w8a16_kernel, sig, consts, cfg)


def default_rows() -> list[dict]:
    rows = []
    for m, n, k in DEFAULT_CASES:
        for bits, variant in ((4, True), (4, False), (8, None), (8, 32)):
            cfg = choose_config(m, n, k, torch.device("cpu"), bits, sms=H200_SMS)
            if bits == 4 and cfg.dequant:  # dense weight + cuBLAS: the dequant kernel
                res = build_int4_dequant(bias=variant)
            elif bits == 4:
                res = build_w4(cfg, bias=variant)
            else:
                res = build_w8(cfg, group=variant)
            rows.append({"m": m, "n": n, "k": k, "bits": bits, "variant": variant,
                         "config": dataclasses.asdict(cfg), **res})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", type=int, choices=[4, 8])
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--block-k", type=int, default=128)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--split-k", type=int, default=4)
    ns = p.parse_args()
    if ns.bits is None:
        for row in default_rows():
            print(json.dumps(row))
        return 0
    bm = max(16, triton.next_power_of_2(ns.m))
    cfg = WoqConfig(bm, ns.block_n, ns.block_k, ns.split_k, True, ns.warps, ns.stages,
                    scale_after=bm <= 16)
    print(json.dumps({"config": dataclasses.asdict(cfg),
                      **(build_w4(cfg) if ns.bits == 4 else build_w8(cfg))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
