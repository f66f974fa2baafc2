"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) through the
official ``anthropic`` client, against the shared ``kvflow serve`` subprocess (the
session ``server`` fixture): create, stream (text_stream and the final message),
stop_sequences, count_tokens, prefill, refusals in Anthropic's error shape. The chat
route on the same messages is the reference."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"
# The client no longer has sampling arguments (newer Claude models fix them); the API
# still takes them, and greedy answers are what the chat route can be compared with.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0,
                               timeout=120)


def chat(server, messages, max_tokens=10, **extra):
    client = server.openai_client()
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_tokens=max_tokens, **extra)
    return r.choices[0], r.usage


def test_create_matches_chat(server, client):
    m = client.messages.create(model=MODEL, max_tokens=10, **GREEDY,
                               system="You are a helpful assistant.",
                               messages=[{"role": "user", "content": QUESTION}])
    ref, usage = chat(server, [{"role": "system", "content": "You are a helpful assistant."},
                               {"role": "user", "content": QUESTION}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL and [b.type for b in m.content] == ["text"]
    assert m.content[0].text == ref.message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[ref.finish_reason]
    assert m.usage.input_tokens == usage.prompt_tokens
    assert m.usage.output_tokens == usage.completion_tokens


def test_stream_text_and_final_message(server, client):
    kwargs = dict(model=MODEL, max_tokens=10, **GREEDY,
                  system=[{"type": "text", "text": "Be brief.",
                           "cache_control": {"type": "ephemeral"}}],
                  messages=[{"role": "user",
                             "content": [{"type": "text", "text": QUESTION}]}])
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens == plain.usage.input_tokens
    # The raw event names (the client drops the ping).
    body = {"model": MODEL, "max_tokens": 10, "temperature": 0, "stream": True,
            "messages": kwargs["messages"], "system": kwargs["system"]}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=120) as r:
        events = [line[len("event: "):] for line in r.iter_lines()
                  if line.startswith("event: ")]
    deltas = events.count("content_block_delta")
    assert deltas >= 1
    assert events == (["message_start", "content_block_start", "ping"]
                      + ["content_block_delta"] * deltas
                      + ["content_block_stop", "message_delta", "message_stop"])


def test_stop_sequences_and_max_tokens(server, client):
    plain = client.messages.create(model=MODEL, max_tokens=12, **GREEDY,
                                   messages=[{"role": "user", "content": "Count from 1 to 9."}])
    text = plain.content[0].text
    # A stop sequence taken from the greedy answer itself must end it there.
    stop = next(ch for ch in "3456" if ch in text)
    m = client.messages.create(model=MODEL, max_tokens=12, **GREEDY,
                               stop_sequences=[stop],
                               messages=[{"role": "user", "content": "Count from 1 to 9."}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]
    short = client.messages.create(model=MODEL, max_tokens=3, **GREEDY,
                                   messages=[{"role": "user", "content": QUESTION}])
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    # max_tokens is a ceiling: far past the 512-token context it is lowered, not refused.
    big = client.messages.create(model=MODEL, max_tokens=100000, **GREEDY,
                                 stop_sequences=["."],
                                 messages=[{"role": "user", "content": QUESTION}])
    assert big.stop_reason in ("stop_sequence", "end_turn")


def test_count_tokens(server, client):
    messages = [{"role": "user", "content": QUESTION}]
    n = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    tok = httpx.post(f"{server.url}/tokenize", json={"messages": [
        {"role": "system", "content": "Be brief."}, *messages]}).json()
    assert n.input_tokens == tok["count"]


def test_prefill_continues_the_answer(server, client):
    m = client.messages.create(model=MODEL, max_tokens=8, **GREEDY, messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "The capital of France is"}])
    # Reference: the rendered prompt's ids, then the prefill's (the template's prompt ends
    # in a newline, where the tokenizer splits anyway), as a completion.
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": [
        {"role": "user", "content": QUESTION}]}).json()["tokens"]
    prefill = httpx.post(f"{server.url}/tokenize", json={
        "prompt": "The capital of France is", "add_special_tokens": False}).json()["tokens"]
    ref = server.openai_client().completions.create(model=MODEL, prompt=prompt + prefill,
                                                    max_tokens=8, temperature=0)
    assert m.content[0].text == ref.choices[0].text
    assert m.usage.input_tokens == len(prompt) + len(prefill)


