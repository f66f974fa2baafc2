"""KV memory held by one long request of a model whose every layer has a sliding window
(Mistral v0.1's layout), against the same model and request without the window, in
the same run (CPU, dummy weights: memory does not depend on the values).

    PYTHONPATH=. python benchmarks/window_kv_memory.py \
        --save-result benchmarks/results/cpu-window-kv-memory.json

Held memory is read from the scheduler's block pool after every step: blocks a request
holds (freed blocks stay findable by the prefix cache but count as free, since any
request may take them). Runs alternate window / no window (``--repeats``) on a shared
machine; memory figures are exact, times are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

from kvflow import LLM, SamplingParams
from kvflow.bench.machine import save_result

# A small Mistral-shaped model: 4 layers, 8 heads, 2 KV heads of 64 -> 2 KiB of float32
# KV per token; window 1024 (Mistral v0.1's 4096 scaled with the 4k request below).
CONFIG = dict(architectures=["MistralForCausalLM"], vocab_size=32000, hidden_size=512,
              intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
              max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2)


def run(window: int | None, prompt_len: int, output_len: int, block_size: int,
        chunk: int) -> dict:
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(CONFIG, sliding_window=window), f)
    llm = LLM(folder, load_format="dummy", device="cpu", max_model_len=8192,
              block_size=block_size, max_num_batched_tokens=chunk, kv_cache_memory="512MiB")
    sched = llm.engine.core.scheduler
    kv = sched.kv
    per_token = llm.engine.config.model.arch.kv_bytes_per_token(llm.engine.config.model.dtype)
    held: list[int] = []
    schedule = sched.schedule

    def recording_schedule(*a, **k):
        out = schedule(*a, **k)
        held.append(kv.num_blocks - kv.num_free_blocks)
        return out

    sched.schedule = recording_schedule
    prompt = [(7 * i) % 31000 + 3 for i in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    peak = max(held)
    return {"sliding_window": window, "steps": len(held), "peak_blocks": peak,
            "peak_tokens": peak * block_size, "peak_kv_bytes": peak * block_size * per_token,
            "end_blocks": held[-1], "end_kv_bytes": held[-1] * block_size * per_token,
            "blocks_freed_behind_window": kv.num_window_freed,
            "kv_bytes_per_token": per_token, "elapsed_s": round(elapsed, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=4032)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--save-result", default=None)
    ns = p.parse_args()
    runs = []
    for _ in range(ns.repeats):
        for window in (ns.window, None):
            r = run(window, ns.prompt_len, ns.output_len, ns.block_size,
                    ns.max_num_batched_tokens)
            print(json.dumps(r))
            runs.append(r)
    win = [r for r in runs if r["sliding_window"]][0]
    full = [r for r in runs if not r["sliding_window"]][0]
    summary = {"request_tokens": ns.prompt_len + ns.output_len,
               "peak_kv_bytes_window": win["peak_kv_bytes"],
               "peak_kv_bytes_no_window": full["peak_kv_bytes"],
               "peak_ratio": round(full["peak_kv_bytes"] / win["peak_kv_bytes"], 2),
               "end_kv_bytes_window": win["end_kv_bytes"],
               "end_kv_bytes_no_window": full["end_kv_bytes"]}
    print(json.dumps(summary))
    save_result(ns.save_result, {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "benchmark": "window_kv_memory", "model_config": CONFIG, "dtype": "float32",
        "runs": runs, "summary": summary,
        "notes": "CPU, dummy weights, one request alone, KVFLOW_CPU_CPP_STEP=0 in this run (both variants decode eagerly; the windowed one always does); held KV read from the block pool "
                 "after every schedule() call (peak includes the prefill chunk being "
                 "written). Runs alternate window / no window on a machine shared with "
                 "other engineers' tests: memory is exact, elapsed_s is noisy."})


if __name__ == "__main__":
    main()
