"""The burst of issue 29 on a cold server, with and without a server option.

For each configuration (alternating, ``--rounds`` times) this starts a fresh
``kvflow serve`` of the embedded model (a cold prefix cache), records its start-up time
(process start to /health 200), runs

    kvflow bench serve --num-prompts 16 --input-len 128 --output-len 32 --request-rate 4

against it, and stops it. ``--server`` runs another engine's server (llama-server on
the same GGUF file) in turn with them, against the same prompts when ``--bench-args``
fixes ``--seed`` instead of ``--fresh-prompts``. The result JSON holds every run (mean
TTFT, median / p99 TPOT, output tokens/s) beside the command, commit and machine.

    python benchmarks/cpu_burst.py --config before="--target-step-ms 0" --config after="" \\
        --save-result benchmarks/results/cpu-burst-smooth.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
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


@contextlib.contextmanager
def running_server(cmd: list[str], port: int, log_path: str):
    """Start a server (its output to ``log_path``), wait until /health answers 200, yield
    its process; SIGTERM it (then kill after 60 s) on the way out."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
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
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def one_run(name: str, server_args: list[str], bench_args: list[str], log_dir: str,
            server_cmd: list[str] | None = None) -> dict:
    """Start a server, bench it, stop it. ``server_cmd`` (``{port}`` filled in) replaces
    ``kvflow serve`` for another engine's server, e.g. llama-server."""
    port = free_port()
    log_path = os.path.join(log_dir, f"serve-{name}-{time.time():.0f}.log")
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--port", str(port), *server_args] \
        if server_cmd is None else [a.replace("{port}", str(port)) for a in server_cmd]
    start = time.monotonic()
    with running_server(cmd, port, log_path):
        startup_s = time.monotonic() - start
        out = os.path.join(log_dir, f"bench-{name}.json")
        subprocess.run([sys.executable, "-m", "kvflow.cli", "bench", "serve", "--base-url",
                        f"http://127.0.0.1:{port}", *bench_args, "--save-result", out],
                       check=True, env={**os.environ, "KVFLOW_NO_PROGRESS": "1"})
        with open(out) as f:
            bench = json.load(f)
    with open(log_path) as f:
        log_lines = f.readlines()
    steps = [line.strip() for line in log_lines
             if "latency target" in line or "smooth steps" in line]
    # The stats line's mean engine step per logging interval (every few seconds): a
    # multi-second prefill step shows up as an interval mean of seconds.
    step_ms = sorted(float(m.group(1)) for line in log_lines
                     if (m := re.search(r"engine step: ([\d.]+) ms", line)))
    return {"config": name, "server_args": server_args if server_cmd is None else cmd, "startup_s": round(startup_s, 2),
            "loadavg_start": bench.get("loadavg"), "loadavg_end": _loadavg(),
            "server_log_latency": steps[:1],
            "engine_step_ms_interval_means": {
                "max": step_ms[-1] if step_ms else None,
                "median": step_ms[len(step_ms) // 2] if step_ms else None},
            **{k: bench.get(k) for k in KEYS}}


def _loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", dest="configs", metavar="NAME=ARGS",
                   type=lambda c: (*c.split("=", 1), False),
                   help="a server configuration: its name and extra `kvflow serve` flags")
    p.add_argument("--server", action="append", dest="configs", metavar="NAME=CMD",
                   type=lambda c: (*c.split("=", 1), True),
                   help="another server: its name and full command line, {port} for the "
                   "port it must listen on (e.g. llama-server); runs in turn with the "
                   "--config ones, in the order given")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--bench-args", default="--num-prompts 16 --input-len 128 "
                   "--output-len 32 --request-rate 4 --num-warmups 0 --fresh-prompts")
    p.add_argument("--save-result", required=True)
    p.add_argument("--notes", default="")
    p.add_argument("--log-dir", help="keep the server logs here (default: a temporary "
                   "directory)")
    ns = p.parse_args()
    if not ns.configs:
        p.error("give at least one --config or --server")
    bench_args = shlex.split(ns.bench_args)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        if ns.log_dir:
            os.makedirs(ns.log_dir, exist_ok=True)
            tmp = ns.log_dir
        for r in range(ns.rounds):
            for name, args, external in ns.configs:
                run = one_run(name, [] if external else shlex.split(args), bench_args, tmp,
                              shlex.split(args) if external else None)
                run["round"] = r
                print(json.dumps(run), flush=True)
                runs.append(run)
    save_result(ns.save_result, {"benchmark": "cpu_burst", "bench_args": ns.bench_args,
                                 "notes": ns.notes, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
