"""Bad input and back-pressure: every error is an OpenAI error body with the right status
(400 naming the parameter, 404, 401, 413, 429), and none of them hurts the server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from server_utils import LIFECYCLE_ARGS, RemoteServer

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Hi"}]


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 contains: tuple[str, ...] = ()) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    for piece in contains:
        assert piece in err["message"], err
    return err


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


@pytest.mark.parametrize("body,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 50}, "logprobs"),
    ({"temperature": "hot"}, "temperature"),
    ({"stop": [""]}, "stop.0"),
    ({"bogus_parameter": 1}, "bogus_parameter"),
    ({"logit_bias": {"999999999": 5}}, "logit_bias"),  # not a token id of this model
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"suffix": "x"}, "suffix"),
])
def test_completion_invalid_parameters(server, body, param):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                         **body})
    err = assert_error(r, 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
])
def test_chat_invalid_parameters(server, body, param):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT,
                                              "max_tokens": 4, **body})
    assert_error(r, 400, param)


def test_prompt_too_long_names_the_numbers(server):
    ids = list(range(100, 700))  # 600 tokens > max_model_len 512
    err = assert_error(post(server, "/v1/completions", {"prompt": ids, "max_tokens": 4}),
                       400, "prompt", ("512", "600"))
    assert err["code"] == "context_length_exceeded"
    err = assert_error(post(server, "/v1/completions",
                            {"prompt": list(range(100, 400)), "max_tokens": 300}),
                       400, "max_tokens", ("512", "600", "300"))
    with pytest.raises(openai.BadRequestError) as e:
        server.openai_client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 600}], max_tokens=4)
    assert e.value.status_code == 400 and "512" in e.value.response.json()["error"]["message"]


def test_unknown_model_is_404(server):
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        err = assert_error(post(server, path, {"model": "gpt-17", **body}), 404, "model")
        assert err["code"] == "model_not_found"
    assert_error(httpx.get(f"{server.url}/v1/models/gpt-17"), 404, "model")
    with pytest.raises(openai.NotFoundError):
        server.openai_client().completions.create(model="gpt-17", prompt="Hi")


def test_malformed_and_unknown_routes(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "Hi",',
                   headers={"Content-Type": "application/json"})
    assert_error(r, 400)
    assert_error(httpx.post(f"{server.url}/v1/completions", json=[1, 2]), 400)
    assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)


def test_oversized_body_is_413(server):
    big = {"model": MODEL, "prompt": "x" * 70_000, "max_tokens": 1}  # limit: 65536 bytes
    err = assert_error(post(server, "/v1/completions", big), 413)
    assert err["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]
    r = httpx.post(f"{server.url}/v1/completions", content=chunks(),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert_error(r, 413)
    ok = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200


def test_server_survives_bad_input(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# --- a second server: API key, queue limit, graceful SIGTERM --------------------------

@pytest.fixture(scope="module")
def guarded():
    srv = RemoteServer(["--max-num-seqs", "1", "--max-queued-requests", "2",
                        *LIFECYCLE_ARGS],
                       api_key="s3cret")
    yield srv
    srv.cleanup()


def test_api_key_required_everywhere_but_health(guarded):
    url = guarded.url
    calls = [("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/version", None),
             ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
             ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
             ("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [1]}),
             ("GET", "/no-such-route", None)]
    for method, path, body in calls:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=60)
            err = assert_error(r, 401)
            assert err["code"] == "invalid_api_key"
        r = httpx.request(method, url + path, json=body, headers=guarded.headers, timeout=60)
        assert r.status_code == (404 if path == "/no-such-route" else 200), (path, r.text)
    assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_queue_full_is_429(guarded):
    client = guarded.openai_client(async_client=True)

    async def one(i: int):
        try:
            r = await client.completions.create(model=MODEL, prompt=f"Request {i}:",
                                                max_tokens=24, extra_body={"ignore_eos": True},
                                                stream=i % 2 == 1)
            if i % 2:
                r = [c async for c in r]
            return "ok"
        except openai.RateLimitError as e:
            assert e.response.headers["retry-after"] == "1"  # clients know when to retry
            return e.response.json()["error"]

    async def run():
        return await asyncio.gather(*(one(i) for i in range(8)))
    results = asyncio.run(run())
    errors = [r for r in results if r != "ok"]
    assert 0 < len(errors) < 8, results
    for err in errors:
        assert err["type"] == "rate_limit_exceeded" and err["code"] == "queue_full"
    assert "limit 2" in errors[0]["message"]
    # The queue drains and the server takes requests again.
    r = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   headers=guarded.headers, timeout=60)
    assert r.status_code == 200


def test_sigterm_shuts_down_gracefully(guarded):
    core = guarded.core_pid()
    start = time.monotonic()
    assert guarded.stop(signal.SIGTERM) == 0, guarded.log()
    assert time.monotonic() - start < 30
    with pytest.raises(ProcessLookupError):
        os.kill(core, 0)
    assert "shutting down gracefully" in guarded.log()
