"""The OpenAI-compatible server through the official ``openai`` client: completions and
chat, streaming and not, n > 1, stop strings, logprobs, usage, tokenize/detokenize,
metrics. One real ``kvflow serve`` subprocess (the session ``server`` fixture)."""

from __future__ import annotations

import math

import httpx
import pytest

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def tokenize(server, text: str, add_special_tokens: bool = True) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text,
                                                   "add_special_tokens": add_special_tokens})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == 512
    assert client.models.retrieve(MODEL).id == MODEL
    # Whether outputs depend on the batch (batch-invariant where the C++ CPU step runs
    # on int8 activations: tests/test_determinism.py), and every response carries the
    # fingerprint of what can change them.
    card = models.data[0].model_dump()
    assert card["determinism"] in ("batch-invariant", "batch-variant") and \
        card["determinism_why"], card
    fp = card["system_fingerprint"]
    assert fp.startswith("fp_") and len(fp) == 15
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert r.system_fingerprint == fp
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                            stream=True))
    assert {c.system_fingerprint for c in chunks} == {fp}
    assert client.completions.create(model=MODEL, prompt=PROMPT,
                                     max_tokens=1).system_fingerprint == fp


def test_completion_greedy_usage_and_token_ids(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == len(tokenize(server, PROMPT))
    assert r.usage.completion_tokens == 8 == len(choice.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": choice.token_ids}).json()
    assert detok["prompt"] == choice.text and "Paris" in choice.text


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                     temperature=0).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    content = chunks[:-1]
    assert "".join(c.choices[0].text for c in content) == full
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])


def test_completion_prompt_forms_and_echo(server, client):
    ids = tokenize(server, PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                        temperature=0).choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5,
                                       temperature=0).choices[0].text
    assert by_ids == by_text
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "1, 2, 3,"], max_tokens=5,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text
    id_batch = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=5,
                                         temperature=0)
    assert [c.text for c in id_batch.choices] == [by_text, by_text]
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                     echo=True)
    assert echo.choices[0].text == PROMPT + by_text
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                         temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + by_text


def test_chat_non_stream_and_stream(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10,
                                       temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    same = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                          temperature=0)
    assert same.choices[0].message.content == msg.content
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"


def test_n_samples_and_seed(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3,
              seed=1234)
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    assert len({c.text for c in r.choices}) > 1  # independent samples
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2,
                                          temperature=1.0, seed=7)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    finished = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6,
                                                n=2, temperature=1.0, seed=7, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    # Each choice ends once, as the same seeded request did without streaming (EOS may
    # come within 6 tokens: which depends on the seed's draws).
    assert finished == {c.index: c.finish_reason for c in chat.choices}
    assert set(finished.values()) <= {"length", "stop"}


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=16,
                                     temperature=0).choices[0].text
    stop = full.strip()[3:5]  # a string that occurs in the greedy output
    cut = full[:full.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,",
                                      max_tokens=16, temperature=0, stop=[stop, "@@@"],
                                      stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks)
            last = chunks[-1].choices[0]
        else:
            text, last = r.choices[0].text, r.choices[0]
        assert text == cut
        assert last.finish_reason == "stop" and last.stop_reason == stop


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert math.isclose(top[tok], logprob, abs_tol=1e-4)
        assert math.isclose(max(top.values()), logprob, abs_tol=1e-4)  # greedy: the top one
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                     logprobs=1, echo=True)
    elp = echo.choices[0].logprobs
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v is not None for v in elp.token_logprobs[1:])
    assert "".join(elp.tokens) == echo.choices[0].text


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.top_logprobs[0].token == e.token  # greedy
        assert bytes(e.bytes).decode() == e.token
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                           temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_sampling_parameters_are_accepted(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.8, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, seed=3, user="test-user",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2,
                    "ignore_eos": True, "min_tokens": 2})
    assert r.usage.completion_tokens == 6
    c = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0.7, top_p=0.95,
        presence_penalty=-0.5, frequency_penalty=0.2, user="u",
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True})
    assert c.usage.completion_tokens == 4


def test_logit_bias_bans_and_forces_tokens(server, client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"return_token_ids": True}).choices[0]
    paris = tokenize(server, " Paris", add_special_tokens=False)
    assert plain.token_ids[0] == paris[0]
    # -100 bans the greedy first token (OpenAI's keys are token ids as strings).
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(paris[0]): -100},
                                       extra_body={"return_token_ids": True}).choices[0]
    assert banned.token_ids[0] != paris[0] and "Paris" not in banned.text[:6]
    forced = tokenize(server, " blue", add_special_tokens=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0.7,
                                       logit_bias={str(forced): 100})
    assert r.choices[0].message.content == " blue" * 3 or \
        r.choices[0].message.content.replace(" ", "") == "blue" * 3


def test_tokenize_detokenize(server):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert httpx.post(f"{server.url}/detokenize",
                      json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > r["count"]


def test_metrics_exposition(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    m = server.metrics()
    for name in ("time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_hit_rate", "prompt_tokens_total", "generation_tokens_total",
                 "num_preemptions_total", "request_success_total{length}"):
        assert f"kvflow:{name}" in m, name
    assert m["kvflow:generation_tokens_total"] >= 3
    assert m["kvflow:e2e_request_latency_seconds_count"] >= 1
    assert m["kvflow:kv_cache_total_blocks"] > 0


def test_kvflow_chat_with_a_running_server(server, client):
    import subprocess
    import sys

    want = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8,
        temperature=0).choices[0].message.content
    proc = subprocess.run([sys.executable, "-m", "kvflow.cli", "chat", "--url", server.url,
                           "--max-tokens", "8", "--temperature", "0"],
                          input="Name a fruit.\n\n", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert want.strip() and want.strip() in proc.stdout
    assert f"kvflow chat with {MODEL}" in proc.stderr


def _sse_payloads(server, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return lines[:-1]


def test_stream_chunks_have_the_protocol_shape(server):
    """Stream chunks are built as plain dicts for speed: hold them to the pydantic models."""
    import json

    from kvflow.entrypoints.openai.protocol import ChatCompletionChunk, CompletionChunk

    cases = [
        ("/v1/completions", CompletionChunk,
         {"prompt": PROMPT, "max_tokens": 4, "n": 2, "logprobs": 2, "echo": True,
          "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", ChatCompletionChunk,
         {"messages": CHAT, "max_tokens": 4, "n": 2, "logprobs": True, "top_logprobs": 2,
          "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", ChatCompletionChunk,
         {"messages": CHAT, "max_tokens": 3, "stream": True}),
    ]
    for path, model, body in cases:
        payloads = _sse_payloads(server, path, body)
        assert len(payloads) >= 4
        for p in payloads:
            assert json.loads(model.model_validate_json(p).model_dump_json()) == json.loads(p)