def test_invalid_request_anthropic_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                               extra_body={}, max_tokens=anthropic.NOT_GIVEN)
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}])
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server.url}/v1/messages", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_api_key_and_anthropic_errors_in_process():
    """x-api-key is honoured like the bearer key, and the guard's 401 and 413 on the
    Anthropic paths come in Anthropic's shape (the guard and error handlers, no engine)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvflow.entrypoints.anthropic.errors import anthropic_error_body
    from kvflow.entrypoints.openai.errors import install_error_handlers
    from kvflow.entrypoints.openai.middleware import GuardMiddleware

    app = FastAPI()
    shapes = {"/v1/messages": anthropic_error_body}
    install_error_handlers(app, shapes)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens():
        return {"input_tokens": 7}

    guarded = GuardMiddleware(app, api_key="sekret", max_body_bytes=2048, shapes=shapes)
    http = TestClient(guarded)

    def client(key):
        return anthropic.Anthropic(base_url="http://testserver", api_key=key,
                                   http_client=http, max_retries=0)

    msgs = [{"role": "user", "content": "hi"}]
    assert client("sekret").messages.count_tokens(model=MODEL, messages=msgs).input_tokens == 7
    with pytest.raises(anthropic.AuthenticationError) as e:
        client("wrong").messages.count_tokens(model=MODEL, messages=msgs)
    assert e.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": e.value.body["error"]["message"]}}
    with pytest.raises(anthropic.APIStatusError) as e:
        client("sekret").messages.count_tokens(model=MODEL,
                                               messages=[{"role": "user", "content": "x" * 4096}])
    assert e.value.status_code == 413
    assert e.value.body["error"]["type"] == "request_too_large"
    # The OpenAI routes keep OpenAI's shape.
    r = http.post("/v1/chat/completions", json={}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert http.post("/v1/nope", headers={"x-api-key": "sekret"}).json()["error"]["type"] \
        == "not_found_error"


WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": WEATHER["input_schema"]}}]
ASK = "What is the weather in Paris? Use the get_weather tool."


def test_tools_match_the_chat_route(server, client):
    # A forced tool: a call whatever this small model would say (its arguments are JSON
    # once the grammar engine enforces the schema; until then input holds the text).
    ref, _ = chat(server, [{"role": "user", "content": ASK}], max_tokens=12,
                  tools=CHAT_TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = ref.message.tool_calls
    assert calls
    kwargs = dict(model=MODEL, max_tokens=12, **GREEDY, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": ASK}])
    m = client.messages.create(**kwargs)
    assert [b.type for b in m.content] == ["tool_use"]
    block, args = m.content[0], calls[0].function.arguments
    assert block.name == "get_weather" and block.id == block.id.strip()
    try:
        assert block.input == json.loads(args)
    except ValueError:
        assert block.input == {"arguments": args}
    assert m.stop_reason == ("tool_use" if ref.finish_reason == "tool_calls"
                             else "max_tokens")
    with client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == \
        [(b.type, b.name, b.input) for b in m.content]
    assert final.stop_reason == m.stop_reason
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_tool_use_and_result_round_trip(server, client):
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "18 degrees, sunny"}]}]}]
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": "Let me check.", "tool_calls": [
                   {"id": "toolu_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "toolu_1", "content": "18 degrees, sunny"}]
    tok = httpx.post(f"{server.url}/tokenize", json={"messages": history,
                                                     "tools": CHAT_TOOLS}).json()
    n = client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
    assert n.input_tokens == tok["count"]
    # Warm the prefix cache first, so both compared requests compute the same uncached
    # tail (a prompt computed whole or partly cached can part at a near tie; docs/cpu-step.md).
    client.messages.create(model=MODEL, max_tokens=1, **GREEDY, tools=[WEATHER],
                           messages=messages)
    ref, usage = chat(server, history, max_tokens=4, tools=CHAT_TOOLS)
    m = client.messages.create(model=MODEL, max_tokens=4, **GREEDY, tools=[WEATHER],
                               messages=messages)
    assert m.usage.input_tokens == usage.prompt_tokens == tok["count"]
    assert "".join(b.text for b in m.content if b.type == "text") == \
        (ref.message.content or "")


def test_bad_tools_are_400_in_anthropic_shape(client):
    for kwargs, says in [
            (dict(tools=[{**WEATHER, "input_schema": {"type": "nonsense"}}]), "input_schema"),
            (dict(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "nope"),
            (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
             "web_search_20250305")]:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=MODEL, max_tokens=4, **kwargs,
                                   messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert says in e.value.body["error"]["message"], e.value.body


def test_output_config_format_matches_chat_response_format(server, client):
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Which city is the capital of France? JSON."}]
    ref, _ = chat(server, messages, max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    m = client.messages.create(model=MODEL, max_tokens=30, **GREEDY, messages=messages,
                               output_config={"format": {"type": "json_schema",
                                                         "schema": schema}})
    assert m.content[0].text == ref.message.content
    if m.stop_reason == "end_turn":
        jsonschema.validate(json.loads(m.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=messages,
                               output_config={"format": {"type": "json_schema",
                                                         "schema": {"type": "nonsense"}}})
    assert e.value.body["error"]["type"] == "invalid_request_error"
