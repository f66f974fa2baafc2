"""Through the server: a request that makes the worker fail ends alone with an error,
overload limits (request timeout, chat render size, operator limits) answer as documented,
and /openapi.json and /docs sit behind the API key."""

from __future__ import annotations

import asyncio
import os
from unittest import mock

import httpx
import pytest
from server_utils import LIFECYCLE_ARGS, RemoteServer
from test_server_errors import assert_error

POISON = 40_000  # a token id the other prompts here never contain
KEY = "k3y"


@pytest.fixture(scope="module")
def hardened():
    with mock.patch.dict(os.environ, {"KVFLOW_FAULT_TOKEN": str(POISON)}):
        # Eager: the fault is injected around the executor, before any decode path runs.
        srv = RemoteServer(["--max-chat-prompt-chars", "3000", "--max-stop", "4",
                            "--max-n", "4", *LIFECYCLE_ARGS], api_key=KEY)
    yield srv
    srv.stop_clean()


def post(srv, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, headers=srv.headers, timeout=600, **kw)


def test_a_failing_request_ends_alone_and_the_server_stays_up(hardened):
    async def run():
        async with httpx.AsyncClient(base_url=hardened.url, headers=hardened.headers,
                                     timeout=600) as client:
            def good(i: int):
                return client.post("/v1/completions", json={
                    "prompt": f"Count to {i}:", "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True, "stream": i % 2 == 0})
            bad = client.post("/v1/completions", json={
                "prompt": [1, 2, POISON, 3], "max_tokens": 8, "n": 2})
            bad_stream = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "stop_token_ids": [1]}, headers={"X-Ignored": "1"})
            return await asyncio.gather(*(good(i) for i in range(6)), bad, bad_stream)
    *goods, bad, other = asyncio.run(run())
    for r in goods:
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
        else:
            assert r.json()["usage"]["completion_tokens"] == 8
    err = assert_error(bad, 500)
    assert "could not run this request" in err["message"] and "injected fault" in \
        err["message"]
    assert other.status_code == 200
    # The engine went on: nothing running, every KV block back, still serving.
    m = hardened.metrics()
    assert m["kvflow:num_requests_running"] == 0 and m["kvflow:kv_cache_used_blocks"] == 0
    assert httpx.get(f"{hardened.url}/health").status_code == 200
    # Streamed: it fails on its first step, before the stream starts, so a 500 too.
    r = post(hardened, "/v1/completions", {"prompt": [5, POISON], "max_tokens": 4,
                                           "stream": True})
    assert "injected fault" in assert_error(r, 500)["message"]
    ok = post(hardened, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.fixture(scope="module")
def timeout_server():
    srv = RemoteServer(["--request-timeout", "2", *LIFECYCLE_ARGS])
    yield srv
    log = srv.log()
    srv.cleanup()
    assert "Traceback" not in log, log


def test_request_timeout_is_504_and_frees_the_request(timeout_server):
    srv = timeout_server
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
    err = assert_error(post(srv, "/v1/completions", body), 504)
    assert "--request-timeout" in err["message"] and err["type"] == "timeout"
    r = post(srv, "/v1/completions", {**body, "stream": True})
    if r.status_code == 504:  # a slow machine: no first token within the timeout
        assert_error(r, 504)
    else:  # the stream started: the timeout arrives as an error event
        assert r.status_code == 200 and '"type": "timeout"' in r.text.replace('":"', '": "')
        assert r.text.rstrip().endswith("data: [DONE]")
    for _ in range(50):
        m = srv.metrics()
        if m["kvflow:num_requests_running"] == 0:
            break
        asyncio.run(asyncio.sleep(0.2))
    assert m["kvflow:num_requests_running"] == 0 and m["kvflow:kv_cache_used_blocks"] == 0


def test_chat_render_limited_in_size(hardened):
    messages = [{"role": "user", "content": "word " * 700}]  # 3500 characters > 3000
    err = assert_error(post(hardened, "/v1/chat/completions",
                            {"messages": messages, "max_tokens": 1}), 400, "messages")
    assert "3000 characters" in err["message"]
    assert_error(post(hardened, "/tokenize", {"messages": messages}), 400, "messages")


def test_operator_limits_are_server_options(hardened):
    assert_error(post(hardened, "/v1/completions", {"prompt": "x", "stop": list("abcde")}),
                 400, "stop", ("4",))
    assert_error(post(hardened, "/v1/completions", {"prompt": "x", "n": 5}), 400, "n",
                 ("4",))
    schema = httpx.get(f"{hardened.url}/openapi.json", headers=hardened.headers).json()
    assert schema["components"]["schemas"]["CompletionRequest"]["properties"]["n"][
        "maximum"] == 4


def test_schema_and_docs_need_the_key(hardened):
    for path in ("/openapi.json", "/docs"):
        assert_error(httpx.get(f"{hardened.url}{path}"), 401)
        assert httpx.get(f"{hardened.url}{path}", headers=hardened.headers).status_code == 200
