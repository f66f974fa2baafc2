"""Schema fuzzing in CI: schemathesis generates requests from the server's own
/openapi.json for about 25 seconds and finds no 5xx, no response outside the documented
schemas and statuses, and no schema-invalid request accepted. ``scripts/fuzz_api.py``
runs the same for longer."""

from __future__ import annotations

import os
import sys

import httpx
import pytest
from server_utils import RemoteServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

pytest.importorskip("schemathesis")


def test_schema_fuzzing_finds_nothing():
    import fuzz_api

    srv = RemoteServer(fuzz_api.FUZZ_SERVER_ARGS, api_key="fuzz")
    try:
        # The fuzzer covers what the schema lists: the Responses and Anthropic routes too.
        paths = httpx.get(f"{srv.url}/openapi.json", headers=srv.headers).json()["paths"]
        assert {"/v1/responses", "/v1/responses/{response_id}", "/v1/messages",
                "/v1/messages/count_tokens"} <= set(paths)
        out = fuzz_api.run(srv.url, max_time=25, api_key="fuzz", seed=0, timeout=600)
    finally:
        log = srv.log()
        srv.cleanup()
    report = "\n".join(line[:300] for line in out.stdout.splitlines())
    assert out.returncode == 0, report + out.stderr[-3000:]
    assert "passed" in report and "No issues found" in report, report
    assert "Traceback" not in log, log[-5000:]
