"""The OpenAI Responses API (/v1/responses) through the official ``openai`` client,
against the shared ``kvflow serve`` subprocess (the session ``server`` fixture): plain
and streamed (event sequence, same text as the non-streamed greedy answer),
instructions, max_output_tokens -> incomplete, previous_response_id and the store,
refusals in OpenAI's error shape. The chat route on the same messages is the reference."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def chat_text(client, messages, max_tokens=10) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_tokens=max_tokens)
    return r.choices[0].message.content


def test_plain_matches_chat_and_usage(server, client):
    r = client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                max_output_tokens=10)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.model == MODEL and r.output[0].type == "message"
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.output_text == chat_text(client, [{"role": "user", "content": QUESTION}])
    assert r.output_text  # the model says something
    tok = httpx.post(f"{server.url}/tokenize", json={
        "messages": [{"role": "user", "content": QUESTION}]}).json()
    assert r.usage.input_tokens == tok["count"]
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status in ("completed", "incomplete")


def test_instructions_and_message_items(client):
    items = [{"role": "developer", "content": "Answer in one word."},
             {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    r = client.responses.create(model=MODEL, input=items, instructions="You are terse.",
                                temperature=0, max_output_tokens=8)
    expected = chat_text(client, [{"role": "system", "content": "You are terse."},
                                  {"role": "system", "content": "Answer in one word."},
                                  {"role": "user", "content": QUESTION}], max_tokens=8)
    assert r.output_text == expected and r.instructions == "You are terse."


def test_max_output_tokens_incomplete(client):
    r = client.responses.create(model=MODEL, input="Write a long story about a dragon.",
                                temperature=0, max_output_tokens=5)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"


def test_stream_events_equal_plain(client):
    kwargs = dict(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=10)
    plain = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    n_delta = kinds.count("response.output_text.delta")
    assert n_delta >= 1
    assert kinds == (["response.created", "response.in_progress",
                      "response.output_item.added", "response.content_part.added"]
                     + ["response.output_text.delta"] * n_delta
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done",
                        "response.incomplete" if plain.status == "incomplete"
                        else "response.completed"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == plain.output_text and final.usage == plain.usage
    # The helper that accumulates the events agrees.
    with client.responses.stream(**kwargs) as stream:
        assert stream.get_final_response().output_text == plain.output_text


def test_previous_response_id_continues_and_store(server, client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0,
                                    max_output_tokens=6)
    follow = client.responses.create(model=MODEL, input="What is my name?", temperature=0,
                                     max_output_tokens=6, previous_response_id=first.id)
    expected = chat_text(client, [{"role": "user", "content": "My name is Ada."},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "What is my name?"}], 6)
    assert follow.output_text == expected and follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "reasoning_effort": "high"}, "reasoning_effort"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3.0}, "temperature"),
])
def test_refusals_name_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CHAT_TOOLS = [{"type": "function", "function": WEATHER}]
ASK = "What is the weather in Paris? Use the get_weather tool."


def _chat_tool_answer(client, messages, max_tokens=32, **extra):
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS,
                                       temperature=0, max_tokens=max_tokens, **extra)
    m = r.choices[0].message
    return m.content, [(c.id, c.function.name, c.function.arguments)
                       for c in m.tool_calls or []], r


def test_function_tools_match_the_chat_route(client):
    # A named tool_choice: a call whatever this small model would say.
    content, calls, _ = _chat_tool_answer(
        client, [{"role": "user", "content": ASK}], max_tokens=12,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert calls and content is None
    kwargs = dict(model=MODEL, input=ASK, tools=[{"type": "function", **WEATHER}],
                  tool_choice={"type": "function", "name": "get_weather"},
                  temperature=0, max_output_tokens=12)
    r = client.responses.create(**kwargs)
    got = [(o.name, o.arguments) for o in r.output if o.type == "function_call"]
    assert got == [(name, args) for _, name, args in calls]
    assert [o.type for o in r.output] == ["function_call"]
    assert r.output[0].call_id.startswith("call_")
    assert r.tool_choice.name == "get_weather"
    # Streamed: the item opened and closed in order, the same output in the end.
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    n = kinds.count("response.function_call_arguments.delta")
    assert kinds == (["response.created", "response.in_progress",
                      "response.output_item.added"]
                     + ["response.function_call_arguments.delta"] * n
                     + ["response.function_call_arguments.done", "response.output_item.done",
                        events[-1].type])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [(o.name, o.arguments) for o in final.output] == got
    assert events[-3].arguments == got[0][1] == "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta")


def test_function_call_output_round_trip(server, client):
    items = [{"role": "user", "content": ASK},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1",
              "output": "18 degrees, sunny"}]
    r = client.responses.create(model=MODEL, input=items, temperature=0,
                                tools=[{"type": "function", **WEATHER}], max_output_tokens=4)
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    content, calls, ref = _chat_tool_answer(client, history, max_tokens=4)
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    assert r.output_text == (content or "")


def test_bad_function_tool_schema_is_400(server):
    r = httpx.post(f"{server.url}/v1/responses", json={
        "model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f",
                                                 "parameters": {"type": "nonsense"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.parameters"
    r = httpx.post(f"{server.url}/v1/responses", json={
        "model": MODEL, "input": "hi", "tools": [{"type": "function", **WEATHER}],
        "tool_choice": {"type": "function", "name": "nope"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"], "additionalProperties": False}


def test_text_format_json_schema_matches_chat_response_format(client):
    import json

    import jsonschema

    messages = [{"role": "user", "content": "Describe the weather in Paris as JSON."}]
    ref = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=40,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY}})
    r = client.responses.create(model=MODEL, input=messages, temperature=0,
                                max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "city",
                                                 "schema": CITY}})
    assert r.output_text == ref.choices[0].message.content
    assert r.text.format.type == "json_schema"
    if r.status == "completed":
        jsonschema.validate(json.loads(r.output_text), CITY)
