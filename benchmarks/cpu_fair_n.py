"""Issue 29's fairness case on a live server: one ``{"prompt": "config", "n": 127}``
completion, then small requests queued behind it; how long do they wait?

For each configuration (alternating, ``--rounds`` times) this starts a fresh
``kvflow serve`` of the embedded model, sends the n=127 request (``--big-max-tokens``
tokens per sample), and ``--delay`` seconds later ``--small`` streamed chat-free
completions of ``--small-max-tokens`` tokens each, one after another, through the
official ``openai`` client. It records each small request's time to first token and
total time, and the big request's total time.

    python benchmarks/cpu_fair_n.py --config before="--max-seqs-per-request 128" \\
        --config after="" --save-result benchmarks/results/cpu-fair-n127.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import threading
import time

import openai

from kvflow.bench.machine import save_result

sys.path.insert(0, os.path.dirname(__file__))
from cpu_burst import _loadavg, free_port, running_server  # noqa: E402


def one_run(name: str, server_args: list[str], ns, log_dir: str) -> dict:
    port = free_port()
    log_path = os.path.join(log_dir, f"serve-{name}-{time.time():.0f}.log")
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--port", str(port), *server_args]
    with running_server(cmd, port, log_path):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               timeout=ns.timeout, max_retries=0)
        model = client.models.list().data[0].id
        big: dict = {}

        def send_big() -> None:
            t = time.perf_counter()
            try:
                r = client.completions.create(model=model, prompt="config", n=127,
                                              max_tokens=ns.big_max_tokens, temperature=1.0)
                big["choices"] = len(r.choices)
                big["completion_tokens"] = r.usage.completion_tokens
            except openai.OpenAIError as e:
                big["error"] = f"{type(e).__name__}: {e}"
            big["total_s"] = time.perf_counter() - t

        thread = threading.Thread(target=send_big)
        start = time.perf_counter()
        thread.start()
        time.sleep(ns.delay)
        small = []
        for i in range(ns.small):
            t = time.perf_counter()
            row: dict = {"sent_after_big_s": round(t - start, 2)}
            try:
                stream = client.completions.create(
                    model=model, prompt=f"Question {i}: what is the capital of France?",
                    max_tokens=ns.small_max_tokens, temperature=0.0, stream=True)
                for chunk in stream:
                    if "ttft_s" not in row and chunk.choices and chunk.choices[0].text:
                        row["ttft_s"] = round(time.perf_counter() - t, 3)
                row["total_s"] = round(time.perf_counter() - t, 3)
            except openai.OpenAIError as e:
                row["error"] = f"{type(e).__name__}: {e}"
            small.append(row)
        thread.join()
    return {"config": name, "server_args": server_args, "loadavg_end": _loadavg(),
            "big_n127": {k: (round(v, 2) if isinstance(v, float) else v)
                         for k, v in big.items()}, "small": small}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", required=True, metavar="NAME=ARGS")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--big-max-tokens", type=int, default=64)
    p.add_argument("--small", type=int, default=3)
    p.add_argument("--small-max-tokens", type=int, default=8)
    p.add_argument("--delay", type=float, default=2.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--save-result", required=True)
    p.add_argument("--notes", default="")
    ns = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ns.rounds):
            for name, args in (c.split("=", 1) for c in ns.config):
                run = one_run(name, shlex.split(args), ns, tmp)
                run["round"] = r
                print(json.dumps(run), flush=True)
                runs.append(run)
    save_result(ns.save_result, {"benchmark": "cpu_fair_n", "notes": ns.notes,
                                 "big_max_tokens": ns.big_max_tokens,
                                 "small_max_tokens": ns.small_max_tokens,
                                 "delay_s": ns.delay, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
