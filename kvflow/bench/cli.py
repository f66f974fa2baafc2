"""Argument parsing for ``kvflow bench``."""

from __future__ import annotations

import argparse

from kvflow.engine.args import EngineArgs


def _common(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p, model_positional=False)
    p.add_argument("--backend", default="kvflow",
                   help="kvflow, hf (transformers generate, padded static batches), "
                   "llamacpp (llama-cpp-python on the same GGUF file), both (hf and kvflow), "
                   "or a comma-separated list, all in the same run; eager-vs-compiled: "
                   "kvflow with --enforce-eager, then kvflow with CUDA graphs / the "
                   "compiled CPU step, in the same run; threads-all-vs-adaptive: kvflow "
                   "with --cpu-step-threads all, then kvflow (CPU thread policy); "
                   "f32act-vs-int8act: kvflow with KVFLOW_CPU_INT8_ACT=0, then kvflow "
                   "(the C++ step's GGUF GEMV on float32 vs int8 activations)")
    p.add_argument("--quantizations", default=None,
                   help="run kvflow once per listed --quantization value in the same run, "
                   "e.g. none,gguf,int8,int4 (int4 options as in bench quality: int4-g64); "
                   "w8a8-int8, llm-int8, or a pre-quantized checkpoint directory of the "
                   "same model (e.g. a kvflow quantize --method smoothquant output)")
    p.add_argument("--kv-cache-dtypes", default=None,
                   help="run kvflow once per listed --kv-cache-dtype value in the same run, "
                   "e.g. auto,int8,fp8 (ratios over auto)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature for both backends (0 = greedy)")
    p.add_argument("--save-result", default=None, help="write the result JSON here")
    p.add_argument("--measure-gpu-idle", action="store_true",
                   help="report the GPU idle time between engine steps (CUDA events)")


def _lazy(module: str, name: str):
    """A command's entry point, imported only when that command runs (building the parser
    imports no benchmark module's heavy dependencies)."""
    def run(ns: argparse.Namespace):
        import importlib

        return getattr(importlib.import_module(module), name)(ns)
    return run


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (throughput, latency, serve)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    tp = kinds.add_parser("throughput", help="offline throughput on a dataset")
    _common(tp)
    tp.add_argument("--dataset", choices=["random", "shared-prefix", "chat", "edit"],
                    default="random",
                    help="random: random token prompts; shared-prefix: --prefix-len shared "
                    "tokens then --input-len unique ones per prompt; chat: open questions "
                    "(chat template); edit: passages to copy back with small edits")
    tp.add_argument("--spec-baseline", action="store_true",
                    help="with --speculative-config: also run kvflow without speculation "
                    "in the same invocation and report the ratio")
    tp.add_argument("--prefix-len", type=int, default=1000,
                    help="shared-prefix dataset: length of the common prefix")
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", type=int, default=256)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--range-ratio", type=float, default=0.0,
                    help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    tp.add_argument("--min-input-len", type=int, default=None, help="overrides the range")
    tp.add_argument("--max-input-len", type=int, default=None)
    tp.add_argument("--min-output-len", type=int, default=None)
    tp.add_argument("--max-output-len", type=int, default=None)
    tp.add_argument("--n", type=int, default=1,
                    help="samples per prompt (parallel sampling: the samples share the "
                    "prompt's KV blocks, copy-on-write; kvflow backend only)")
    tp.add_argument("--hf-batch-size", type=int, default=None,
                    help="static batch size of the hf backend (default: all prompts)")

    tp.set_defaults(func=_lazy("kvflow.bench.offline", "run_throughput"))

    lat = kinds.add_parser("latency", help="latency of one batch, ms per output token")
    _common(lat)
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=256)
    lat.add_argument("--num-iters", type=int, default=5)
    lat.add_argument("--chat-prompt", default=None,
                     help="use this user message, with the model's chat template, as the "
                     "prompt instead of --input-len random tokens")
    lat.add_argument("--profile-host", action="store_true",
                     help="kvflow: after the timed runs, report where each step's host time "
                     "goes (engine loop, scheduler, step building, model forward per layer, "
                     "sampling, output processing) and the torch ops it issues")
    lat.add_argument("--hf-cache-implementation", default=None,
                     help="hf backend cache, e.g. static (default: dynamic)")

    lat.set_defaults(func=_lazy("kvflow.bench.offline", "run_latency"))

    sv = kinds.add_parser("spec-verify", help="cost of speculative verification steps: "
                          "always-right drafts at k = 1..8 and Medusa trees vs plain decoding")
    _common(sv)
    from kvflow.bench.spec_verify import add_spec_verify_args

    add_spec_verify_args(sv)
    sv.set_defaults(func=_lazy("kvflow.bench.spec_verify", "run_spec_verify"))

    ar = kinds.add_parser("allreduce", help="the engine's tensor-parallel all-reduce at "
                          "TP message sizes (gloo on CPU, NCCL on GPU) against the planner")
    from kvflow.bench.allreduce import add_allreduce_args

    add_allreduce_args(ar)

    ar.set_defaults(func=_lazy("kvflow.bench.allreduce", "run_allreduce"))

    qual = kinds.add_parser("quality", help="perplexity, KL divergence and top-1 agreement "
                            "of quantized weights against the dense model on a fixed text")
    from kvflow.bench.quality import add_quality_args

    add_quality_args(qual)

    qual.set_defaults(func=_lazy("kvflow.bench.quality", "run_quality"))

    srv = kinds.add_parser("serve", help="serving benchmark against a running OpenAI-"
                           "compatible server: TTFT, TPOT, ITL, end-to-end latency")
    from kvflow.bench.serve import add_serve_args

    add_serve_args(srv)

    srv.set_defaults(func=_lazy("kvflow.bench.serve", "run_serve_benchmark"))

    so = kinds.add_parser("structured", help="constrained decoding: JSON-schema validity, "
                          "overhead per output token, compile time, ngram speculation")
    EngineArgs.add_cli_args(so, model_positional=False)
    from kvflow.bench.structured import add_structured_args

    add_structured_args(so)
    so.set_defaults(func=_lazy("kvflow.bench.structured", "run_structured"))

    abl = kinds.add_parser("ablation", help="one workload with each optimization switched "
                           "off in turn: markdown report, PNG plots, JSON")
    EngineArgs.add_cli_args(abl, model_positional=False)
    from kvflow.bench.ablation import add_ablation_args

    add_ablation_args(abl)

    abl.set_defaults(func=_lazy("kvflow.bench.ablation", "run_ablation"))
