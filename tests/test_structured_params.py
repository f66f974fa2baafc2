"""StructuredOutputsParams: validation naming the field, and the trip over the IPC codec."""

import pytest

from kvflow.core.sched_output import EngineCoreRequest
from kvflow.engine.messages import AddRequest, MessageCodec, core_codec
from kvflow.errors import InvalidParameterError
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("so", [
    StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"\d{3}"),
    StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(grammar='root ::= "a" | "b"'),
])
def test_travels_over_ipc(so):
    params = SamplingParams(max_tokens=4, structured_outputs=so)
    msg = AddRequest("r", [EngineCoreRequest("r", [1, 2], params, [0], 0.0)])
    got = core_codec().decode(MessageCodec(AddRequest).encode(msg))
    back = got.requests[0].sampling_params.structured_outputs
    assert back == so and back.key() == so.key()


def test_key_ignores_spacing_and_text_form_but_keeps_property_order():
    text = '{"type": "object", "properties": {"a": {"type": "integer"}},  "required": ["a"]}'
    assert StructuredOutputsParams(json=text).key() == StructuredOutputsParams(json=SCHEMA).key()
    swapped = {"properties": SCHEMA["properties"], "type": "object", "required": ["a"]}
    # Property order decides the output's key order, so it is part of the key.
    assert StructuredOutputsParams(json=swapped).key() != StructuredOutputsParams(json=SCHEMA).key()


@pytest.mark.parametrize("kwargs, param", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": 3}, "structured_outputs.json"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"grammar": 5}, "structured_outputs.grammar"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
])
def test_bad_values_name_the_field(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.param == param


def test_clone_keeps_the_constraint():
    so = StructuredOutputsParams(choice=["x", "y"])
    assert SamplingParams(structured_outputs=so).clone(n=1, seed=3).structured_outputs == so
    with pytest.raises(InvalidParameterError):
        SamplingParams(structured_outputs={"regex": "a"})
