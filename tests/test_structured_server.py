"""Structured outputs through the server with the official openai client: response_format
(json_object, json_schema, chat.completions.parse), the structured_outputs extension in
chat and completions, and bad constraints -> 400 naming the field. Outputs are checked
with jsonschema and re, never with the grammar engine."""

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "population": {"type": "integer", "minimum": 0},
    "size": {"type": "string", "enum": ["small", "medium", "large"]}},
    "required": ["city", "population", "size"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a city as JSON."}]


class Pet(BaseModel):
    # bounded strings, as an extraction schema would have: greedy decoding of the
    # embedded model can loop inside a string (asked only "Describe a pet.", on an
    # AVX-512 CPU it filled "name" with a repeated kana pair until max_tokens)
    name: str = Field(max_length=20)
    legs: int
    kind: str = Field(max_length=20)


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def test_json_schema_and_json_object(client, server):
    r = client.chat.completions.create(
        model=None or "smollm2-135m", messages=ASK, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {
            "name": "city", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(
        model="smollm2-135m", messages=ASK, max_tokens=60, temperature=0.7, seed=1,
        response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    m = server.metrics()
    assert m.get("kvflow:structured_masked_rows_total", 0) > 0
    assert m.get("kvflow:structured_compiles_total", 0) >= 2


def test_parse_with_pydantic(client):
    r = client.chat.completions.parse(
        model="smollm2-135m", messages=[{"role": "user", "content": "Describe a pet as JSON "
                                                  "with its name, number of legs and kind."}],
        response_format=Pet, max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Pet)
    jsonschema.validate(json.loads(r.choices[0].message.content), Pet.model_json_schema())


def test_structured_outputs_extension(client):
    r = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Yes or no?"}],
        max_tokens=5, temperature=0.9, seed=4, n=2,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert {c.message.content for c in r.choices} <= {"yes", "no"}
    r = client.completions.create(
        model="smollm2-135m", prompt="A product code:", max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-\d{4}"}})
    assert re.fullmatch(r"[A-Z]{3}-\d{4}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(
        model="smollm2-135m", prompt="Numbers:", max_tokens=16, temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= num ("," num)*\n'
                                                      'num ::= [1-9] [0-9]?'}})
    assert re.fullmatch(r"[1-9][0-9]?(,[1-9][0-9]?)*", r.choices[0].text), r.choices[0].text
    r = client.completions.create(
        model="smollm2-135m", prompt="JSON:", max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"json": json.dumps(SCHEMA)}})
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    # Streaming: the deltas add up to a matching output.
    stream = client.completions.create(
        model="smollm2-135m", prompt="A code:", max_tokens=12, temperature=0, stream=True,
        extra_body={"structured_outputs": {"regex": r"[a-z]{4}"}})
    assert re.fullmatch(r"[a-z]{4}", "".join(c.choices[0].text for c in stream if c.choices))


def deep(n: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}}
    return s


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/no"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": deep(60)}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"enum": list(range(3000))}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    start = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"messages": ASK, "max_tokens": 4, **body})
    assert time.perf_counter() - start < 1.0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_openai_client_sees_the_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=4,
                                       extra_body={"structured_outputs": {"regex": "[z-a]"}})


def test_openapi_states_the_fields(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    text = json.dumps(spec)
    assert "structured_outputs" in text and "json_schema" in text
