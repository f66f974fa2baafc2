"""GPU-A (Llama-3.1-8B shape, dummy bf16 weights, batch 1, 128 in / 256 out) with each
batch-1 decode lever switched on and off, in one process: the engine loads once, and per
variant the switches are set, the dense layers re-plan their GEMV configs, the decode
CUDA graphs are captured again, and the GPU-A latency is measured as
``kvflow bench latency`` measures it (median of ``--iters`` full runs minus a 1-token
run, over the 255 decode steps). The first variant runs again at the end, so drift
between variants shows.

    python benchmarks/gpu/decode_levers.py --out $OUT/decode-levers.json \\
        [--variants base,rope,auto+table,...] [--table $OUT/gemv-bench.json]

Variants (environment switches, kvflow/envs.py): ``base`` (every switch off), ``auto``
(none set: this GPU's measured defaults, kvflow/kernels/decode_defaults.py),
``rope`` (KVFLOW_ROPE_IN_ATTN=on: rotary + cache write inside the decode
attention launch), ``argmax`` (KVFLOW_GREEDY_ARGMAX=auto: the split-row argmax kernel;
``base`` keeps torch's), ``down`` (down_proj at M = 1 on the 64 x 256 split-2 GEMV: the
lever that ran before the H200 table took the 32 x 256 GEMV there), ``table`` (KVFLOW_TUNING_FILE=--table; several files comma-separated: their measured wins
merged), joined with ``+`` (``rope+argmax+table``). A variant starting ``auto+`` adds its
levers to the defaults instead of to every switch off (``auto+table``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from kvflow.bench.machine import save_result  # noqa: E402
from kvflow.engine.args import EngineArgs  # noqa: E402
from kvflow.engine.llm_engine import LLMEngine  # noqa: E402
from kvflow.sampling_params import SamplingParams  # noqa: E402

# down_proj (K 14336 -> N 4096) at M = 1 on a split-2 GEMV: the lever used while the table
# kept cuBLAS there (within 2 %, results/gemv-bench-m1-h200.json). The H200 table now takes the 32 x 256 GEMV at
# M = 1 itself (results/gemv-rows-down-h200.json), so this only swaps the tile.
DOWN_M1 = {"block_n": 64, "block_k": 256, "split_k": 2, "dot": True, "num_warps": 4,
           "num_stages": 4}
SWITCHES = ("KVFLOW_TUNING_FILE", "KVFLOW_ROPE_IN_ATTN", "KVFLOW_GREEDY_ARGMAX")


# every switch off: main's behaviour before them, whatever the GPU's measured defaults
OFF = {"KVFLOW_ROPE_IN_ATTN": "off", "KVFLOW_GREEDY_ARGMAX": "torch"}


def _env(variant: str, table: str | None, down_table: str) -> dict:
    if variant == "auto":  # nothing set: the defaults (the GPU's file in kvflow/kernels/tuning/)
        return {}
    # "auto+...": the defaults plus the levers named; otherwise every switch off plus them
    env: dict[str, str] = {} if variant.startswith("auto+") else dict(OFF)
    tables = []
    for part in variant.split("+"):
        if part in ("base", "auto"):
            continue
        elif part == "rope":
            env["KVFLOW_ROPE_IN_ATTN"] = "on"
        elif part == "argmax":
            env["KVFLOW_GREEDY_ARGMAX"] = "auto"
        elif part == "down":
            tables.append(down_table)
        elif part == "table":
            paths = [t for t in (table or "").split(",") if t]
            if not paths or not all(os.path.exists(t) for t in paths):
                raise SystemExit(f"variant {variant}: no --table file")
            tables += paths
        else:
            raise SystemExit(f"unknown lever {part!r}")
    if tables:
        env["KVFLOW_TUNING_FILE"] = _merge_tables(tables)
    return env


def _merge_tables(paths: list[str]) -> str:
    rows = []
    for p in paths:  # only the measured wins: a null entry would send a layer to cuBLAS
        with open(p) as f:
            rows += [r for r in json.load(f)["table"] if r.get("config") is not None]
    fd, path = tempfile.mkstemp(suffix=".json", prefix="gemv-table-")
    with os.fdopen(fd, "w") as f:
        json.dump({"table": rows}, f)
    return path


def _apply(engine, env: dict) -> None:
    """Set the switches, drop every cached decision, re-plan the GEMVs, recapture."""
    from kvflow.kernels import argmax, gemv_config, tuning
    from kvflow.kernels.gemv_dispatch import plan_gemv
    from kvflow.layers.attention import triton_backend

    for k in SWITCHES:
        os.environ.pop(k, None)
    os.environ.update(env)
    for fn in (gemv_config._device_table, tuning.for_device, triton_backend.rope_in_attention,
               argmax._use_kernel):
        fn.cache_clear()
    runner = engine.core.executor.runner
    for m in runner.model.modules():
        if hasattr(m, "gemv") and hasattr(m, "quant_method") and hasattr(m, "weight"):
            m.gemv = plan_gemv(m)
    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    runner.warmup()


def _run(engine, prompt: list[int], out_len: int, tag: str) -> tuple[float, float]:
    """(full run seconds, seconds from the first output token to the last)."""
    params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0,
                            detokenize=False)
    engine.add_request(tag, {"prompt_token_ids": prompt}, params)
    torch.cuda.synchronize()
    start = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.outputs and o.outputs[0].token_ids for o in outs):
            first = time.perf_counter()
    end = time.perf_counter()
    return end - start, end - (first if first is not None else start)


def measure(engine, prompt: list[int], out_len: int, iters: int, tag: str) -> dict:
    """``kvflow bench latency``'s figure (median full run minus a median 1-token run, over
    the decode steps) and, steadier since the host-bound prefill moves by tens of ms
    between runs, the decode steps timed alone (first output token to last)."""
    _run(engine, prompt, 1, f"{tag}w1")
    _run(engine, prompt, out_len, f"{tag}w")
    prefill = [_run(engine, prompt, 1, f"{tag}p{i}")[0] for i in range(2)]
    runs = [_run(engine, prompt, out_len, f"{tag}f{i}") for i in range(iters)]
    full = [r[0] for r in runs]
    lat = float(np.median(full))
    ms = (lat - float(np.median(prefill))) / (out_len - 1) * 1000
    decode_ms = float(np.median([r[1] for r in runs])) / (out_len - 1) * 1000
    return {"latency_s_median": lat, "latency_s_all": full,
            "prefill_s_median": float(np.median(prefill)), "ms_per_output_token": ms,
            "decode_tokens_per_s_per_seq": 1000 / ms,
            "decode_only_ms_per_token": decode_ms,
            "decode_only_ms_all": [r[1] / (out_len - 1) * 1000 for r in runs],
            "decode_only_tokens_per_s": 1000 / decode_ms}


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="base,auto,rope+argmax,base,auto,rope+argmax")
    ap.add_argument("--table", default=None,
                    help="bench_gemv.py result(s) for 'table', comma-separated")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--quantization", default=None, help="e.g. fp8, int4 (default: bf16)")
    ap.add_argument("--group-size", type=int, default=None, help="int4 group size")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="stop starting variants after this many seconds")
    ns = ap.parse_args()
    start = time.time()
    fd, down_table = tempfile.mkstemp(suffix=".json", prefix="gemv-down-")
    with os.fdopen(fd, "w") as f:
        json.dump({"table": [{"kind": "linear", "n": 4096, "k": 14336, "m": 1,
                              "config": DOWN_M1}]}, f)
    variants, envs = [], {}
    for v in ns.variants.split(","):  # bad names fail before the engine loads
        try:
            envs[v] = _env(v, ns.table, down_table)
            variants.append(v)
        except SystemExit as exc:
            if "no --table" not in str(exc):
                raise
            print(f"{exc}: skipped", flush=True)
    args = EngineArgs(model="llama-3.1-8b", load_format="dummy", max_model_len=4096,
                      max_num_seqs=1, enable_prefix_caching=False,
                      quantization=ns.quantization or "auto",
                      **({"quantization_group_size": ns.group_size} if ns.group_size else {}))
    engine = LLMEngine.from_engine_args(args)
    prompt = [(7 * j) % 30000 + 100 for j in range(ns.input_len)]
    results = []
    order = variants + [variants[0]]  # the first again: drift
    for i, v in enumerate(order):
        if time.time() - start > ns.budget_s:
            print(f"budget spent: {v} and later variants not run", flush=True)
            break
        t0 = time.time()
        try:
            _apply(engine, envs[v])
            fig = measure(engine, prompt, ns.output_len, ns.iters, f"v{i}")
        except Exception as exc:  # one failing lever must not hide the others
            print(f"{v}: failed: {exc!r}"[:400], flush=True)
            results.append({"variant": v, "env": envs[v], "error": repr(exc)[:400]})
            continue
        fig.update({"variant": v, "env": envs[v], "seconds": time.time() - t0})
        results.append(fig)
        print(f"{v:28s} {fig['decode_tokens_per_s_per_seq']:7.1f} tok/s "
              f"({fig['ms_per_output_token']:.3f} ms/token); decode steps alone "
              f"{fig['decode_only_tokens_per_s']:7.1f} tok/s "
              f"({fig['decode_only_ms_per_token']:.3f} ms/token)", flush=True)
        _save(ns, results, variants[0], start)  # after every variant: a timeout keeps them
    _save(ns, results, variants[0], start)
    return 0


def _save(ns, results: list[dict], first: str, start: float) -> None:
    base = next((r for r in results if r.get("variant") == first and "error" not in r), None)
    if base is not None:
        for r in results:
            if "error" not in r:
                r["over_first"] = (r["decode_tokens_per_s_per_seq"]
                                   / base["decode_tokens_per_s_per_seq"])
                r["decode_only_over_first"] = (r["decode_only_tokens_per_s"]
                                               / base["decode_only_tokens_per_s"])
    save_result(ns.out, {
                         "quantization": ns.quantization,
                         "workload": {"batch_size": 1, "input_len": ns.input_len,
                                      "output_len": ns.output_len, "iters": ns.iters},
                         "device": torch.cuda.get_device_name(), "variants": results,
                         "seconds": time.time() - start, "loadavg": list(os.getloadavg())})


if __name__ == "__main__":
    sys.exit(main())
