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
    srv.stop_clean()


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


# --- constrained (needs the grammar engine: structured_outputs) ------------------------

def _as_pairs(calls) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]


@pytest.mark.parametrize("tool_choice,parallel", [
    ("required", None), ("required", False),
    ({"type": "function", "function": {"name": "get_time"}}, None)])
def test_enforced_tool_choice_always_validates(client, tool_choice, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
              max_tokens=48, **extra)
    r = client.chat.completions.create(**kw, n=2, temperature=1.0, seed=7)
    for choice in r.choices:
        calls = choice.message.tool_calls
        assert calls and choice.message.content is None, choice
        if choice.finish_reason == "length":  # "required" may go on calling: the last
            assert tool_choice == "required" and parallel is None  # call was cut short
            calls = calls[:-1]
        else:
            assert choice.finish_reason == "tool_calls", choice
        _check_calls(calls)
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in calls] == ["get_time"]
        if parallel is False:
            assert len(calls) == 1
    if parallel is None and tool_choice == "required":
        return
    # Streamed, the same greedy output assembles to the same calls.
    whole = client.chat.completions.create(**kw, temperature=0).choices[0]
    assert whole.finish_reason == "tool_calls"
    content, calls, finish, _ = _assemble(client.chat.completions.create(
        **kw, temperature=0, stream=True))
    assert (content, calls, finish) == (None, _as_pairs(whole.message.tool_calls),
                                        "tool_calls")


CALL_TEXT = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')


def _regex(text: str) -> str:
    return "".join("\\" + ch if ch in "\\.^$|?*+()[]{}" else ch for ch in text)


def test_auto_parses_model_text_end_to_end(client):
    # The model is made to write a Hermes call (a regex constraint), so the auto parser
    # runs on real engine output, whole and streamed.
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": _regex(CALL_TEXT)}})
    r = client.chat.completions.create(**kw).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content == "Checking."
    assert _as_pairs(r.message.tool_calls) == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}]
    _check_calls(r.message.tool_calls)
    content, calls, finish, _ = _assemble(client.chat.completions.create(**kw, stream=True))
    assert (content, calls, finish) == ("Checking.", _as_pairs(r.message.tool_calls),
                                        "tool_calls")


def test_reasoning_content(client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=60, temperature=0, extra_body={
        "structured_outputs": {"regex": r"<think>\nIt is [a-z]{1,10}\.\n</think>\n\nSunny\."}})
    r = client.chat.completions.create(**kw).choices[0]
    reasoning = r.message.model_extra["reasoning_content"]
    assert reasoning.startswith("\nIt is ") and r.message.content == "Sunny."
    content, _, _, streamed = _assemble(client.chat.completions.create(**kw, stream=True))
    assert (streamed, content) == (reasoning, "Sunny.")
