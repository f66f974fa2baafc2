"""The ``kvflow quantize`` command line (torch-free: the CLI builds every parser at start;
the work is kvflow/quantize/smoothquant.py)."""

from __future__ import annotations

import argparse


def _run(ns: argparse.Namespace) -> int:
    from kvflow.quantize.smoothquant import run_quantize

    return run_quantize(ns)


def add_quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="write a quantized checkpoint: smoothquant "
                       "(int8 W8A8 with calibrated per-channel smoothing), on CPU")
    p.add_argument("--method", default="smoothquant", choices=["smoothquant"],
                   help="smoothquant: calibrate activation ranges on --calib, fold smoothing "
                   "factors into the norms and linears, int8 weights per output channel")
    p.add_argument("--model", default="smollm2-135m", help="the float model: preset, "
                   "Hugging Face directory or GGUF file (GGUF blocks are dequantized)")
    p.add_argument("--calib", default=None, help="calibration text: a UTF-8 file, or "
                   "'builtin' (default: kvflow's own calibration text)")
    p.add_argument("--output", required=True, help="directory for the checkpoint "
                   "(config.json, model.safetensors, tokenizer files)")
    p.add_argument("--alpha", type=float, default=0.5, help="migration strength: "
                   "s_j = max|X_j|^alpha / max|W_j|^(1 - alpha); 0 = no smoothing")
    p.add_argument("--fold", default="all", choices=["all", "norms"],
                   help="all: fold 1/s into the RMSNorms (qkv, gate_up) and into v_proj / "
                   "up_proj rows (o_proj, down_proj); norms: only the RMSNorm folds, o_proj "
                   "and down_proj keep an explicit input_smooth vector")
    p.add_argument("--context", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--max-windows", type=int, default=16,
                   help="calibration windows at most (16 x 512 tokens by default)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=_run)
