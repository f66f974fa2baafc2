"""MoE-A summary: batch-1 decode tokens/s of a mixture of experts against its byte bound.

The bound: one decode step must read the weights its token uses (attention, the router,
its top-k experts of each MoE layer, the final norm and lm_head: ``kvflow plan``'s
``weight_read_bytes(1)``) plus the KV cache at the mean context, at the GPU's achievable
HBM bandwidth (the plan's preset for the card). Reads ``gpu-a-moe.json`` (a
``kvflow bench latency`` result) and writes ``moe-a-summary.json`` beside it.

    python benchmarks/gpu/moe_summary.py $OUT/gpu-a-moe.json --model qwen3-30b-a3b
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from kvflow.bench.machine import save_result  # noqa: E402
from kvflow.config import ModelArchConfig  # noqa: E402
from kvflow.models.registry import PRESETS  # noqa: E402
from kvflow.plan.gpus import get_gpu  # noqa: E402
from kvflow.plan.model import ShardedModel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("result")
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--gpu", help="plan preset (default: from the device name)")
    args = ap.parse_args()
    with open(args.result, encoding="utf-8") as f:
        res = json.load(f)
    run = res["kvflow"]
    if args.gpu is None:
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "H200"
        args.gpu = "h100" if "H100" in name else "h200"
    gpu = get_gpu(args.gpu)
    arch = ModelArchConfig.from_hf_config(PRESETS[args.model])
    m = ShardedModel(arch, 1, "bfloat16", "bfloat16")
    w = res["workload"]
    context = w["input_len"] + w["output_len"] / 2
    step_bytes = m.weight_read_bytes(1) + context * m.kv_bytes_per_token
    bound = gpu.hbm_bytes_per_s / step_bytes
    tps = run["decode_tokens_per_s_per_seq"]
    out = dict(command="python " + " ".join(sys.argv), source=args.result,
               commit=res.get("commit"), machine=res.get("machine"), model=args.model,
               gpu=gpu.name, hbm_bytes_per_s=gpu.hbm_bytes_per_s, gpu_source=gpu.source,
               active_params=arch.num_active_params, total_params=arch.num_params,
               step_read_bytes=step_bytes, bound_tokens_per_s=bound,
               decode_tokens_per_s=tps, fraction_of_bound=tps / bound,
               target_fraction=0.75)
    print(f"{args.model} batch 1 on {gpu.name}: {tps:.1f} tok/s, bound {bound:.1f} tok/s "
          f"({step_bytes / 1e9:.2f} GB per step at {gpu.hbm_bytes_per_s / 1e12:.2f} TB/s): "
          f"{100 * tps / bound:.1f}% (target 75%)")
    save_result(os.path.join(os.path.dirname(args.result), "moe-a-summary.json"), out)


if __name__ == "__main__":
    main()
