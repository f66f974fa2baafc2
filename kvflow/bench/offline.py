"""``kvflow bench throughput`` and ``kvflow bench latency`` (offline, one process)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time

import numpy as np
import torch

from kvflow.bench.datasets import (BenchRequest, length_range, random_requests,
                                   shared_prefix_requests, text_requests)
from kvflow.bench.machine import save_result
from kvflow.engine.args import EngineArgs
from kvflow.errors import InvalidParameterError


def _workload(ns: argparse.Namespace, vocab_size: int, special: set[int], config=None
              ) -> list[BenchRequest]:
    if ns.dataset in ("chat", "edit"):
        from kvflow.engine.llm_engine import load_tokenizer

        tok = load_tokenizer(config)
        if tok is None or tok.chat_template is None:
            raise InvalidParameterError(f"--dataset {ns.dataset} needs a model with a chat "
                                        "template", param="dataset")
        return text_requests(ns.dataset, ns.num_prompts, ns.output_len, tok)
    if ns.dataset == "shared-prefix":
        return shared_prefix_requests(ns.num_prompts, ns.prefix_len, ns.input_len,
                                      ns.output_len, vocab_size, ns.seed, special)
    in_rng = length_range(ns.input_len, ns.range_ratio, ns.min_input_len, ns.max_input_len)
    out_rng = length_range(ns.output_len, ns.range_ratio, ns.min_output_len,
                           ns.max_output_len)
    return random_requests(ns.num_prompts, in_rng, out_rng, vocab_size, ns.seed, special)


def _special_ids(config) -> set[int]:
    arch = config.model.arch
    return set(arch.eos_token_ids) | ({arch.bos_token_id} if arch.bos_token_id is not None
                                      else set())


def _sampling(ns, output_len: int):
    from kvflow.sampling_params import SamplingParams

    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=ns.temperature,
                          detokenize=False, n=getattr(ns, "n", 1))


def _save(ns: argparse.Namespace, result: dict) -> None:
    save_result(ns.save_result, result)


_PEERS = ("hf", "llamacpp")


def _backends(ns) -> list[str]:
    """Labels to run: peers first (kvflow sizes its KV cache from the memory left free),
    then kvflow, or ``kvflow-<quantization>`` per ``--quantizations`` entry;
    eager-vs-compiled: kvflow with --enforce-eager, then kvflow; threads-all-vs-adaptive:
    kvflow with --cpu-step-threads all, then kvflow (as configured)."""
    if ns.backend == "eager-vs-compiled":
        return ["kvflow-eager", "kvflow"]
    if ns.backend == "threads-all-vs-adaptive":
        return ["kvflow-allthreads", "kvflow"]
    if ns.backend == "f32act-vs-int8act":
        return ["kvflow-f32act", "kvflow"]
    names = ["hf", "kvflow"] if ns.backend == "both" else [
        b.strip() for b in ns.backend.split(",") if b.strip()]
    bad = [b for b in names if b not in ("kvflow", "kvflow-f32act", *_PEERS)]
    if bad or not names:
        raise InvalidParameterError(f"--backend: unknown backend {bad or ns.backend!r} "
                                    "(kvflow, hf, llamacpp, both, eager-vs-compiled, "
                                    "threads-all-vs-adaptive, f32act-vs-int8act, or a comma "
                                    "list of kvflow, kvflow-f32act, hf, llamacpp)",
                                    param="backend")
    out = [b for b in (*_PEERS, "kvflow-f32act") if b in names]
    if "kvflow" in names:
        quants = getattr(ns, "quantizations", None)
        kv_dtypes = getattr(ns, "kv_cache_dtypes", None)
        if quants and kv_dtypes:
            raise InvalidParameterError("--quantizations and --kv-cache-dtypes each compare "
                                        "one axis: give one of them", param="kv_cache_dtypes")
        if kv_dtypes:
            out += [f"kvflow-kv-{d.strip()}" for d in kv_dtypes.split(",") if d.strip()]
        else:
            out += ([f"kvflow-{q.strip()}" for q in quants.split(",") if q.strip()] if quants
                    else ["kvflow"])
    return out


def _eager_config(config):
    """The same engine with CUDA graphs / the compiled CPU step turned off."""
    return dataclasses.replace(config, device=dataclasses.replace(config.device,
                                                                  enforce_eager=True))


def _kvflow_config(args: EngineArgs, label: str, config=None):
    """The engine config of a ``kvflow`` or ``kvflow-<quantization>`` label."""
    if label == "kvflow":
        return config if config is not None else args.create_engine_config()
    if label == "kvflow-eager":
        return _eager_config(config if config is not None else args.create_engine_config())
    if label.startswith("kvflow-kv-"):  # --kv-cache-dtypes: the same engine, another cache
        return dataclasses.replace(args, kv_cache_dtype=label.removeprefix(
            "kvflow-kv-")).create_engine_config()
    if label == "kvflow-f32act":  # the same engine; _new_engine sets the GEMV
        return config if config is not None else args.create_engine_config()
    if label == "kvflow-allthreads":
        base = config if config is not None else args.create_engine_config()
        return dataclasses.replace(base, device=dataclasses.replace(
            base.device, cpu_step_threads="all"))
    from kvflow.bench.quality import method_args

    return method_args(args, label.removeprefix("kvflow-")).create_engine_config()


def _weights(engine) -> dict:
    runner = engine.core.executor.runner
    quant = getattr(runner.model, "quant_config", None)
    return {"weight_gib": runner.weight_bytes / (1 << 30),
            "quantization": quant.describe() if quant is not None else "none"}


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _device(config) -> str:
    return config.device.device


def run_throughput(ns: argparse.Namespace) -> int:
    args = EngineArgs.from_cli_args(ns)
    config = args.create_engine_config()
    requests = _workload(ns, config.model.arch.vocab_size, _special_ids(config), config)
    n_in = sum(len(r.prompt_token_ids) for r in requests)
    n_out = sum(r.output_len for r in requests) * ns.n
    if ns.n > 1 and ns.backend != "kvflow":
        raise InvalidParameterError("--n > 1 (parallel sampling) is measured on the kvflow "
                                    "backend only")
    workload = {"n": ns.n, "dataset": ns.dataset, "num_prompts": len(requests), "input_tokens": n_in,
                "output_tokens": n_out,
                "input_len_range": [min(len(r.prompt_token_ids) for r in requests),
                                    max(len(r.prompt_token_ids) for r in requests)],
                "output_len_range": [min(r.output_len for r in requests),
                                     max(r.output_len for r in requests)],
                "seed": ns.seed, "temperature": ns.temperature}
    results: dict = {"workload": workload, "engine_config": _config_summary(config),
                     "loadavg_start": list(os.getloadavg())}
    backends = _backends(ns)
    if getattr(ns, "spec_baseline", False):
        if config.speculative is None:
            raise InvalidParameterError("--spec-baseline compares against speculative "
                                        "decoding: give --speculative-config too",
                                        param="spec_baseline")
        backends = ["kvflow-no-spec"] + backends
    for backend in backends:
        if backend == "kvflow-no-spec":
            elapsed, extra = _kvflow_throughput(
                args, dataclasses.replace(config, speculative=None, draft_model=None), requests,
                ns)
        elif backend.startswith("kvflow"):
            elapsed, extra = _kvflow_throughput(args, _kvflow_config(args, backend, config),
                                                requests, ns, backend)
        elif backend == "llamacpp":
            from kvflow.bench.llamacpp_backend import LlamaCppUnavailable, llamacpp_throughput

            try:
                elapsed, extra = llamacpp_throughput(config, requests, ns)
            except LlamaCppUnavailable as e:
                print(f"[llamacpp] skipped: {e}")
                results[backend] = {"skipped": str(e)}
                continue
        else:
            elapsed, extra = _hf_throughput(config, requests, ns)
        _release_memory()
        fig = {"elapsed_s": elapsed, "requests_per_s": len(requests) / elapsed,
               "total_tokens_per_s": (n_in + n_out) / elapsed,
               "output_tokens_per_s": n_out / elapsed, **extra}
        results[backend] = fig
        print(f"[{backend}] Throughput: {fig['requests_per_s']:.2f} requests/s, "
              f"{fig['total_tokens_per_s']:.2f} total tokens/s, "
              f"{fig['output_tokens_per_s']:.2f} output tokens/s")
        if backend.startswith("kvflow"):
            print(f"[{backend}] prefix cache hit rate {100 * fig['prefix_cache_hit_rate']:.1f}%, "
                  f"KV slots allocated but empty {100 * fig['kv_slot_waste']:.2f}%, "
                  f"preemptions {fig['preemptions']} ({fig['swap_outs']} swapped), "
                  f"copy-on-write block copies {fig['copy_on_write_blocks']}")
            if "spec_decode" in fig:
                sd = fig["spec_decode"]
                print(f"[kvflow] spec decode: acceptance {100 * sd['acceptance_rate']:.1f}%, "
                      f"mean accepted length {sd['mean_accepted_length']:.2f}, "
                      f"{sd['num_draft_tokens']} drafts, per position "
                      f"{[round(x, 2) for x in sd['position_acceptance']]}, "
                      f"draft {sd['mean_draft_ms']:.2f} ms per proposer run "
                      f"({sd['num_proposals']} runs), verify {sd['mean_verify_ms']:.2f} ms "
                      f"per step ({sd['num_verify_steps']} steps)")
    if "kvflow" in results and "kvflow-no-spec" in results:
        ratio = (results["kvflow"]["output_tokens_per_s"]
                 / results["kvflow-no-spec"]["output_tokens_per_s"])
        results["spec_over_no_spec"] = ratio
        print(f"kvflow with / without speculative decoding, output tokens/s: {ratio:.2f}x")
    if "kvflow" in results and "hf" in results:
        ratio = results["kvflow"]["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"]
        results["kvflow_over_hf"] = ratio
        print(f"kvflow / hf output tokens/s: {ratio:.2f}x")
    if "kvflow" in results and "kvflow-eager" in results:
        ratio = (results["kvflow"]["output_tokens_per_s"]
                 / results["kvflow-eager"]["output_tokens_per_s"])
        results["compiled_over_eager"] = ratio
        print(f"compiled / eager output tokens/s: {ratio:.2f}x")
    _ratios(results, "output_tokens_per_s")
    results["loadavg_end"] = list(os.getloadavg())
    _save(ns, results)
    return 0


def _ratios(results: dict, key: str) -> None:
    """Every kvflow-<quantization> run over each peer and over kvflow-none."""
    runs = {k: v for k, v in results.items() if isinstance(v, dict) and key in v}
    out = {}
    for k, v in runs.items():
        if not k.startswith("kvflow-"):
            continue
        for other in ("hf", "llamacpp", "kvflow-none", "kvflow-kv-auto"):
            if other in runs and other != k:
                out[f"{k}/{other}"] = v[key] / runs[other][key]
    if "kvflow" in runs and "kvflow-allthreads" in runs:
        out["kvflow/kvflow-allthreads"] = runs["kvflow"][key] / runs["kvflow-allthreads"][key]
    for peer in _PEERS:  # the plain kvflow run over each peer in the same invocation
        if "kvflow" in runs and peer in runs:
            out[f"kvflow/{peer}"] = runs["kvflow"][key] / runs[peer][key]
    if "kvflow" in runs and "kvflow-f32act" in runs:
        out["kvflow/kvflow-f32act"] = runs["kvflow"][key] / runs["kvflow-f32act"][key]
    if out:
        results["ratios"] = out
        for k, r in out.items():
            print(f"{k} ({key}): {r:.2f}x")


def _config_summary(config) -> dict:
    return {"model": config.model.model, "load_format": config.model.load_format,
            "dtype": config.model.dtype, "device": config.device.device,
            "max_model_len": config.model.max_model_len,
            "block_size": config.cache.block_size,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "enforce_eager": config.device.enforce_eager,
            "kv_cache_dtype": config.cache.cache_dtype,
            "speculative_config": dataclasses.asdict(config.speculative)
            if config.speculative is not None else None}


def _new_engine(config, label: str):
    """The engine of a kvflow label; ``kvflow-f32act``: the C++ step's GGUF GEMV on
    float32 activations (KVFLOW_CPU_INT8_ACT=0) instead of int8 ones."""
    import contextlib

    from kvflow import envs
    from kvflow.engine.llm_engine import LLMEngine

    with envs.float32_activations() if label == "kvflow-f32act" else contextlib.nullcontext():
        return LLMEngine(config)


def _kvflow_throughput(args, config, requests, ns, label: str = "kvflow"
                       ) -> tuple[float, dict]:
    engine = _new_engine(config, label)
    # Warm-up prompts of their own: reusing benchmark prompts would warm the prefix cache.
    warmup = random_requests(min(4, len(requests)), (16, 64), (4, 4),
                             config.model.arch.vocab_size, ns.seed + 12345,
                             _special_ids(config))
    _run_kvflow(engine, warmup, ns, tag="warmup")
    meter = _attach_idle_meter(engine, ns)
    stats = _run_kvflow(engine, requests, ns, tag="bench")
    stats.update(_weights(engine))
    stats.update(kv_cache_dtype=config.cache.cache_dtype,
                 kv_cache_blocks=engine.core.scheduler.kv.num_blocks)
    if meter is not None:
        stats["gpu_idle"] = meter.report()
        print(f"[kvflow] GPU idle between steps: "
              f"{stats['gpu_idle']['idle_ms_per_step'] * 1000:.0f} us/step "
              f"({100 * stats['gpu_idle']['idle_fraction']:.1f}% of the time)")
    return stats.pop("elapsed_s"), stats


def _run_kvflow(engine, requests: list[BenchRequest], ns, tag: str) -> dict:
    for i, r in enumerate(requests):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": r.prompt_token_ids},
                           _sampling(ns, r.output_len))
    device = engine.config.device.device
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    sched = engine.core.scheduler
    start = time.perf_counter()
    steps = 0
    preempt0, swaps0, copies0 = sched.num_preemptions, sched.num_swaps, sched.kv.num_copied_blocks
    query0, hit0 = sched.kv.num_query_tokens, sched.kv.num_hit_tokens
    spec0 = sched.spec_stats.copy()
    slots = filled = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        s, f = sched.kv_slot_usage()
        slots, filled = slots + s, filled + f
    elapsed = time.perf_counter() - start
    queries = sched.kv.num_query_tokens - query0
    extra = {}
    if engine.config.speculative is not None:
        extra["spec_decode"] = _spec_delta(spec0, sched.spec_stats)
    return {**extra, "elapsed_s": elapsed, "steps": steps,
            "preemptions": sched.num_preemptions - preempt0,
            "swap_outs": sched.num_swaps - swaps0,
            "copy_on_write_blocks": sched.kv.num_copied_blocks - copies0,
            "prefix_cache_hit_rate": (sched.kv.num_hit_tokens - hit0) / queries
            if queries else 0.0,
            # Slots of allocated KV blocks that held no token, averaged over the steps.
            "kv_slot_waste": 1 - filled / slots if slots else 0.0}


def _spec_delta(before, after) -> dict:
    """Speculative decoding over one benchmark run."""
    d = after.since(before)
    return {"num_drafts": d.num_drafts, "num_draft_tokens": d.num_draft_tokens,
            "num_accepted_tokens": d.num_accepted_tokens,
            "acceptance_rate": d.acceptance_rate,
            "mean_accepted_length": d.mean_accepted_length,
            "position_acceptance": d.position_acceptance(),
            "num_proposals": d.num_proposals, "draft_time_s": d.draft_time_s,
            "mean_draft_ms": d.mean_draft_ms, "num_verify_steps": d.num_verify_steps,
            "verify_time_s": d.verify_time_s, "mean_verify_ms": d.mean_verify_ms}


def _attach_idle_meter(engine, ns):
    """With --measure-gpu-idle, time the gaps the CPU leaves between GPU steps."""
    if engine is None or not getattr(ns, "measure_gpu_idle", False) \
            or not torch.cuda.is_available():
        return None
    from kvflow.worker.idle_meter import GpuIdleMeter

    meter = GpuIdleMeter()
    engine.core.executor.runner.idle_meter = meter
    return meter


def _hf_throughput(config, requests, ns) -> tuple[float, dict]:
    from kvflow.bench.hf_backend import load_hf_model, run_hf_throughput
    from kvflow.config import torch_dtype

    device = _device(config)
    hf = load_hf_model(config.model.model, config.model.load_format,
                       torch_dtype(config.model.dtype), device, config.model.seed)
    run_hf_throughput(hf, requests[:1], 1, device, ns.temperature)  # warm-up
    batch = ns.hf_batch_size or len(requests)
    elapsed = run_hf_throughput(hf, requests, batch, device, ns.temperature)
    return elapsed, {"hf_batch_size": batch}


def run_latency(ns: argparse.Namespace) -> int:
    """A batch of ``--batch-size`` prompts, ``--input-len`` in, ``--output-len`` out,
    repeated ``--num-iters`` times; reports end-to-end latency and ms per output token
    (decode time, i.e. latency minus the latency of a 1-token run, over output_len - 1)."""
    args = EngineArgs.from_cli_args(ns)
    # The same prompt runs again and again: a prefix cache would turn every prefill after
    # the first into a cache hit, so latency is measured without one.
    args.enable_prefix_caching = False
    config = args.create_engine_config()
    special = _special_ids(config)
    if ns.chat_prompt:
        from kvflow.engine.llm_engine import load_tokenizer

        tok = load_tokenizer(config)
        if tok is None or tok.chat_template is None:
            raise InvalidParameterError("--chat-prompt needs a model with a chat template")
        text = tok.apply_chat_template([{"role": "user", "content": ns.chat_prompt}])
        prompts = [tok.encode(text, add_special_tokens=False)] * ns.batch_size
    else:
        reqs = random_requests(ns.batch_size, (ns.input_len, ns.input_len), (1, 1),
                               config.model.arch.vocab_size, ns.seed, special)
        prompts = [r.prompt_token_ids for r in reqs]
    results: dict = {"workload": {"batch_size": ns.batch_size,
                                  "input_len": len(prompts[0]), "output_len": ns.output_len,
                                  "num_iters": ns.num_iters, "chat_prompt": ns.chat_prompt},
                     "engine_config": _config_summary(config),
                     "loadavg_start": list(os.getloadavg())}
    for backend in _backends(ns):
        try:
            run = _latency_runner(backend, args, config, ns)
        except Exception as e:
            from kvflow.bench.llamacpp_backend import LlamaCppUnavailable

            if not isinstance(e, LlamaCppUnavailable):
                raise
            print(f"[{backend}] skipped: {e}")
            results[backend] = {"skipped": str(e)}
            continue
        run(prompts, 1)
        run(prompts, ns.output_len)  # warm-up
        prefill = [run(prompts, 1) for _ in range(max(1, ns.num_iters // 2))]
        meter = _attach_idle_meter(run.engine, ns)
        full = [run(prompts, ns.output_len) for _ in range(ns.num_iters)]
        lat = float(np.median(full))
        decode_ms = (lat - float(np.median(prefill))) / max(1, ns.output_len - 1) * 1000
        fig = {"latency_s_median": lat, "latency_s_mean": float(np.mean(full)),
               "latency_s_p99": float(np.percentile(full, 99)),
               "prefill_s_median": float(np.median(prefill)),
               "ms_per_output_token": decode_ms,
               "decode_tokens_per_s_per_seq": 1000 / decode_ms,
               "output_tokens_per_s": ns.batch_size * ns.output_len / lat}
        if run.engine is not None:
            fig.update(_weights(run.engine))
        if meter is not None:
            fig["gpu_idle"] = meter.report()
            run.engine.core.executor.runner.idle_meter = None
            print(f"[{backend}] GPU idle between steps: "
                  f"{fig['gpu_idle']['idle_ms_per_step'] * 1000:.0f} us/step "
                  f"({100 * fig['gpu_idle']['idle_fraction']:.1f}% of the time)")
        if backend.startswith("kvflow") and ns.profile_host:
            fig["host_profile"] = _host_profile(run, prompts, ns, backend)
        results[backend] = fig
        del run
        _release_memory()
        print(f"[{backend}] latency {lat:.3f} s (median of {ns.num_iters}), prefill "
              f"{fig['prefill_s_median'] * 1000:.1f} ms, {decode_ms:.2f} ms/token, "
              f"{fig['decode_tokens_per_s_per_seq']:.1f} tokens/s per sequence")
    if "kvflow" in results and "kvflow-eager" in results:
        results["compiled_over_eager_decode"] = (
            results["kvflow"]["decode_tokens_per_s_per_seq"]
            / results["kvflow-eager"]["decode_tokens_per_s_per_seq"])
        print(f"compiled / eager decode tokens/s: {results['compiled_over_eager_decode']:.2f}x")
    if "kvflow" in results and "hf" in results:
        results["kvflow_over_hf_decode"] = (results["kvflow"]["decode_tokens_per_s_per_seq"]
                                            / results["hf"]["decode_tokens_per_s_per_seq"])
    _ratios(results, "decode_tokens_per_s_per_seq")
    results["loadavg_end"] = list(os.getloadavg())
    _save(ns, results)
    return 0


def _host_profile(run, prompts, ns, tag: str) -> dict:
    """Where the host time of one more timed run goes, phase by phase and op by op."""
    from kvflow.bench.overhead import PhaseMeter, print_report, profile_ops

    engine = run.engine
    meter = PhaseMeter().attach(engine)
    try:
        run(prompts, ns.output_len)
    finally:
        meter.detach()
    report = meter.report(run.last_steps, engine.config.model.arch.num_hidden_layers)
    short = max(2, min(ns.output_len, 32))  # the profiler slows every op; keep it short

    def profiled() -> int:
        run(prompts, short)
        return run.last_steps
    report["ops"] = profile_ops(profiled)
    policy = engine.core.executor.runner.thread_policy
    if policy is not None:  # what the CPU thread policy measured (ms per step)
        report["step_threads"] = policy.describe()
        print(f"[{tag}] step threads (ms per step by thread count): {report['step_threads']}")
    print_report(tag, report)
    return report


def _latency_runner(backend: str, args: EngineArgs, config, ns):
    device = _device(config)
    if backend == "llamacpp":
        from kvflow.bench.llamacpp_backend import llamacpp_latency_runner

        return llamacpp_latency_runner(config, ns)
    if backend.startswith("kvflow"):
        engine = _new_engine(_kvflow_config(args, backend, config), backend)
        counter = iter(range(1 << 30))

        def run(prompts, out_len):
            reqs = [BenchRequest(p, out_len) for p in prompts]
            stats = _run_kvflow(engine, reqs, ns, tag=f"lat{next(counter)}")
            run.last_steps = stats["steps"]
            return stats["elapsed_s"]
        run.engine = engine
        run.last_steps = 0
        return run
    from kvflow.bench.hf_backend import hf_generate_batch, load_hf_model
    from kvflow.config import torch_dtype

    hf = load_hf_model(config.model.model, config.model.load_format,
                       torch_dtype(config.model.dtype), device, config.model.seed)

    def run(prompts, out_len):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        hf_generate_batch(hf, prompts, out_len, device, ns.temperature,
                          ns.hf_cache_implementation)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start
    run.engine = None
    return run
