"""``kvflow bench lora``: throughput of a LoRA mix over 1, 4, 16 ... adapters against
the base requests, in one run on one engine (rounds alternate, so a contended machine
hits all of them alike), and against the base model alone on a second engine without
LoRA (``--plain-baseline``, after the first stops); and the cost of an adapter swap
(host cache -> device slot, and disk -> slot).

Adapters are PEFT directories of random weights (rank ``--lora-rank`` on every decoder
linear) written for the model's shapes; the base stays as loaded (the embedded model's
GGUF int4 linears on CPU), the adapters in the activation dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

from kvflow.engine.args import EngineArgs

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_lora_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter-counts", default="1,4,16",
                   help="adapters the requests spread over, one mix per count")
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the random adapters")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per mix")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2,
                   help="times each configuration runs (alternating); the best counts")
    p.add_argument("--swap-iters", type=int, default=3, help="adapter swaps timed")
    p.add_argument("--plain-baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the base requests on a second engine without "
                        "--enable-lora (the base model alone: its fused paths, graphs "
                        "without LoRA launches), after the LoRA engine stops")


def write_random_adapter(folder: str, arch, rank: int, seed: int,
                         targets: list[str] = TARGETS, std: float = 0.02,
                         layers: int | None = None) -> None:
    """A PEFT adapter directory of random A and B for ``arch``'s decoder linears (the
    first ``layers`` of them; None: all)."""
    import torch
    from safetensors.torch import save_file

    from kvflow.lora.adapter import module_shapes

    os.makedirs(folder, exist_ok=True)
    shapes = module_shapes(arch)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(arch.num_hidden_layers if layers is None else layers):
        for t in targets:
            fin, fout = shapes[t]
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * std
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": targets, "bias": "none"}, f)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _run(llm, prompts, params, loras, device: str) -> dict:
    _sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    _sync(device)
    s = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": round(s, 3), "output_tokens": out_tokens,
            "output_tokens_per_s": round(out_tokens / s, 2),
            "total_tokens_per_s": round((out_tokens + sum(map(len, prompts))) / s, 2)}


def _swap_cost(runner, loras, iters: int, device: str) -> dict:
    """Seconds to move an adapter into a slot from the host cache, and from disk."""
    from kvflow.lora.slots import LoRASlots

    slots: LoRASlots = runner.lora.slots
    host, disk = [], []
    for i in range(iters):
        req = loras[i % len(loras)]
        for where, times in (("host", host), ("disk", disk)):
            slots.slot_ids = [None] * len(slots.slot_ids)  # empty every slot
            if where == "disk":
                slots.host.pop(req.lora_int_id, None)
            else:
                slots.host_adapter(req)
            _sync(device)
            start = time.perf_counter()
            slots.activate([req])
            _sync(device)
            times.append(time.perf_counter() - start)
    return {"host_to_slot_ms": round(1e3 * min(host), 2),
            "disk_to_slot_ms": round(1e3 * min(disk), 2),
            "slot_mib": round(slots.num_bytes / len(slots.slot_ids) / (1 << 20), 2)}


def run_lora_bench(ns: argparse.Namespace) -> int:
    from kvflow import LLM, LoRARequest, SamplingParams
    from kvflow.bench.datasets import random_requests
    from kvflow.bench.machine import save_result
    from kvflow.bench.offline import _config_summary, _special_ids

    counts = [int(c) for c in ns.adapter_counts.split(",") if c]
    args = EngineArgs.from_cli_args(ns)
    args = dataclasses.replace(args, enable_lora=True, enable_prefix_caching=False,
                               max_lora_rank=max(args.max_lora_rank, ns.lora_rank))
    cfg = args.create_engine_config()
    device = cfg.device.device
    reqs = random_requests(ns.num_prompts, (ns.input_len, ns.input_len), (1, 1),
                           cfg.model.arch.vocab_size, 0, _special_ids(cfg))
    prompts = [r.prompt_token_ids for r in reqs]
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    tmp = tempfile.mkdtemp(prefix="kvflow-lora-bench-")
    loras = []
    for i in range(max(counts)):
        write_random_adapter(os.path.join(tmp, f"a{i}"), cfg.model.arch, ns.lora_rank, i)
        loras.append(LoRARequest(f"a{i}", i + 1, os.path.join(tmp, f"a{i}")))
    llm = LLM(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
    runner = llm.engine.core.executor.runner
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    configs = {"base": [None] * len(prompts)}
    for n in counts:
        configs[f"lora_{n}"] = [loras[i % n] for i in range(len(prompts))]
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    for r in range(ns.rounds):
        for name, mix in configs.items():
            swaps = runner.lora.slots.num_swaps
            res = _run(llm, prompts, params, mix, device)
            res["swaps"] = runner.lora.slots.num_swaps - swaps
            runs[name].append(res)
            print(f"round {r} {name}: {res['output_tokens_per_s']} output tok/s "
                  f"({res['seconds']} s, {res['swaps']} swaps)")
    best = {k: max(v, key=lambda x: x["output_tokens_per_s"]) for k, v in runs.items()}
    base = best["base"]["output_tokens_per_s"]
    ratios = {k: round(v["output_tokens_per_s"] / base, 3) for k, v in best.items()}
    swap = _swap_cost(runner, loras, ns.swap_iters, device)
    print(f"ratios over base: {ratios}; swap: {swap}")
    llm.shutdown()
    ratios_plain = None
    if ns.plain_baseline:  # the base model alone, on an engine without LoRA
        plain_args = dataclasses.replace(args, enable_lora=False)
        llm = LLM(**{f.name: getattr(plain_args, f.name) for f in dataclasses.fields(args)})
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
        runs["plain_engine"] = []
        for r in range(ns.rounds):
            res = _run(llm, prompts, params, None, device)
            runs["plain_engine"].append(res)
            print(f"round {r} plain engine: {res['output_tokens_per_s']} output tok/s "
                  f"({res['seconds']} s)")
        llm.shutdown()
        plain = max(runs["plain_engine"], key=lambda x: x["output_tokens_per_s"])
        best["plain_engine"] = plain
        ratios_plain = {k: round(v["output_tokens_per_s"] / plain["output_tokens_per_s"], 3)
                        for k, v in best.items()}
        print(f"ratios over the plain engine: {ratios_plain}")
    save_result(ns.save_result, {
        "benchmark": "lora-mix",
        "workload": {"num_prompts": ns.num_prompts, "input_len": ns.input_len,
                     "output_len": ns.output_len, "lora_rank": ns.lora_rank,
                     "adapter_counts": counts, "rounds": ns.rounds,
                     "max_loras": cfg.lora.max_loras,
                     "targets": TARGETS},
        "engine_config": _config_summary(cfg),
        "best": best, "ratio_vs_base": ratios, "ratio_vs_plain_engine": ratios_plain,
        "runs": runs, "swap": swap,
        "notes": "one engine with --enable-lora; base = requests without an adapter on it "
                 "(CPU: the C++ step, which adds the adapter rows' deltas too; CUDA: the "
                 "same graphs, which hold the LoRA kernels and find no tiles); rounds "
                 "alternate base and "
                 "mixes; the best round counts; mixes assign adapters round-robin; "
                 "plain_engine = the base requests on a second engine without "
                 "--enable-lora, run after the first stops (not alternated with it)"})
    return 0
