#!/usr/bin/env python
"""Property-based fuzzing of ``kvflow serve`` from its own OpenAPI schema (schemathesis).

    scripts/fuzz_api.py --max-time 900                 # starts its own server
    scripts/fuzz_api.py --url http://127.0.0.1:8000 --max-time 600

schemathesis reads /openapi.json, generates requests from the schema of each route it
lists (chat, completions, the Responses and Anthropic Messages APIs ...: valid ones that
reach the engine, and invalid ones), and checks that no response is a 5xx, that
responses match the documented schemas and status codes, and that schema-invalid
requests are refused. The server it starts has a short context (--max-model-len) so
that generated requests stay cheap on CPU. Exit code 0 when nothing failed.
``tests/test_server_fuzz.py`` runs a bounded version.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance,negative_data_rejection")
# Small and cheap: a fuzzer's max_tokens and n then cost little.
FUZZ_SERVER_ARGS = ["--max-model-len", "64", "--kv-cache-memory", "64MiB",
                    "--max-body-bytes", "65536", "--stats-log-interval", "0"]


def schemathesis_command(url: str, max_time: int, api_key: str | None = None,
                         seed: int | None = None, workers: int = 1) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    cmd = [exe if os.path.exists(exe) else "schemathesis", "--config-file",
           os.path.join(ROOT, "scripts", "schemathesis.toml"), "run", f"{url}/openapi.json",
           "--checks", CHECKS, "--max-time", str(max_time), "--workers", str(workers),
           "--request-timeout", "120", "--phases", "examples,coverage,fuzzing",
           "--suppress-health-check", "all", "--warnings", "off",
           "--exclude-path", "/docs"]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if api_key:
        cmd += ["-H", f"Authorization: Bearer {api_key}"]
    return cmd


def run(url: str, max_time: int, api_key: str | None = None, seed: int | None = None,
        workers: int = 1, timeout: float | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "SCHEMATHESIS_HOOKS": ""}
    return subprocess.run(schemathesis_command(url, max_time, api_key, seed, workers),
                          capture_output=True, text=True, env=env, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-time", type=int, default=900, help="seconds of fuzzing")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=None)
    ns = p.parse_args(argv)
    server = None
    url = ns.url
    if url is None:
        from server_utils import RemoteServer

        server = RemoteServer(FUZZ_SERVER_ARGS, api_key=ns.api_key)
        url = server.url
    try:
        out = run(url.rstrip("/"), ns.max_time, ns.api_key, ns.seed, ns.workers)
        # Generated bodies can be huge: each line cut short.
        print("\n".join(line[:400] for line in out.stdout.splitlines()))
        print(out.stderr[-5000:], file=sys.stderr)
        code = out.returncode
    finally:
        if server is not None:
            log = server.log()
            server.cleanup()
            if "Traceback" in log:
                print(log[-10000:], file=sys.stderr)
                code = code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
