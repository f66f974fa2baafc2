"""xgrammar vs llguidance on the embedded model's vocabulary: compile time per schema and
per-token mask time over benchmarks/data/so_schemas.json.

The token path through each schema is drawn once (seeded, from xgrammar's allowed set,
at most 48 tokens) and replayed on both engines, so both fill masks at the same states.

  python benchmarks/so_backends.py --out benchmarks/results/so-backends-cpu.json

llguidance is not a kvflow dependency (xgrammar won): `pip install llguidance` to rerun.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import numpy as np
import torch


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", default="benchmarks/data/so_schemas.json")
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-steps", type=int, default=48)
    args = ap.parse_args()
    import llguidance
    import llguidance.torch as llt
    import xgrammar as xgr

    from kvflow.bench.machine import git_commit, machine_info
    from kvflow.engine.tokenizer import Tokenizer
    from kvflow.models.registry import embedded_model_path
    from kvflow.structured_output.vocab import tokenizer_info

    tok = Tokenizer.from_path(embedded_model_path("smollm2-135m"))
    vocab_size = 49152
    eos = tok.eos_token_id
    schemas = json.load(open(args.schemas))
    t0 = time.perf_counter()
    info = tokenizer_info(tok.backend, vocab_size, [eos])
    xgr_vocab_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    llg_vocab_s = time.perf_counter() - t0
    rng = random.Random(0)
    res = {"xgrammar": {"compile_s": [], "mask_s": []},
           "llguidance": {"compile_s": [], "mask_s": []}}
    mismatches: list[str] = []
    for entry in schemas:
        text = json.dumps(entry["schema"])
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(text, any_whitespace=False,
                                          separators=(",", ":"))
        res["xgrammar"]["compile_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False, "item_separator": ",",
                      "key_separator": ":"})
        lm = llguidance.LLMatcher(lltok, grammar)
        res["llguidance"]["compile_s"].append(time.perf_counter() - t0)
        assert not lm.is_error(), lm.get_error()
        xm = xgr.GrammarMatcher(cg)
        xmask = xgr.allocate_token_bitmask(1, vocab_size)
        lmask = llt.allocate_token_bitmask(1, vocab_size)
        for _ in range(args.max_steps):
            t0 = time.perf_counter()
            xm.fill_next_token_bitmask(xmask)
            res["xgrammar"]["mask_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            llt.fill_next_token_bitmask(lm, lmask, 0)
            res["llguidance"]["mask_s"].append(time.perf_counter() - t0)
            bits = np.unpackbits(xmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]
            allowed = np.nonzero(bits)[0].tolist()
            if not allowed:
                break
            t = rng.choice(allowed)
            if t == eos:
                break
            if not (xm.accept_token(t) and lm.consume_token(t)):
                mismatches.append(entry["name"])  # the engines disagree on this token
                break
    out = {"benchmark": "structured-output backends (compile + mask) on SmolLM2-135M's vocab",
           "command": " ".join(["python"] + sys.argv), "machine": machine_info(),
           "commit": git_commit(), "num_schemas": len(schemas), "disagreements": mismatches,
           "vocab_build_s": {"xgrammar": xgr_vocab_s, "llguidance": llg_vocab_s},
           "notes": "shared 2-core machine (other engineers' tests running); compile with "
                    "a fresh compiler and no cache per schema, one thread"}
    for name, r in res.items():
        out[name] = {"compile_ms_p50": 1e3 * statistics.median(r["compile_s"]),
                     "compile_ms_p99": 1e3 * pct(r["compile_s"], 0.99),
                     "compile_ms_max": 1e3 * max(r["compile_s"]),
                     "mask_us_p50": 1e6 * statistics.median(r["mask_s"]),
                     "mask_us_p99": 1e6 * pct(r["mask_s"], 0.99),
                     "mask_us_mean": 1e6 * statistics.mean(r["mask_s"]),
                     "num_masks": len(r["mask_s"])}
    print(json.dumps({k: out[k] for k in ("xgrammar", "llguidance", "vocab_build_s")}, indent=1))
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
