"""Strict, OpenAI-shaped validation: every case a hostile but fair client tried that the
server once got wrong (a crash, a 500, a coercion, a confusing message) is a 400 naming
the field and what it allows, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from test_server_errors import assert_error, post

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Hi"}]


def completion(server, **body) -> httpx.Response:
    return post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                            **body})


def chat(server, **body) -> httpx.Response:
    return post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT,
                                                 "max_tokens": 2, **body})


def test_top_k_beyond_the_vocabulary_means_no_limit(server):
    # Once: "index 99999 is out of bounds" in sampling, and the server exited.
    r = completion(server, top_k=100_000, temperature=1.0, seed=1)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert_error(completion(server, top_k=2**63 + 5), 400, "top_k", ("9223372036854775807",))
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("field,value,param", [
    ("top_k", 2**64, "top_k"), ("priority", 2**64, "priority"),
    ("priority", -(2**64), "priority"), ("seed", 2**64, "seed"),
    ("stop_token_ids", [2**64], "stop_token_ids.0"), ("min_tokens", 2**64, "min_tokens"),
    ("max_tokens", 2**64, "max_tokens"),
])
def test_integers_beyond_64_bits_are_400(server, field, value, param):
    # Once: OverflowError while encoding the IPC message, a 500.
    err = assert_error(completion(server, **{field: value}), 400, param)
    assert "should be" in err["message"]  # pydantic's bound, with the number


def test_stop_token_ids_outside_the_vocabulary(server):
    err = assert_error(completion(server, stop_token_ids=[60_000]), 400, "stop_token_ids")
    assert "49152" in err["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "chat_template"])
def test_chat_template_kwargs_may_not_override_the_renderer(server, path, key):
    # Once: a TypeError for duplicate keyword arguments, a 500.
    body = {"messages": CHAT, "chat_template_kwargs": {key: []}}
    if path != "/tokenize":
        body["max_tokens"] = 1
    err = assert_error(post(server, path, body), 400, "chat_template_kwargs", (key,))
    assert "messages" in err["message"] and "add_generation_prompt" in err["message"]


@pytest.mark.parametrize("body,param,says", [
    ({"max_tokens": "5"}, "max_tokens", "integer"),  # once coerced to 5
    ({"temperature": True}, "temperature", "number"),  # once coerced to 1.0
    ({"temperature": "0.5"}, "temperature", "number"),
    ({"temperature": 2.5}, "temperature", "2"),  # OpenAI's range is 0..2
    ({"top_p": 0}, "top_p", "0"),
    ({"presence_penalty": 2.5}, "presence_penalty", "2"),
    ({"n": True}, "n", "integer"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"stop": ["x"] * 100}, "stop", "16"),  # once accepted: matching on every delta
    ({"stop": "y" * 10_000}, "stop", "256"),
    ({"stop": 5}, "stop", "str"),
    ({"stop_token_ids": list(range(100))}, "stop_token_ids", "16"),
    ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias", "300"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias.x", "pattern"),
    ({"logit_bias": {"5": 500}}, "logit_bias.5", "100"),
    ({"best_of": 1000}, "best_of", "128"),
    ({"n": 129}, "n", "128"),
    ({"logprobs": 21}, "logprobs", "20"),
    ({"prompt": [[]]}, "prompt.0", "at least 1"),
    ({"prompt": 3.5}, "prompt", "str, list[str], list[int], list[list[int]]"),
    ({"prompt": ["a"] * 300}, "prompt", "256"),
    ({"seed": 1.5}, "seed", "integer"),
    ({"service_tier": "gold"}, "service_tier", "'auto'"),
])
def test_completion_values_are_strict(server, body, param, says):
    err = assert_error(completion(server, **body), 400, param, (says,))
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("messages,param,says", [
    ([{"role": "wizard", "content": "hi"}], "messages.0.role",
     "'system', 'developer', 'user', 'assistant' or 'tool'"),  # once rendered as is
    ([{"role": "user", "content": None}], "messages.0", "content is required"),
    ([{"role": "user"}], "messages.0", "content is required"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text",
     "missing"),  # once: "only text content parts are supported, got 'text'"
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages.0.content.0", "only text content parts are supported"),
    ([{"role": "user", "content": 5}], "messages.0.content", "expected one of"),
    ([{"role": "user", "content": "hi", "wizardry": 1}], "messages.0.wizardry", "unknown"),
    ([], "messages", "at least 1"),
])
def test_chat_messages_are_strict(server, messages, param, says):
    assert_error(chat(server, messages=messages), 400, param, (says,))


@pytest.mark.parametrize("body,param", [
    ({"logprobs": "true"}, "logprobs"), ({"top_logprobs": 21, "logprobs": True},
                                         "top_logprobs"),
    ({"max_completion_tokens": "3"}, "max_completion_tokens"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
])
def test_chat_values_are_strict(server, body, param):
    assert_error(chat(server, **body), 400, param)


def test_assistant_message_with_tool_calls_may_have_null_content(server):
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "add", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"},
                {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}]
    r = post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text


def test_echo_text_and_offsets_agree_for_special_token_prompts(server):
    # Once: the echoed text left the special tokens out but tokens/text_offset had
    # them (an offset of 33 into a 9-character text).
    tok = post(server, "/tokenize", {"prompt": "<|im_start|>user\nHi"}).json()["tokens"]
    r = post(server, "/v1/completions", {"prompt": tok, "max_tokens": 2, "echo": True,
                                         "logprobs": 0, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text.startswith("<|im_start|>user\nHi")
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        assert text[offset:offset + len(token)] == token, (text, token, offset)


def test_openapi_schema_describes_the_constraints(server):
    r = httpx.get(f"{server.url}/openapi.json", timeout=30)
    assert r.status_code == 200
    schemas = r.json()["components"]["schemas"]
    props = schemas["CompletionRequest"]["properties"]
    temp = next(s for s in props["temperature"]["anyOf"] if s.get("type") == "number")
    assert temp["minimum"] == 0 and temp["maximum"] == 2
    n = props["n"]
    assert n["minimum"] == 1 and n["maximum"] == 128
    role = schemas["ChatMessage"]["properties"]["role"]
    assert set(role["enum"]) == {"system", "developer", "user", "assistant", "tool"}
    paths = r.json()["paths"]
    assert "422" not in paths["/v1/completions"]["post"]["responses"]
    assert "400" in paths["/v1/completions"]["post"]["responses"]
    assert httpx.get(f"{server.url}/docs", timeout=30).status_code == 200


def test_server_still_serves_after_all_that(server):
    r = completion(server, max_tokens=3, temperature=0)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
