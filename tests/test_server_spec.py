"""Speculative decoding behind the OpenAI server: a real ``kvflow serve --speculative-config``
subprocess; the answer matches the plain greedy answer and /metrics counts the drafts."""

from __future__ import annotations

import time

import pytest

from kvflow import LLM, SamplingParams
from server_utils import RemoteServer

TEXT = ("Copy this sentence exactly: the red fox and the brown dog walk along the river "
        "every morning before the sun comes up.")


@pytest.fixture(scope="module")
def spec_server():
    srv = RemoteServer(["--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 4}'])
    yield srv
    srv.stop_clean()


def test_server_speculates_and_reports(spec_server):
    client = spec_server.openai_client()
    msgs = [{"role": "user", "content": TEXT}]
    got = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24,
                                         temperature=0).choices[0].message.content
    plain = LLM("smollm2-135m", device="cpu", max_model_len=512, kv_cache_memory="128MiB")
    want = plain.chat(msgs, SamplingParams(temperature=0, max_tokens=24),
                      use_tqdm=False)[0].outputs[0].text
    assert got == want
    m = spec_server.metrics()
    assert m["kvflow:spec_decode_num_draft_tokens_total"] > 0
    assert 0 < m["kvflow:spec_decode_num_accepted_tokens_total"] \
        <= m["kvflow:spec_decode_num_draft_tokens_total"]
    # Where the time went: every verification step and proposer run is timed.
    assert m["kvflow:spec_decode_num_verify_steps_total"] > 0
    assert m["kvflow:spec_decode_verify_time_seconds_total"] > 0
    assert m["kvflow:spec_decode_num_proposals_total"] \
        >= m["kvflow:spec_decode_num_verify_steps_total"]
    assert m["kvflow:spec_decode_draft_time_seconds_total"] > 0
    deadline = time.monotonic() + 10
    while "spec decode: acceptance" not in spec_server.log() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "spec decode: acceptance" in spec_server.log()
    assert "verify step" in spec_server.log()
