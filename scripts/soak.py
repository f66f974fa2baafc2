#!/usr/bin/env python
"""Soak test of ``kvflow serve``: thousands of mixed requests with random client
disconnects, timeouts and invalid requests against a live server with a small KV cache,
then the checks that say the server came out as it went in.

    scripts/soak.py --requests 10000 --concurrency 32 \\
        --save-result benchmarks/results/soak-cpu-10000.json

starts its own server (the embedded model on CPU, a small KV cache so that preemption
happens; ``--server-arg`` passes more options) unless ``--url`` points at one. The mix:
completions and chat, streamed or not, n up to 3, stop strings, logprobs, priorities,
clients that disconnect after a few chunks or time out, and a share of invalid or
oversized requests. Checks:

* every valid request got a complete answer (each choice with a finish reason, a
  stream ending in [DONE]) unless its client left or it was refused with 429 while the
  queue was full;
* no 5xx, and every invalid request got its 4xx;
* afterwards the engine is idle: 0 running, 0 waiting, 0 KV blocks held (no leaked
  blocks), the server's and the engine core's open file descriptors back to where they
  were, and their memory (RSS) flat within a bound after warm-up.

Exit code 0 when every check holds. ``tests/test_soak.py`` runs a short version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
         "brew strong coffee near the old river bank").split()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvflow:") and "{" in line:
            name = line.split("{")[0]
            if "finished_reason" in line:
                name += ":" + line.split('finished_reason="')[1].split('"')[0]
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


class Soak:
    def __init__(self, ns: argparse.Namespace, url: str, headers: dict) -> None:
        self.ns = ns
        self.url = url
        self.headers = headers
        self.rng = random.Random(ns.seed)
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []

    def count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def fail(self, msg: str) -> None:
        self.count("check_failed")
        if len(self.failures) < 50:
            self.failures.append(msg)

    # --- one request ------------------------------------------------------------------
    def make(self) -> tuple[str, str, dict, str]:
        """(kind, path, body, expectation): expectation is "ok" or "4xx"."""
        r = self.rng
        chat = r.random() < 0.5
        words = " ".join(r.choice(WORDS) for _ in range(r.randint(2, self.ns.max_words)))
        body: dict = {"max_tokens": r.randint(1, self.ns.max_tokens),
                      "temperature": r.choice([0.0, 0.7, 1.0])}
        if chat:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": words}]
            if r.random() < 0.2:
                body["logprobs"], body["top_logprobs"] = True, r.randint(0, 3)
        else:
            path = "/v1/completions"
            body["prompt"] = words
            if r.random() < 0.2:
                body["logprobs"] = r.randint(0, 3)
        if r.random() < 0.3:
            body["n"] = r.randint(2, 3)
            body["seed"] = r.randint(0, 1000)
        if r.random() < 0.3:
            body["stop"] = r.sample(WORDS, r.randint(1, 3))
        if r.random() < 0.3:
            body["priority"] = r.randint(-5, 5)
        body["stream"] = r.random() < 0.5
        x = r.random()
        if x < self.ns.invalid_share:
            return self._invalid(path, body)
        if x < self.ns.invalid_share + self.ns.disconnect_share:
            return "disconnect", path, body, "ok"
        if x < self.ns.invalid_share + self.ns.disconnect_share + self.ns.timeout_share:
            return "timeout", path, body, "ok"
        return "normal", path, body, "ok"

    def _invalid(self, path: str, body: dict) -> tuple[str, str, dict, str]:
        r = self.rng
        bad = r.choice([
            {"temperature": 2.5}, {"max_tokens": "5"}, {"top_k": 2**63 + 5},
            {"priority": 2**64}, {"stop": ["x"] * 100}, {"stop": "y" * 10_000},
            {"n": 10_000}, {"unknown_field": 1}, {"stop_token_ids": [2**64]},
            {"max_tokens": 100_000}, {"top_p": 0}, {"seed": 2**70},
        ])
        if path.endswith("chat/completions") and r.random() < 0.5:
            bad = r.choice([{"messages": [{"role": "wizard", "content": "hi"}]},
                            {"messages": [{"role": "user", "content": None}]},
                            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                            {"chat_template_kwargs": {"messages": []}},
                            {"messages": []}])
        if r.random() < 0.05:
            return "oversized", path, {**body, "prompt": "z" * (self.ns.max_body + 10),
                                       "messages": [{"role": "user", "content": "z"}]}, "4xx"
        return "invalid", path, {**body, **bad}, "4xx"

    async def one(self, client: httpx.AsyncClient, i: int) -> None:
        kind, path, body, expect = self.make()
        self.count(f"sent_{kind}")
        timeout = self.rng.uniform(0.05, 1.0) if kind == "timeout" else self.ns.request_timeout
        try:
            await asyncio.wait_for(self._send(client, kind, path, body, expect), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            self.count("client_timed_out")
            if kind != "timeout":
                self.fail(f"request {i} ({kind} {path}) timed out after {timeout:.0f} s")
        except httpx.HTTPError as e:
            self.fail(f"request {i} ({kind} {path}): {type(e).__name__}: {e}")

    async def _send(self, client: httpx.AsyncClient, kind: str, path: str, body: dict,
                    expect: str) -> None:
        stream = bool(body.get("stream"))
        async with client.stream("POST", self.url + path, json=body,
                                 headers=self.headers) as resp:
            status = resp.status_code
            if status >= 500:
                self.count("status_5xx")
                self.fail(f"{status} for {path} {json.dumps(body)[:300]}: "
                          f"{(await resp.aread())[:300]!r}")
                return
            if expect == "4xx":
                await resp.aread()
                if 400 <= status < 500:
                    self.count("refused_as_expected")
                else:
                    self.fail(f"invalid request answered {status}: {json.dumps(body)[:200]}")
                return
            if status == 429:
                await resp.aread()
                if "retry-after" not in resp.headers:
                    self.fail("429 without Retry-After")
                self.count("queue_full_429")
                return
            if status != 200:
                self.fail(f"{status} for a valid request {json.dumps(body)[:300]}: "
                          f"{(await resp.aread())[:300]!r}")
                return
            n = body.get("n", 1)
            if not stream:
                data = json.loads(await resp.aread())
                self._check_choices(path, data["choices"], n, body)
                self.count("complete")
                return
            finished: dict[int, str] = {}
            done = False
            chunks = 0
            leave_after = self.rng.randint(1, 4) if kind == "disconnect" else None
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    self.fail(f"error event in a stream: {data[:300]}")
                    return
                for c in chunk["choices"]:
                    if c.get("finish_reason"):
                        finished[c["index"]] = c["finish_reason"]
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    self.count("client_left")
                    return  # closing the response disconnects
            if not done or len(finished) != n or \
                    not set(finished.values()) <= {"stop", "length"}:
                self.fail(f"incomplete stream ({done=}, {finished=}, n={n}) for "
                          f"{json.dumps(body)[:200]}")
                return
            self.count("complete")

    def _check_choices(self, path: str, choices: list[dict], n: int, body: dict) -> None:
        if len(choices) != n:
            self.fail(f"{len(choices)} choices for n={n}")
        for c in choices:
            if c.get("finish_reason") not in ("stop", "length"):
                self.fail(f"choice without a finish reason: {json.dumps(c)[:200]}")

    # --- the run ----------------------------------------------------------------------
    async def run(self, pids: list[int]) -> dict:
        ns = self.ns
        limits = httpx.Limits(max_connections=ns.concurrency + 8,
                              max_keepalive_connections=ns.concurrency)
        samples = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(ns.request_timeout),
                                     limits=limits) as client:
            sem = asyncio.Semaphore(ns.concurrency)
            next_sample = 0
            start = time.monotonic()

            async def task(i: int) -> None:
                try:
                    await self.one(client, i)
                finally:
                    sem.release()

            pending = set()
            stop_at = None if ns.max_duration_s is None else start + ns.max_duration_s
            for i in range(ns.requests):
                if stop_at is not None and time.monotonic() > stop_at:
                    print(f"--max-duration-s reached: {i} of {ns.requests} requests sent",
                          flush=True)
                    break
                await sem.acquire()  # at most ``concurrency`` requests in flight
                pending.add(asyncio.ensure_future(task(i)))
                pending = {t for t in pending if not t.done()}
                if i >= next_sample:
                    samples.append({"requests": i, "t": round(time.monotonic() - start, 1),
                                    "rss_kib": [rss_kib(p) for p in pids],
                                    "fds": [num_fds(p) for p in pids]})
                    next_sample += max(1, ns.requests // 20)
                    if ns.progress:
                        print(f"{i}/{ns.requests} sent, {time.monotonic() - start:.0f} s, "
                              f"{self.counts}", flush=True)
            await asyncio.gather(*pending)
            elapsed = time.monotonic() - start
        return {"elapsed_s": round(elapsed, 1), "samples": samples,
                "requests_sent": sum(v for k, v in self.counts.items()
                                     if k.startswith("sent_"))}


async def wait_idle(url: str, headers: dict, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    m: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < deadline:
            m = metrics((await client.get(url + "/metrics", headers=headers)).text)
            if (m.get("kvflow:num_requests_running") == 0
                    and m.get("kvflow:num_requests_waiting") == 0
                    and m.get("kvflow:kv_cache_used_blocks") == 0):
                return m
            await asyncio.sleep(0.5)
    return m


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=6, help="largest max_tokens sent")
    p.add_argument("--max-words", type=int, default=24, help="longest prompt, in words")
    p.add_argument("--invalid-share", type=float, default=0.05)
    p.add_argument("--disconnect-share", type=float, default=0.05)
    p.add_argument("--timeout-share", type=float, default=0.03)
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="a valid request not answered in this time fails the soak")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-duration-s", type=float, default=None,
                   help="stop sending new requests after this long (the checks still run)")
    p.add_argument("--url", default=None, help="an already running server (default: start "
                   "one with a small KV cache)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra option for the server this script starts (repeatable)")
    p.add_argument("--kv-cache-memory", default="48MiB")
    p.add_argument("--max-body", type=int, default=65536, help="the server's --max-body-bytes")
    p.add_argument("--rss-bound-mib", type=float, default=150.0,
                   help="allowed RSS growth of each process from the first quarter on")
    p.add_argument("--fd-slack", type=int, default=16,
                   help="allowed growth in open file descriptors, per process")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--save-result", default=None)
    ns = p.parse_args(argv)

    server = None
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    if ns.url:
        url, pids = ns.url.rstrip("/"), []
    else:
        from server_utils import RemoteServer

        server = RemoteServer(["--kv-cache-memory", ns.kv_cache_memory, "--max-body-bytes",
                               str(ns.max_body), "--stats-log-interval", "30",
                               *ns.server_arg], api_key=ns.api_key)
        url = server.url
        pids = [server.proc.pid, server.core_pid()]
    try:
        soak = Soak(ns, url, headers)
        fds_before = [num_fds(p) for p in pids]
        run = asyncio.run(soak.run(pids))
        final = asyncio.run(wait_idle(url, headers, 120))
        fds_after = [num_fds(p) for p in pids]
        rss_after = [rss_kib(p) for p in pids]
    finally:
        log = server.log() if server else ""
        code = server.stop() if server else 0
    checks: dict[str, bool] = {
        "no_5xx": soak.counts.get("status_5xx", 0) == 0,
        "every_request_answered": not soak.failures,
        "running_0": final.get("kvflow:num_requests_running") == 0,
        "waiting_0": final.get("kvflow:num_requests_waiting") == 0,
        "kv_blocks_back_to_0": final.get("kvflow:kv_cache_used_blocks") == 0,
    }
    samples = run["samples"]
    if pids:
        checks["fds_back"] = all(a <= b + ns.fd_slack for a, b in zip(fds_after, fds_before))
        base = samples[len(samples) // 4]["rss_kib"] if samples else rss_after
        growth = [(a - b) / 1024 for a, b in zip(rss_after, base)]
        checks["rss_flat"] = all(g <= ns.rss_bound_mib for g in growth)
    if server is not None:
        checks["no_traceback_in_server_log"] = "Traceback" not in log
        checks["server_exit_0"] = code == 0
    result = {
        "soak": {k: v for k, v in vars(ns).items() if k not in ("api_key",)},
        "counts": dict(sorted(soak.counts.items())),
        "requests_sent": run["requests_sent"],
        "elapsed_s": run["elapsed_s"],
        "requests_per_s": round(run["requests_sent"] / run["elapsed_s"], 2),
        "final_metrics": {k: v for k, v in final.items()
                          if "running" in k or "waiting" in k or "kv_cache" in k
                          or "request_success" in k or "preemptions" in k},
        "fds_before": fds_before, "fds_after": fds_after,
        "rss_kib_after": rss_after, "samples": samples,
        "checks": checks, "failures": soak.failures,
        "loadavg": os.getloadavg(),
    }
    if ns.save_result:
        from kvflow.bench.machine import save_result

        result = save_result(None, result)
        result["command"] = "scripts/soak.py " + " ".join(shlex.quote(a) for a in
                                                         sys.argv[1:])
        os.makedirs(os.path.dirname(os.path.abspath(ns.save_result)), exist_ok=True)
        with open(ns.save_result, "w") as f:
            json.dump(result, f, indent=2)
        print(f"saved {ns.save_result}")
    print(json.dumps({"counts": result["counts"], "elapsed_s": result["elapsed_s"],
                      "checks": checks, "failures": soak.failures[:10]}, indent=2))
    if server is not None and "Traceback" in log:
        print(log[-5000:], file=sys.stderr)
    if server is not None:
        server.cleanup()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
