"""Constrained decoding under pipeline parallelism (PP 2 on CPU with gloo): the sampling
rank (the last stage's) keeps the matchers and masks the logits; outputs are checked with
jsonschema / re, and equal one rank's for the same requests, with two batches in flight,
with one, and with overlapped steps, through preemption.

The model is the embedded SmolLM2's shape at hidden 64 (random weights, its real
tokenizer): a grammar needs a real vocabulary, the arithmetic is cheap."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvflow import LLM
from kvflow.models.registry import embedded_model_path
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams as SO

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "status": {"enum": ["new", "paid", "sent"]},
    "lines": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 4},
                                         "qty": {"type": "integer", "minimum": 1,
                                                 "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
    "required": ["id", "status", "lines"], "additionalProperties": False}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
         "required": ["color"], "additionalProperties": False}
REGEX = r"[a-f]{3}-\d{2}"
CHOICES = ["yes", "no", "maybe"]

REQUESTS = [
    ("A person as JSON:", SamplingParams(temperature=0, max_tokens=48,
                                         structured_outputs=SO(json=PERSON))),
    ("An order as JSON:", SamplingParams(temperature=0, max_tokens=80,
                                         structured_outputs=SO(json=ORDER))),
    ("Tell me about cats.", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
    ("A color:", SamplingParams(temperature=0, max_tokens=16,
                                structured_outputs=SO(json=COLOR))),
    ("Is it sunny?", SamplingParams(temperature=0, max_tokens=8,
                                    structured_outputs=SO(choice=CHOICES))),
    ("Give a code.", SamplingParams(temperature=0, max_tokens=12,
                                    structured_outputs=SO(regex=REGEX))),
    ("Count to ten.", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
    # Seeded sampling on the last stage, masked: one rank's tokens too.
    ("Another person:", SamplingParams(temperature=1.0, seed=5, max_tokens=48,
                                       structured_outputs=SO(json=PERSON))),
]


def engine(**kw) -> LLM:
    # Few KV blocks: requests are preempted (and rejoin the matchers with their tokens).
    return LLM("smollm2-135m-h64", load_format="dummy", device="cpu",
               tokenizer=embedded_model_path("smollm2-135m"), max_model_len=128,
               num_gpu_blocks_override=8, seed=3, distributed_timeout=60, **kw)


def generate(llm: LLM):
    outs = llm.generate([r[0] for r in REQUESTS], [r[1] for r in REQUESTS], use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outs]


def check_valid(outs) -> None:
    for (_, text, why), (_, params) in zip(outs, REQUESTS):
        so = params.structured_outputs
        if so is None:
            continue
        assert why == "stop", (text, why)  # every schema here is bounded
        if so.json is not None:
            jsonschema.validate(json.loads(text), so.json)
        elif so.regex is not None:
            assert re.fullmatch(so.regex, text), text
        else:
            assert text in so.choice, text


@pytest.fixture(scope="module")
def reference():
    with engine() as one:
        outs = generate(one)
        assert one.engine.core.scheduler.num_preemptions > 0
        assert one.engine.core.executor.runner.structured.stats().num_masked_rows > 0
    check_valid(outs)
    return outs


@pytest.mark.parametrize("kw", [
    {},  # two batches in flight (one per stage)
    {"pipeline_in_flight": 1},
    {"pipeline_in_flight": 1, "async_scheduling": True},  # overlapped steps
], ids=["in-flight-2", "in-flight-1", "in-flight-1-overlap"])
def test_pp2_constrained_equals_one_rank(reference, kw):
    with engine(pipeline_parallel_size=2, **kw) as llm:
        assert llm.engine.core._depth == kw.get("pipeline_in_flight", 2)
        outs = generate(llm)
        assert llm.engine.core.scheduler.num_preemptions > 0
        assert not llm.engine.core.scheduler.has_unfinished_requests()
    check_valid(outs)
    assert [o[0] for o in outs] == [r[0] for r in reference]
