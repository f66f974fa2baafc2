"""``kvflow plan``: arguments, model lookup, and output."""

from __future__ import annotations

import argparse
import json

from kvflow.errors import InvalidParameterError, ModelNotFoundError

DEFAULT_PLAN_MODEL = "llama-3.1-8b"


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="capacity planner: KV memory, concurrency, decode and "
                       "prefill speed of a model on a GPU, without loading it")
    p.add_argument("--model", default=DEFAULT_PLAN_MODEL,
                   help="a preset name, a Hugging Face directory (config.json) or a GGUF "
                   f"file (default: {DEFAULT_PLAN_MODEL})")
    p.add_argument("--dtype", default="bf16", help="weights: bf16, fp16 or fp32")
    p.add_argument("--kv-dtype", default="auto", help="KV cache: auto (= --dtype), bf16, "
                   "fp16, fp32, fp8 or int8 (the engine's --kv-cache-dtype)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs one replica is split over (default: 1)")
    p.add_argument("--gpu", default=None, help="h200 (default), h100, a100-80g, l40s, or "
                   "custom with the three --gpu-* figures below")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="GPU memory (GiB)")
    p.add_argument("--gpu-bandwidth-tbs", type=float, default=None,
                   help="HBM bandwidth (TB/s)")
    p.add_argument("--gpu-tflops", type=float, default=None,
                   help="dense matmul rate in --dtype (TFLOP/s)")
    p.add_argument("--gpu-interconnect-gbs", type=float, default=None,
                   help="GPU-to-GPU bandwidth per direction for all-reduces (GB/s)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use (default: 0.9)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (default: the model's context length)")
    p.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens per request (default: 128, as GPU-A)")
    p.add_argument("--output-len", type=int, default=256,
                   help="output tokens per request (default: 256, as GPU-A)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget of one engine step (default: 8192)")
    p.add_argument("--max-loras", type=int, default=0,
                   help="LoRA device slots to budget for (0: LoRA off)")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="rank each LoRA slot is sized for")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="most requests running at once in the engine (default: 256)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="also estimate an offline run of this many requests sent at once "
                   "(like kvflow bench throughput)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256,512",
                   help="decode batch sizes to tabulate, comma-separated (default: "
                   "1,2,4,...,512)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the plan as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="throughput vs latency chart by batch size (needs matplotlib: "
                   "pip install 'kvflow[plot]')")
    p.set_defaults(func=cmd_plan)


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)
    except ValueError:
        sizes = ()
    if not sizes or any(b < 1 for b in sizes):
        raise InvalidParameterError(f"--batch-sizes must be positive integers separated by "
                                    f"commas, e.g. 1,8,64; got {text!r}", param="batch_sizes")
    return sizes


def resolve_arch(model: str):
    """A preset, HF directory or GGUF file -> ModelArchConfig, never loading weights."""
    from kvflow.models.registry import PRESETS, resolve_model

    try:
        return resolve_model(model, "dummy").arch
    except ModelNotFoundError:
        raise ModelNotFoundError(
            f"unknown model {model!r}: it is neither a preset ({', '.join(sorted(PRESETS))}) "
            "nor a local Hugging Face directory or GGUF file") from None


def inputs_from_args(ns: argparse.Namespace):
    from kvflow.plan.gpus import get_gpu
    from kvflow.plan.model import canonical_dtype
    from kvflow.plan.planner import PlanInputs

    dtype = canonical_dtype(ns.dtype, "dtype", allow_fp8=False)
    kv_dtype = (None if str(ns.kv_dtype).lower() == "auto"
                else canonical_dtype(ns.kv_dtype, "kv_dtype", allow_fp8=True))
    gpu = get_gpu(ns.gpu, memory_gib=ns.gpu_memory_gib, bandwidth_tbs=ns.gpu_bandwidth_tbs,
                  tflops=ns.gpu_tflops, interconnect_gbs=ns.gpu_interconnect_gbs)
    return PlanInputs(
        model=ns.model, arch=resolve_arch(ns.model), gpu=gpu, dtype=dtype, kv_dtype=kv_dtype,
        tensor_parallel_size=ns.tensor_parallel_size,
        gpu_memory_utilization=ns.gpu_memory_utilization, max_model_len=ns.max_model_len,
        input_len=ns.input_len, output_len=ns.output_len,
        max_num_batched_tokens=ns.max_num_batched_tokens, max_num_seqs=ns.max_num_seqs,
        batch_sizes=parse_batch_sizes(ns.batch_sizes), num_prompts=ns.num_prompts,
        max_loras=ns.max_loras, max_lora_rank=ns.max_lora_rank,
        stored_bytes_per_param=stored_bytes_per_param(ns.model))


def stored_bytes_per_param(model: str) -> float | None:
    """A GGUF file's weights as stored (bytes per element over all its tensors): the
    engine keeps those blocks quantized on CPU, a mixture of experts' experts included,
    so they, not ``--dtype``, fill memory."""
    from kvflow.models.registry import resolve_model

    resolved = resolve_model(model, "auto") if model.endswith(".gguf") or \
        model in ("smollm2-135m",) else None
    if resolved is None or resolved.load_format != "gguf":
        return None
    from kvflow.models.gguf_file import gguf_weight_bytes

    nbytes, elements = gguf_weight_bytes(resolved.path)
    return nbytes / elements if elements else None


def cmd_plan(ns: argparse.Namespace) -> int:
    from kvflow.plan.planner import build_plan
    from kvflow.plan.report import format_table, plan_to_dict, write_plot

    plan = build_plan(inputs_from_args(ns))
    print(format_table(plan))
    if ns.plot:
        write_plot(plan, ns.plot)
        print(f"saved {ns.plot}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(plan_to_dict(plan), f, indent=2)
        print(f"saved {ns.json}")
    return 0
