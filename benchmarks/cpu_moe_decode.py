"""CPU decode of a small mixture of experts, kvflow against transformers on the same weights.

The ``qwen3-moe-123m`` preset (Qwen3-30B-A3B's layout scaled down: 32 experts, top-4,
123M parameters, 23M active) is built in transformers with seeded random weights
(N(0, 0.02) matrices) and saved as a Hugging Face folder; then ``kvflow bench latency
--backend both`` runs kvflow and transformers' ``generate`` on that folder, float32, at
batch 1 and batch 32, one result JSON each (the command, machine and commit inside).

    python benchmarks/cpu_moe_decode.py --folder /tmp/qwen3-moe-123m \
        --out-prefix benchmarks/results/cpu-moe-qwen3-123m
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch


def build(folder: str) -> None:
    import transformers

    from kvflow.bench.hf_backend import _MODEL_TYPES
    from kvflow.models.registry import PRESETS

    cfg = dict(PRESETS["qwen3-moe-123m"])
    config = transformers.AutoConfig.for_model(_MODEL_TYPES[cfg["architectures"][0]], **cfg)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.02)
    hf.save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", default="/tmp/qwen3-moe-123m")
    ap.add_argument("--out-prefix", default="benchmarks/results/cpu-moe-qwen3-123m")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-iters", type=int, default=2)
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.folder, "config.json")):
        build(args.folder)
    for b in args.batch_sizes.split(","):
        cmd = [sys.executable, "-m", "kvflow.cli", "bench", "latency", "--model", args.folder,
               "--backend", "both", "--dtype", "float32", "--batch-size", b,
               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--num-iters", str(args.num_iters), "--max-model-len", "512",
               "--save-result", f"{args.out_prefix}-b{b}.json"]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
