"""Tool calling and reasoning output through the official ``openai`` client against one
``kvflow serve`` (the embedded SmolLM2, whose template has no tools: the default tool
prompt and the hermes parser) started with ``--reasoning-parser qwen3``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from kvflow.entrypoints.tools import DEFAULT_TOOL_PROMPT

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "integer", "minimum": -12,
                                                           "maximum": 14}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    from server_utils import RemoteServer

    srv = RemoteServer(["--reasoning-parser", "qwen3"])
    yield srv
    log = srv.log()
    code = srv.stop()
    srv.cleanup()
    assert "Traceback" not in log, log
    assert code == 0, log


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def _tokenize(server, body: dict) -> dict:
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_text(server, body: dict) -> str:
    ids = _tokenize(server, body)["tokens"]
    r = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": ids},
                   timeout=60)
    return r.json()["prompt"]


def _check_calls(calls, tools=TOOLS) -> None:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), by_name[c.function.name])


def _assemble(stream) -> tuple[str | None, list[dict], str | None, str | None]:
    """(content, tool calls, finish_reason, reasoning) from a stream, as clients do."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.id:
                    assert tc.index not in calls and tc.type == "function"
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish, reasoning or None


def test_auto_renders_default_tool_prompt_and_parses(server, client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       max_tokens=24, temperature=0)
    msg, choice = r.choices[0].message, r.choices[0]
    _check_calls(msg.tool_calls or [])
    assert choice.finish_reason in (("tool_calls",) if msg.tool_calls else ("stop", "length"))
    # Streamed, the same greedy output parses the same.
    s = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       max_tokens=24, temperature=0, stream=True)
    content, calls, finish, _ = _assemble(s)
    assert content == msg.content and finish == choice.finish_reason
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in msg.tool_calls or []]


def test_tool_choice_none_renders_no_tools(server, client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="none", max_tokens=4, temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                           temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert not r.choices[0].message.tool_calls
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens


def test_tool_result_round_trip(server, client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                       max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The default tool prompt and the Hermes-style history reach the model.
    text = _prompt_text(server, {"messages": history, "tools": TOOLS})
    assert text.count(json.dumps(WEATHER)) == 1 and json.dumps(TIME) in text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>') in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    assert DEFAULT_TOOL_PROMPT.split("{tools}")[0] in text
    assert r.usage.prompt_tokens == len(_tokenize(server, {"messages": history,
                                                           "tools": TOOLS})["tokens"])


@pytest.mark.parametrize("body,param,says", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]},
     "tools.0.function.parameters", "not a valid JSON Schema"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type",
     "function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name", "pattern"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", None),
])
def test_bad_tools_are_400_naming_the_field(server, client, body, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **body)
    err = e.value.body
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    if says:
        assert says in err["message"], err


def test_openapi_describes_tools(server):
    schemas = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["components"][
        "schemas"]
    props = schemas["ChatCompletionRequest"]["properties"]
    assert props["tools"]["anyOf"][0]["items"]["$ref"].endswith("/ChatTool")
    assert props["tools"]["anyOf"][0]["maxItems"] == 128
    choice = json.dumps(props["tool_choice"])
    assert "NamedToolChoice" in choice and "required" in choice
    assert schemas["ChatTool"]["properties"]["type"]["const"] == "function"
    assert "pattern" in schemas["FunctionDefinition"]["properties"]["name"]
    assert "parallel_tool_calls" in props
