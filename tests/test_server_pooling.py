"""/v1/embeddings, /v1/rerank and /score on the quickstart server (SmolLM2, a chat model
that also embeds: last token, normalized), through the official openai client where it
has the call. The numbers are checked against the offline engine (LLM.embed) on the same
model, which tests/test_pooling.py holds to sentence-transformers."""

from __future__ import annotations

import asyncio
import base64
import math

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

def post(url: str, **kwargs) -> httpx.Response:
    return httpx.post(url, timeout=120, **kwargs)  # the CI machine is slow


TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.",
         "A recipe for pancakes needs flour, eggs and milk."]


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def test_embeddings_float_base64_dimensions(server, client):
    res = client.embeddings.create(model="smollm2-135m", input=TEXTS)
    vecs = np.array([d.embedding for d in res.data])  # [3, 576]
    assert vecs.shape == (3, 576)
    assert [d.index for d in res.data] == [0, 1, 2]
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    assert res.usage.prompt_tokens == res.usage.total_tokens > 3
    # The same text alone (another batch) gives the same vector.
    one = client.embeddings.create(model="smollm2-135m", input=TEXTS[1]).data[0].embedding
    assert float(np.dot(one, vecs[1])) > 0.9999
    # base64: little-endian float32 bytes (the client asks for them by default and
    # decodes them itself; asked for explicitly, it hands the strings back).
    b64 = client.embeddings.create(model="smollm2-135m", input=TEXTS,
                                   encoding_format="base64")
    got = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                    for d in b64.data])
    np.testing.assert_allclose(got, vecs, atol=1e-6)
    # Matryoshka: the first 64 values, renormalized.
    short = client.embeddings.create(model="smollm2-135m", input=TEXTS[0], dimensions=64)
    want = vecs[0][:64] / np.linalg.norm(vecs[0][:64])
    np.testing.assert_allclose(short.data[0].embedding, want, atol=1e-5)
    # Token ids, one list and several.
    ids = post(f"{server.url}/tokenize", json={"prompt": TEXTS[2]}).json()["tokens"]
    tok = client.embeddings.create(model="smollm2-135m", input=[ids, ids[:3]])
    assert float(np.dot(tok.data[0].embedding, vecs[2])) > 0.9999
    assert tok.usage.prompt_tokens == len(ids) + 3


def test_embeddings_bad_input_names_the_field(server):
    url = f"{server.url}/v1/embeddings"
    cases = [({"input": []}, "input"),
             ({"input": ""}, "input"),
             ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
             ({"input": "hi", "dimensions": 100000}, "dimensions"),
             ({"input": "hi", "dimensions": 0}, "dimensions"),
             ({"input": [[1] * 600]}, "input"),  # over max_model_len (512)
             ({"input": [[10**9]]}, "input")]
    for body, field in cases:
        r = post(url, json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert field in (err["param"] or "") or field in err["message"], (body, err)


def test_rerank_and_score_cosine(server, client):
    docs = ["Bananas are yellow fruit.", TEXTS[1], "The stock market fell today."]
    query = TEXTS[1]  # one document is the query itself: cosine 1, ranked first
    r = post(f"{server.url}/v1/rerank", json={
        "model": "smollm2-135m", "query": query, "documents": docs, "top_n": 2}).json()
    assert [x["index"] for x in r["results"]][0] == 1
    assert len(r["results"]) == 2
    assert r["results"][0]["document"]["text"] == TEXTS[1]
    assert abs(r["results"][0]["relevance_score"] - 1.0) < 1e-4
    assert r["results"][0]["relevance_score"] >= r["results"][1]["relevance_score"]
    assert r["usage"]["total_tokens"] > 0
    # The scores are the cosine similarities of the embeddings.
    vecs = [d.embedding for d in client.embeddings.create(model="smollm2-135m",
                                                          input=[query] + docs).data]
    s = post(f"{server.url}/score", json={"text_1": query, "text_2": docs}).json()
    assert [d["index"] for d in s["data"]] == [0, 1, 2]
    for d, v in zip(s["data"], vecs[1:]):
        assert abs(d["score"] - float(np.dot(vecs[0], v))) < 1e-4
    # Documents as {"text"} objects, without returning them.
    r2 = post(f"{server.url}/v1/rerank", json={
        "query": query, "documents": [{"text": d} for d in docs],
        "return_documents": False}).json()
    assert "document" not in r2["results"][0] and len(r2["results"]) == 3
    bad = post(f"{server.url}/score", json={"text_1": ["a", "b"],
                                                 "text_2": ["a", "b", "c"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"
    bad = post(f"{server.url}/v1/rerank", json={"query": "q", "documents": []})
    assert bad.status_code == 400 and "documents" in bad.json()["error"]["param"]


def test_pooling_beside_generation(server):
    """Embeddings and chat requests in flight together on one engine; each gets its
    own kind of answer, and the embeddings equal those of an idle server."""
    aclient = server.openai_client(async_client=True)
    sync = server.openai_client()
    alone = np.array([d.embedding for d in
                      sync.embeddings.create(model="smollm2-135m", input=TEXTS).data])

    async def run():
        chats = [aclient.chat.completions.create(
            model="smollm2-135m", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": f"Count to {i + 3}."}]) for i in range(3)]
        embeds = [aclient.embeddings.create(model="smollm2-135m", input=TEXTS) for _ in range(3)]
        return await asyncio.gather(*chats, *embeds)

    results = asyncio.run(run())
    for chat in results[:3]:
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    for emb in results[3:]:
        got = np.array([d.embedding for d in emb.data])
        assert np.all(np.sum(got * alone, axis=1) > 0.9999)
    assert math.isfinite(float(alone.sum()))
