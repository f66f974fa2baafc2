"""The burst of issue 29 on a cold server, with and without a server option.

For each configuration (alternating, ``--rounds`` times) this starts a fresh
``kvflow serve`` of the embedded model (a cold prefix cache), records its start-up time
(process start to /health 200), runs

    kvflow bench serve --num-prompts 16 --input-len 128 --output-len 32 --request-rate 4

against it, and stops it. The result JSON holds every run (mean TTFT, median / p99 TPOT,
output tokens/s) beside the command, commit and machine.

    python benchmarks/cpu_burst.py --config before="--target-tpot-ms 0" --config after="" \\
        --save-result benchmarks/results/cpu-burst-smooth.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from kvflow.bench.machine import save_result

KEYS = ("completed", "failed", "duration_s", "output_throughput", "ttft_ms", "tpot_ms",
        "itl_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(name: str, server_args: list[str], bench_args: list[str], log_dir: str) -> dict:
    port = free_port()
    log_path = os.path.join(log_dir, f"serve-{name}-{time.time():.0f}.log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "serve", "--port",
                                 str(port), *server_args], stdout=log,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "KVFLOW_NO_PROGRESS": "1"})
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}; see {log_path}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        startup_s = time.monotonic() - start
        out = os.path.join(log_dir, f"bench-{name}.json")
        subprocess.run([sys.executable, "-m", "kvflow.cli", "bench", "serve", "--base-url",
                        f"http://127.0.0.1:{port}", *bench_args, "--save-result", out],
                       check=True, env={**os.environ, "KVFLOW_NO_PROGRESS": "1"})
        with open(out) as f:
            bench = json.load(f)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    with open(log_path) as f:
        steps = [line for line in f if "latency target" in line]
    return {"config": name, "server_args": server_args, "startup_s": round(startup_s, 2),
            "loadavg_start": bench.get("loadavg"), "server_log_latency": steps[:1],
            **{k: bench.get(k) for k in KEYS}}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", required=True, metavar="NAME=ARGS",
                   help="a server configuration: its name and extra `kvflow serve` flags")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--bench-args", default="--num-prompts 16 --input-len 128 "
                   "--output-len 32 --request-rate 4 --num-warmups 0")
    p.add_argument("--save-result", required=True)
    p.add_argument("--notes", default="")
    ns = p.parse_args()
    configs = [c.split("=", 1) for c in ns.config]
    bench_args = shlex.split(ns.bench_args)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ns.rounds):
            for name, args in configs:
                run = one_run(name, shlex.split(args), bench_args, tmp)
                run["round"] = r
                print(json.dumps(run), flush=True)
                runs.append(run)
    save_result(ns.save_result, {"benchmark": "cpu_burst", "bench_args": ns.bench_args,
                                 "notes": ns.notes, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
