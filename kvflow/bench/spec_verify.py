"""``kvflow bench spec-verify``: what a speculative verification step costs.

With random weights (``--load-format dummy``) no real proposer's acceptance means
anything, so this measures the machinery: batch-1 decode without speculation, then the
same workload verifying k = 1..K drafts per step, all of them kept, and Medusa candidate
trees of several sizes (each step verifies the whole tree, keeps a full-depth path and
moves its K/V). Drafts come from the bench-only ``OracleProposer`` (the plain run's
tokens) and are kept by its BENCH-ONLY verdict override (``accept_all``): with random
weights the k + 1-row verification forward is not bit-identical to the 1-row decode, so
"right" drafts are rejected at once, and only the override makes the steps all-accepted
ones (the output is then not the target's: these runs are cost measurements). Each run
reports decode tokens/s, verification steps, tokens per step (k + 1 for a chain) and ms
per step; its ratio over plain decoding is the best speculation can do at that k. It also times the Medusa heads' own forward at this shape (shared lm_head), and at
``--overhead-batch-size`` (64) plain decoding vs a speculative engine that switches
itself off (``disable_by_batch_size``) vs one forced to verify always-right drafts.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time

from kvflow.engine.args import EngineArgs


def add_spec_verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="chain draft counts to cost")
    p.add_argument("--tree-sizes", default="8,16,32,63",
                   help="Medusa tree sizes (nodes) to cost; empty: none")
    p.add_argument("--tree-depth", type=int, default=4, help="heads (tree depth) for trees")
    p.add_argument("--overhead-batch-size", type=int, default=64,
                   help="batch for the large-batch overhead runs (0: skip)")
    p.add_argument("--overhead-k", type=int, default=3)
    p.add_argument("--eager-ks", default="",
                   help="chain draft counts to cost again with the verification CUDA graphs "
                        "set aside (eager steps, same engine); empty: none")
    p.add_argument("--eager-tree-sizes", default="",
                   help="tree sizes to cost again eagerly (verification graphs set aside)")
    p.add_argument("--profile", action="store_true",
                   help="torch-profile a few steps of chain k=4 (graphs and eager) and of the "
                        "smallest tree: host time per op, in the result JSON")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _run(llm, prompts: list[list[int]], output_len: int, device: str) -> dict:
    """Prefill-only and full runs of ``prompts``; decode time is the difference."""
    from kvflow import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    stats = llm.engine.core.scheduler.spec_stats
    llm.generate(prompts, full, use_tqdm=False)  # warm-up (graphs, kernels, threads)
    times = []
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        _sync(device)
        times.append(time.perf_counter() - t0)
    prefill = min(times)
    before = stats.copy()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, full, use_tqdm=False)
    _sync(device)
    total = time.perf_counter() - t0
    decode = max(total - prefill, 1e-9)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs) - len(prompts)
    run = stats.since(before)  # this run's counters, the engine's own timers among them
    verify_steps = run.num_drafts // max(len(prompts), 1)
    accepted, drafted = run.num_accepted_tokens, run.num_draft_tokens
    steps = max(output_len - 1 - accepted // max(len(prompts), 1), 1)
    # Verification steps cost the same kept or rejected: their cost per step, and what
    # drafts that are always right (k + 1 tokens a step) would give at that cost.
    verify_ms = decode / max(verify_steps, 1) * 1000
    return {"ms_per_verify_step": round(verify_ms, 3),
            "engine_verify_ms": round(run.mean_verify_ms, 3),
            "engine_draft_ms": round(run.mean_draft_ms, 3),
            "drafts_per_verify_step": round(drafted / max(run.num_drafts, 1), 3),
            "decode_s": round(decode, 4), "prefill_s": round(prefill, 4),
            "decode_tokens_per_s": round(tokens / decode, 2),
            "verify_steps_per_request": verify_steps, "steps_per_request": steps,
            "tokens_per_step": round((output_len - 1) / steps, 3),
            "ms_per_step": round(decode / steps * 1000, 3),
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "outputs": [list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
                        for o in outs]}


def _heads_ms(llm, num_heads: int, device: str, iters: int = 20) -> float:
    """Time of the Medusa heads' forward for one hidden state at this shape (each head a
    residual block and the shared lm_head), plus the top-k the tree reads."""
    import torch

    from kvflow.spec_decode.heads_config import MedusaHeadsConfig
    from kvflow.spec_decode.medusa import MedusaHeads

    runner = llm.engine.core.executor.runner
    arch = runner.model.config
    dtype = next(p.dtype for p in runner.model.parameters() if p.is_floating_point())
    cfg = MedusaHeadsConfig(num_heads, 1, arch.hidden_size, arch.vocab_size, True)
    heads = MedusaHeads(cfg, arch.hidden_size, arch.vocab_size).to(runner.device, dtype)
    x = torch.randn(1, arch.hidden_size, device=runner.device, dtype=dtype)
    with torch.inference_mode():
        for _ in range(3):
            heads.logits(x, runner.model.compute_logits).topk(8, dim=-1)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            heads.logits(x, runner.model.compute_logits).topk(8, dim=-1)
        _sync(device)
    return (time.perf_counter() - t0) / iters * 1000


def _set_limit(llm, runner_spec, config) -> None:
    """Install ``config`` (a SpeculativeConfig) in the running engine: the worker's
    proposals and the engine's choice of overlapped steps both follow its
    disable_by_batch_size."""
    runner_spec.config = config
    gate = llm.engine.core._spec_overlap
    if gate is not None:
        gate.limit = config.disable_by_batch_size


def _profile(llm, refs, prompts, graphs, depth: int, device: str) -> dict:
    """Host time per op over 16 tokens of all-accepted chain k=4 steps and of 4-node
    tree steps, verification graphs on, then off: where a step's host time goes
    (``self_cpu_ms`` summed over the steps, top ops)."""
    from torch.profiler import ProfilerActivity, profile

    from kvflow import SamplingParams
    from kvflow.bench.spec_oracle import install_oracle
    from kvflow.spec_decode.tree import DraftTree, rank_accuracy_profile

    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    out = {}
    sizes = getattr(graphs, "verify_sizes", [])
    tree = DraftTree.best(4, rank_accuracy_profile(None, depth))
    if hasattr(graphs, "capture_trees"):
        graphs.capture_trees(tree.num_nodes)
    for name, k, t, graphs_on in (("chain4_graphs", 4, None, True),
                                  ("chain4_eager", 4, None, False),
                                  ("tree4_graphs", tree.max_depth, tree, True),
                                  ("tree4_eager", tree.max_depth, tree, False)):
        install_oracle(llm, refs, k, t, accept_all=True)
        if graphs is not None and not graphs_on:
            graphs.verify_sizes = []
        try:
            llm.generate(prompts, params, use_tqdm=False)  # warm
            _sync(device)
            t0 = time.perf_counter()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                             if device.startswith("cuda") else [])
            with profile(activities=acts) as prof:
                llm.generate(prompts, params, use_tqdm=False)
                _sync(device)
            wall = time.perf_counter() - t0
        finally:
            if graphs is not None:
                graphs.verify_sizes = sizes
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:30]
        out[name] = {
            "wall_s_profiled": round(wall, 4),
            "top_self_cpu": [{"op": e.key, "calls": e.count,
                              "self_cpu_ms": round(e.self_cpu_time_total / 1000, 3),
                              "cpu_total_ms": round(e.cpu_time_total / 1000, 3),
                              "device_ms": round(getattr(e, "self_device_time_total",
                                                         getattr(e, "self_cuda_time_total", 0))
                                                 / 1000, 3)}
                             for e in rows]}
        print(f"profile {name}: {wall * 1000:.1f} ms for 16 tokens")
        for e in out[name]["top_self_cpu"][:12]:
            print(f"  {e['op'][:60]:60s} {e['calls']:6d} {e['self_cpu_ms']:9.2f} ms")
    return out


def run_spec_verify(ns: argparse.Namespace) -> int:
    import torch

    from kvflow import LLM
    from kvflow.bench.datasets import random_requests
    from kvflow.bench.machine import save_result
    from kvflow.bench.offline import _config_summary, _special_ids
    from kvflow.bench.spec_oracle import install_oracle
    from kvflow.spec_decode.tree import DraftTree, rank_accuracy_profile

    args = EngineArgs.from_cli_args(ns)
    args.enable_prefix_caching = False  # the same prompts run again and again
    plain_cfg = args.create_engine_config()
    device = plain_cfg.device.device
    vocab = plain_cfg.model.arch.vocab_size
    special = _special_ids(plain_cfg)
    big = ns.overhead_batch_size
    reqs = random_requests(max(1, big), (ns.input_len, ns.input_len), (1, 1), vocab,
                           ns.seed, special)
    prompts = [r.prompt_token_ids for r in reqs]
    ks = [int(k) for k in ns.ks.split(",") if k]
    sizes = [int(s) for s in ns.tree_sizes.split(",") if s]
    eager_trees = {int(s) for s in ns.eager_tree_sizes.split(",") if s}
    result: dict = {"acceptance": "accept_all: every draft kept by a bench-only override "
                                  "(cost of all-accepted verification; output is not the "
                                  "target's)",
                    "workload": {"input_len": ns.input_len, "output_len": ns.output_len,
                                 "ks": ks, "tree_sizes": sizes, "tree_depth": ns.tree_depth,
                                 "overhead_batch_size": big},
                    "engine_config": _config_summary(plain_cfg),
                    "loadavg_start": list(os.getloadavg())}

    def make(a: EngineArgs) -> LLM:
        return LLM(**{f.name: getattr(a, f.name) for f in dataclasses.fields(a)})

    def free() -> None:
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    # 1. Plain decoding (the default engine: overlapped steps, CUDA graphs).
    llm = make(args)
    plain1 = _run(llm, prompts[:1], ns.output_len, device)
    result["plain_bs1"] = {k: v for k, v in plain1.items() if k != "outputs"}
    print(f"plain bs1: {plain1['decode_tokens_per_s']} tok/s, {plain1['ms_per_step']} ms/step")
    refs = plain1["outputs"]
    if big:
        plain_big = _run(llm, prompts, ns.output_len, device)
        result[f"plain_bs{big}"] = {k: v for k, v in plain_big.items() if k != "outputs"}
        refs = refs + plain_big["outputs"]
        print(f"plain bs{big}: {plain_big['decode_tokens_per_s']} tok/s")
    result["medusa_heads_ms"] = round(_heads_ms(llm, ns.tree_depth, device), 3)
    print(f"medusa heads ({ns.tree_depth}, shared lm_head): {result['medusa_heads_ms']} ms")
    llm.shutdown()
    del llm
    free()

    # 2. One speculative engine; the bench-only oracle proposer replaces its proposer.
    spec_args = dataclasses.replace(args, speculative_config={
        "method": "ngram", "num_speculative_tokens": max(ks + [1])})
    llm = make(spec_args)
    runner_spec = llm.engine.core.executor.runner.spec
    always = dataclasses.replace(runner_spec.config, disable_by_batch_size=None)
    _set_limit(llm, runner_spec, always)
    install_oracle(llm, refs, 0)
    off = _run(llm, prompts[:1], ns.output_len, device)
    base = plain1["decode_tokens_per_s"]
    off["ratio_vs_plain"] = round(off["decode_tokens_per_s"] / base, 3)
    result["spec_engine_no_drafts_bs1"] = {k: v for k, v in off.items() if k != "outputs"}
    print(f"spec engine, no drafts, bs1: {off['ms_per_step']} ms/step "
          f"({off['ratio_vs_plain']}x plain)")
    chain = {}
    for k in ks:
        install_oracle(llm, refs, k, accept_all=True)
        r = _run(llm, prompts[:1], ns.output_len, device)
        r.pop("outputs")
        r["speedup_vs_plain"] = round(r["decode_tokens_per_s"] / base, 3)
        r["verify_cost_vs_plain_step"] = round(r["ms_per_verify_step"]
                                               / max(plain1["ms_per_step"], 1e-6), 3)
        r["always_right_speedup"] = round((k + 1) / r["verify_cost_vs_plain_step"], 3)
        chain[str(k)] = r
        print(f"chain k={k}: {r['decode_tokens_per_s']} tok/s ({r['speedup_vs_plain']}x), "
              f"{r['tokens_per_step']} tok/step, {r['ms_per_verify_step']} ms/verify step "
              f"(engine's timer {r['engine_verify_ms']} ms, drafting {r['engine_draft_ms']} "
              f"ms), always right: {r['always_right_speedup']}x")
    result["oracle_chain_bs1"] = chain
    graphs = llm.engine.core.executor.runner.graphs
    eager_ks = [int(k) for k in ns.eager_ks.split(",") if k]
    if eager_ks and getattr(graphs, "verify_sizes", None):
        eager = {}
        graph_sizes = graphs.verify_sizes
        graphs.verify_sizes = []  # no verification graph fits: steps run eagerly
        try:
            for k in eager_ks:
                install_oracle(llm, refs, k, accept_all=True)
                r = _run(llm, prompts[:1], ns.output_len, device)
                r.pop("outputs")
                r["speedup_vs_plain"] = round(r["decode_tokens_per_s"] / base, 3)
                eager[str(k)] = r
                print(f"chain k={k}, eager: {r['ms_per_verify_step']} ms/verify step "
                      f"({r['speedup_vs_plain']}x plain)")
        finally:
            graphs.verify_sizes = graph_sizes
        result["oracle_chain_eager_bs1"] = eager
    save_result(ns.save_result, {**result, "partial": True})  # in case a later part fails
    if ns.profile:
        result["profile"] = _profile(llm, refs, prompts[:1], graphs, ns.tree_depth,
                                     device)
    trees = {}
    profile = rank_accuracy_profile(None, ns.tree_depth)
    for size in sizes:
        tree = DraftTree.best(size, profile)
        install_oracle(llm, refs, tree.max_depth, tree, accept_all=True)
        if hasattr(graphs, "capture_trees"):
            graphs.capture_trees(tree.num_nodes)  # the runner does this at startup for Medusa
        r = _run(llm, prompts[:1], ns.output_len, device)
        r.pop("outputs")
        r["depth"] = tree.max_depth
        r["speedup_vs_plain"] = round(r["decode_tokens_per_s"] / base, 3)
        r["verify_cost_vs_plain_step"] = round(r["ms_per_verify_step"]
                                               / max(plain1["ms_per_step"], 1e-6), 3)
        r["always_right_speedup"] = round((tree.max_depth + 1)
                                          / r["verify_cost_vs_plain_step"], 3)
        trees[str(size)] = r
        print(f"tree {size} nodes (depth {tree.max_depth}): {r['decode_tokens_per_s']} tok/s "
              f"({r['speedup_vs_plain']}x), {r['ms_per_verify_step']} ms/verify step, "
              f"always right: {r['always_right_speedup']}x")
        if size in eager_trees and getattr(graphs, "verify_sizes", None):
            saved, graphs.verify_sizes = graphs.verify_sizes, []  # eager steps
            try:
                e = _run(llm, prompts[:1], ns.output_len, device)
            finally:
                graphs.verify_sizes = saved
            e.pop("outputs")
            e["speedup_vs_plain"] = round(e["decode_tokens_per_s"] / base, 3)
            result.setdefault("oracle_tree_eager_bs1", {})[str(size)] = e
            print(f"tree {size} nodes, eager: {e['ms_per_verify_step']} ms/verify step")
    result["oracle_tree_bs1"] = trees
    save_result(ns.save_result, {**result, "partial": True})

    # 3. Large batch: speculation switched off by batch size, and forced on.
    if big:
        pb = result[f"plain_bs{big}"]["decode_tokens_per_s"]
        _set_limit(llm, runner_spec, dataclasses.replace(always, disable_by_batch_size=8))
        install_oracle(llm, refs, ns.overhead_k, accept_all=True)
        r = _run(llm, prompts, ns.output_len, device)
        r.pop("outputs")
        r["ratio_vs_plain"] = round(r["decode_tokens_per_s"] / pb, 3)
        result[f"spec_off_by_batch_bs{big}"] = r
        _set_limit(llm, runner_spec, always)
        r = _run(llm, prompts, ns.output_len, device)
        r.pop("outputs")
        r["ratio_vs_plain"] = round(r["decode_tokens_per_s"] / pb, 3)
        result[f"oracle_chain_k{ns.overhead_k}_bs{big}"] = r
        print(f"bs{big}: spec switched off {result[f'spec_off_by_batch_bs{big}']['ratio_vs_plain']}x,"
              f" forced always-right k={ns.overhead_k} {r['ratio_vs_plain']}x plain")
    llm.shutdown()
    del llm
    free()
    result["loadavg_end"] = list(os.getloadavg())
    save_result(ns.save_result, result)
    return 0


__all__ = ["add_spec_verify_args", "run_spec_verify"]
