"""``kvflow bench structured``: constrained decoding on a schema set of our own
(benchmarks/data/so_schemas.json, 61 schemas from flat objects to nested arrays with
enums, patterns, ``anyOf`` and ``$ref``).

- ``validity``: every schema at temperature 0 and 0.8 (seeded); the share of outputs that
  parse and validate with ``jsonschema`` (a reference validator, not the grammar engine).
- ``overhead``: the same requests with and without a constraint at batch 1 and 32, in
  alternating runs of one engine; ms per output token and the ratio. Every request makes
  exactly ``--output-len`` tokens (``ignore_eos``, and the constraint is an array of at
  least 64 of the schema's objects, so the grammar is live at every step). Also grammar
  compile time p50/p99 over the set (a fresh compiler, no cache).
- ``spec``: ngram speculation with JSON schemas against plain constrained decoding:
  tokens per verification step and ms per output token (two engines, alternating).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time

from kvflow.engine.args import EngineArgs

SCHEMAS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "data",
                       "so_schemas.json")


def add_structured_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("validity", "overhead", "spec", "all"), default="all")
    p.add_argument("--schemas", default=SCHEMAS, help="the schema set (JSON list)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="validity and spec runs: most tokens per output")
    p.add_argument("--output-len", type=int, default=64, help="overhead runs: tokens each")
    p.add_argument("--batch-sizes", default="1,32", help="overhead runs")
    p.add_argument("--repeats", type=int, default=2,
                   help="overhead/spec: alternating runs of each side (the best is kept)")
    p.add_argument("--num-spec-tokens", type=int, default=4)
    p.add_argument("--spec-schemas", type=int, default=12,
                   help="spec runs: the first N schemas (each request runs alone)")
    p.add_argument("--save-result", default=None, help="write the result JSON here")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _llm(args: EngineArgs, **changes):
    from kvflow import LLM

    a = dataclasses.replace(args, **changes)
    return LLM(**{f.name: getattr(a, f.name) for f in dataclasses.fields(a)})


def _prompt(llm, entry: dict) -> str:
    text = f"{entry['prompt']} Answer with a JSON value only."
    tok = llm.get_tokenizer()
    return tok.apply_chat_template([{"role": "user", "content": text}])


def validity(llm, schemas: list[dict], max_tokens: int) -> dict:
    import jsonschema

    from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

    out: dict = {}
    for temp in (0.0, 0.8):
        params = [SamplingParams(temperature=temp, seed=i, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=e["schema"]))
                  for i, e in enumerate(schemas)]
        start = time.perf_counter()
        res = llm.generate([_prompt(llm, e) for e in schemas], params, use_tqdm=False)
        wall = time.perf_counter() - start
        valid, failures, lengths = 0, [], 0
        for e, r in zip(schemas, res):
            c = r.outputs[0]
            lengths += len(c.token_ids)
            try:
                jsonschema.validate(json.loads(c.text), e["schema"])
                valid += 1
            except (ValueError, jsonschema.ValidationError) as err:
                failures.append({"name": e["name"], "finish_reason": c.finish_reason,
                                 "tokens": len(c.token_ids), "error": str(err)[:200],
                                 "text": c.text[:200]})
        out[f"temperature_{temp}"] = {
            "num": len(schemas), "valid": valid, "valid_share": valid / len(schemas),
            "finished_by_length": sum(f["finish_reason"] == "length" for f in failures),
            "output_tokens": lengths, "wall_s": wall, "failures": failures}
        print(f"validity T={temp}: {valid}/{len(schemas)} valid")
    return out


def compile_times(schemas: list[dict], tokenizer_path: str, vocab_size: int,
                  eos: list[int]) -> dict:
    from kvflow.sampling_params import StructuredOutputsParams
    from kvflow.structured_output.compiler import GrammarCompiler
    from kvflow.structured_output.vocab import load_tokenizer_info

    info = load_tokenizer_info(tokenizer_path, vocab_size, tuple(eos))
    times = []
    for e in schemas:
        comp = GrammarCompiler(info, threads=1)
        start = time.perf_counter()
        comp.submit(StructuredOutputsParams(json=e["schema"])).result()
        times.append(time.perf_counter() - start)
        comp.shutdown()
    return {"num": len(times), "p50_ms": 1e3 * statistics.median(times),
            "p99_ms": 1e3 * _pct(times, 0.99), "max_ms": 1e3 * max(times)}


def _long_schema(schema: dict) -> dict:
    """An array of at least 64 of the schema's values: still open after --output-len."""
    return {"type": "array", "items": schema, "minItems": 64}


def _timed(llm, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(r.outputs[0].token_ids) for r in res)


@contextlib.contextmanager
def _probe(llm):
    """Where a run's time went: mask fill per masked step and, on a GPU, the idle gap
    the host left between steps (CUDA events)."""
    import torch

    runner = llm.engine.core.executor.runner
    so = runner.structured
    before = so.stats() if so is not None else None
    meter = None
    if torch.cuda.is_available():
        from kvflow.worker.idle_meter import GpuIdleMeter

        meter = runner.idle_meter = GpuIdleMeter()
    probe: dict = {}
    try:
        yield probe
    finally:
        if meter is not None:
            runner.idle_meter = None
            rep = meter.report()
            probe.update(steps=rep["steps"], gpu_busy_ms_per_step=rep["busy_ms"]
                         / max(1, rep["steps"]), gpu_idle_ms_per_step=rep["idle_ms_per_step"])
        if so is not None:
            after = so.stats()
            steps = after.num_masked_steps - before.num_masked_steps
            probe.update(masked_steps=steps, fill_ms_per_masked_step=1e3 * (
                after.fill_s - before.fill_s) / max(1, steps))


