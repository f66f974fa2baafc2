"""What an m-row step of one request costs in the C++ CPU step (speculative verification
of m - 1 drafts at batch 1), next to a 1-row decode step, and where it goes.

For m in --rows it times, best of --reps (the machine is shared):
  step_ms     the C++ step's forward (30 decoder layers) for one request, m new tokens
              after --ctx of context (what a chain verify step runs);
  logits_ms   the lm_head on those m rows (the model's compute_logits);
  gemv_ms     every handed-over linear of the step (120 of SmolLM2's, then the lm_head)
              on m random rows in the step's order, one quant_gemv call each (the weights
              stream as in a step);
  gemv_chunks4_ms  the same with a separate call per 4 rows: how quant_gemv ran float32
              activations before one pass took all rows (each chunk re-read the layer).
Usage: PYTHONPATH=. python benchmarks/cpu_verify_rows.py --rows 1,2,3,5,9 --output X.json
(KVFLOW_CPU_INT8_ACT=0 forces the float32-activation GEMV on a VNNI machine.)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1000


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--rows", default="1,2,3,5,9")
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--output", default=None)
    ns = p.parse_args()

    from kvflow import LLM
    from kvflow.cpu import step as cpu_step
    from kvflow.bench.machine import save_result
    from kvflow.engine.args import EngineArgs

    args = EngineArgs(max_model_len=1024)
    llm = LLM(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
    runner = llm.engine.core.executor.runner
    step = runner.graphs
    if type(step).__name__ != "CppDecodeStep":
        print("the engine does not run the C++ step:", type(step).__name__)
        return 1
    mod, bs = step.module, runner.block_size
    head = runner.model.lm_head.quant_method
    gemvs = [lin.quant_method for lin in step._int4_linears] + (
        [head] if getattr(head, "gemv", None) is not None else [])
    result = {"gemv_kind_layers": step.gemv_methods[0].gemv_kind if step.gemv_methods else None,
              "gemv_kind_head": getattr(head, "gemv_kind", None),
              "int8_activations": step.num_int8_act, "threads": torch.get_num_threads(),
              "ctx": ns.ctx, "loadavg_start": list(os.getloadavg()), "rows": {}}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for m in [int(r) for r in ns.rows.split(",") if r]:
            n_ctx = ns.ctx + m
            table = (torch.arange(0, n_ctx // bs + 2, dtype=torch.int32) + 4)[None]
            pos = torch.arange(ns.ctx, n_ctx)
            slots = torch.tensor([int(table[0, q // bs]) * bs + q % bs for q in pos.tolist()])
            qsl = torch.tensor([0, m], dtype=torch.int32)
            lens = torch.tensor([n_ctx], dtype=torch.int32)
            emb = step.embed(torch.randint(0, 40000, (m,), generator=gen))

            def fwd():
                none = cpu_step._NO_TREE  # no tree masks, no prompt rows, no LoRA rows
                no_lora = cpu_step._NO_LORA
                return step.step.forward(emb, pos, slots, qsl, lens, table, none, none, none,
                                         no_lora, no_lora)
            h = fwd()
            inputs = []
            for q in gemvs:
                k = (q.gemv[0].shape[1] * 8 // (2 if q.doubled else 1)) if q.gemv_kind == 0 \
                    else q.gemv[0].shape[1] // (40 if q.gemv_kind == 4 else 72) * 64
                inputs.append(torch.randn(m, k, generator=gen))

            def gemv(chunk):
                for q, x in zip(gemvs, inputs):
                    for i in range(0, m, chunk):
                        mod.quant_gemv(x[i:i + chunk], *q.gemv, q.group, q.doubled,
                                       q.gemv_kind)
            r = {"step_ms": best_ms(fwd, ns.reps),
                 "logits_ms": best_ms(lambda: runner.model.compute_logits(h), ns.reps),
                 "gemv_ms": best_ms(lambda: gemv(16), ns.reps),
                 "gemv_chunks4_ms": best_ms(lambda: gemv(4), ns.reps)}
            r = {k: round(v, 3) for k, v in r.items()}
            result["rows"][str(m)] = r
            print(f"m={m}: " + ", ".join(f"{k} {v}" for k, v in r.items()), flush=True)
    one = result["rows"].get("1")
    if one:
        for m, r in result["rows"].items():
            r["step_plus_logits_vs_1row"] = round((r["step_ms"] + r["logits_ms"])
                                                  / (one["step_ms"] + one["logits_ms"]), 3)
    result["loadavg_end"] = list(os.getloadavg())
    llm.shutdown()
    if ns.output:
        sys.argv = ["benchmarks/cpu_verify_rows.py"] + sys.argv[1:]
        save_result(ns.output, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
