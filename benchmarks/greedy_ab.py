"""Greedy outputs of the embedded model, before and after a change that should not alter
them: the same prompts (three plain, four chat, temperature 0, 96 tokens) run in a
checkout of the earlier commit and in this one, each in its own process with PYTHONPATH
at its tree, and the token ids compared.

    python benchmarks/greedy_ab.py BEFORE_TREE --save-result benchmarks/results/X.json

Exit code 1 when any output differs."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "List three prime numbers greater than 100:"]
CHATS = ["Write a short poem about autumn leaves.", "def fibonacci(n):",
         "Explain in two sentences why the sky is blue.",
         "List three prime numbers greater than 100:"]
MAX_TOKENS = 96


def emit() -> None:
    """Run in the tree PYTHONPATH names; print its outputs as one JSON line."""
    import kvflow
    from kvflow import LLM, SamplingParams

    llm = LLM("smollm2-135m")
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    gen = llm.generate(PROMPTS, sp, use_tqdm=False)
    chat = llm.chat([[{"role": "user", "content": p}] for p in CHATS], sp, use_tqdm=False)
    rows = [{"kind": kind, "prompt": p, "text": o.outputs[0].text,
             "token_ids": list(o.outputs[0].token_ids)}
            for kind, ps, outs in (("generate", PROMPTS, gen), ("chat", CHATS, chat))
            for p, o in zip(ps, outs)]
    print(json.dumps({"kvflow_file": kvflow.__file__, "outputs": rows}))


def side(tree: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "KVFLOW_NO_PROGRESS": "1"}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--emit"], cwd=tree,
                          env=env, capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True,
                            text=True).stdout.strip()
    assert out["kvflow_file"].startswith(os.path.realpath(tree)), out["kvflow_file"]
    return {"tree": tree, "commit": commit, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before_tree", nargs="?")
    ap.add_argument("--save-result")
    ap.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.emit:
        return emit()
    before, after = side(os.path.abspath(ns.before_tree)), side(ROOT)
    same = [a["token_ids"] == b["token_ids"]
            for a, b in zip(before["outputs"], after["outputs"])]
    for ok, row in zip(same, after["outputs"]):
        print(f"{'same' if ok else 'DIFFERENT'}  {row['kind']:8} {len(row['token_ids']):3} "
              f"tokens  {row['prompt']!r}")
    sys.path.insert(0, ROOT)
    from kvflow.bench.machine import save_result

    save_result(ns.save_result, {"workload": {"model": "smollm2-135m", "temperature": 0.0,
                                              "max_tokens": MAX_TOKENS},
                                 "identical": all(same), "before": before, "after": after})
    sys.exit(0 if all(same) else 1)


if __name__ == "__main__":
    main()