def overhead(llm, schemas: list[dict], batch_sizes: list[int], output_len: int,
             repeats: int) -> dict:
    from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

    out = {}
    for bs in batch_sizes:
        picked = [schemas[i % len(schemas)] for i in range(bs)]
        prompts = [_prompt(llm, e) for e in picked]
        free = [SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
                for _ in picked]
        con = [SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                              structured_outputs=StructuredOutputsParams(
                                  json=_long_schema(e["schema"]))) for e in picked]
        _timed(llm, prompts, con)  # compile every grammar once (the cache is then warm)
        _timed(llm, prompts, free)  # and warm the plain path as much
        runs = {"free": [], "constrained": []}
        probes = {"free": [], "constrained": []}
        for _ in range(repeats):
            for name, params in (("free", free), ("constrained", con)):
                with _probe(llm) as probe:
                    wall, tokens = _timed(llm, prompts, params)
                runs[name].append(1e3 * wall / tokens * bs)  # ms per output token per seq
                probes[name].append(probe)
        best = {k: min(v) for k, v in runs.items()}
        out[f"batch_{bs}"] = {"ms_per_token_free": best["free"],
                              "ms_per_token_constrained": best["constrained"],
                              "overhead": best["constrained"] / best["free"] - 1,
                              "runs_ms_per_token": runs,
                              "best_run_probe": {k: probes[k][runs[k].index(best[k])]
                                                 for k in runs}}
        print(f"overhead batch {bs}: free {best['free']:.2f} ms/token, constrained "
              f"{best['constrained']:.2f} ms/token ({out[f'batch_{bs}']['overhead']:+.1%}); "
              f"probes {out[f'batch_{bs}']['best_run_probe']}")
    return out


def spec(args: EngineArgs, schemas: list[dict], max_tokens: int, k: int,
         repeats: int) -> dict:
    import jsonschema

    from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

    cfg = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
           "prompt_lookup_min": 2}
    engines = {"plain": _llm(args), "ngram": _llm(args, speculative_config=cfg)}
    prompts = [_prompt(engines["plain"], e) for e in schemas]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens,
                             structured_outputs=StructuredOutputsParams(json=e["schema"]))
              for e in schemas]
    result: dict = {"num_speculative_tokens": k, "speculative_config": cfg}
    walls = {name: [] for name in engines}
    texts = {}
    for rep in range(repeats + 1):
        for name, llm in engines.items():
            start = time.perf_counter()
            res = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
            wall = time.perf_counter() - start
            tokens = sum(len(r.outputs[0].token_ids) for r in res)
            if rep:  # the first round compiles the grammars and warms up
                walls[name].append(1e3 * wall / tokens)
            texts[name] = [r.outputs[0].text for r in res]
    core = engines["ngram"].engine.core
    s = core.scheduler.spec_stats
    so = core.executor.runner.structured.stats()
    valid = {}
    for name in engines:
        ok = 0
        for e, t in zip(schemas, texts[name]):
            try:
                jsonschema.validate(json.loads(t), e["schema"])
                ok += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        valid[name] = ok / len(schemas)
    result.update({
        "batch_size": 1,
        "ms_per_token": {n: min(v) for n, v in walls.items()},
        "runs_ms_per_token": walls,
        "speedup": min(walls["plain"]) / min(walls["ngram"]),
        "tokens_per_verify_step": (s.num_accepted_tokens + s.num_drafts) / max(1, s.num_drafts),
        "draft_acceptance": s.num_accepted_tokens / max(1, s.num_draft_tokens),
        "drafts_cut_by_grammar": so.num_draft_rejections,
        "valid_share": valid,
        "same_text_as_plain": sum(a == b for a, b in zip(texts["plain"], texts["ngram"]))
        / len(schemas)})
    print(f"spec: {result['ms_per_token']} ms/token, {result['tokens_per_verify_step']:.2f} "
          f"tokens per verify step, valid {valid}")
    for llm in engines.values():
        llm.shutdown()
    return result


def run_structured(ns: argparse.Namespace) -> None:
    from kvflow.bench.machine import save_result

    args = EngineArgs.from_cli_args(ns)
    with open(ns.schemas) as f:
        schemas = json.load(f)
    result: dict = {"benchmark": "structured outputs", "mode": ns.mode,
                    "num_schemas": len(schemas), "schemas": os.path.relpath(ns.schemas)}
    llm = None
    if ns.mode in ("validity", "overhead", "all"):
        llm = _llm(args)
        cfg = llm.engine.config
        if ns.mode in ("validity", "all"):
            result["validity"] = validity(llm, schemas, ns.max_tokens)
        if ns.mode in ("overhead", "all"):
            result["compile"] = compile_times(schemas, cfg.model.tokenizer,
                                              cfg.model.arch.vocab_size,
                                              list(cfg.model.arch.eos_token_ids))
            print(f"compile: p50 {result['compile']['p50_ms']:.1f} ms, p99 "
                  f"{result['compile']['p99_ms']:.1f} ms")
            result["overhead"] = overhead(llm, schemas,
                                          [int(b) for b in ns.batch_sizes.split(",")],
                                          ns.output_len, ns.repeats)
        result["mask_stats"] = dataclasses.asdict(llm.engine.core.executor.runner
                                                  .structured.stats())
        llm.shutdown()
    if ns.mode in ("spec", "all"):
        result["spec"] = spec(args, schemas[: ns.spec_schemas], ns.max_tokens,
                              ns.num_spec_tokens, ns.repeats)
    save_result(ns.save_result, result)
