"""Pooling on a tiny random Qwen3 against sentence-transformers and transformers on the
same weights: last-token and mean embeddings (chunked prefill, long and short inputs
batched together, prefix caching on), Matryoshka dimensions, cosine scores, and a
cross-encoder reranker's yes/no scores and ordering."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer.modules import (  # noqa: E402
    Normalize, Pooling, Transformer)

from kvflow import LLM  # noqa: E402
from kvflow.bench.hf_backend import _MODEL_TYPES  # noqa: E402
from kvflow.models.registry import PRESETS  # noqa: E402
from kvflow.pooling.scoring import reranker_prompt  # noqa: E402

WORDS = ["<unk>", "<pad>", "yes", "no"]


def _save(folder, pooling_mode: str | None) -> None:
    """A tiny Qwen3 with a word-level tokenizer; with ``pooling_mode``, also the
    sentence-transformers files that make kvflow pool (modules.json, 1_Pooling)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = dict(PRESETS["tiny-qwen3"])
    config = transformers.AutoConfig.for_model(_MODEL_TYPES[cfg["architectures"][0]], **cfg)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    hf.save_pretrained(folder)
    vocab = {w: i for i, w in enumerate(WORDS + [f"w{i}" for i in range(len(WORDS),
                                                                       cfg["vocab_size"])])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                         pad_token="<pad>").save_pretrained(folder)
    if pooling_mode is not None:
        (folder / "1_Pooling").mkdir()
        Pooling(cfg["hidden_size"], pooling_mode=pooling_mode).save(str(folder / "1_Pooling"))
        modules = [{"idx": 0, "name": "0", "path": "",
                    "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize"}]
        (folder / "modules.json").write_text(json.dumps(modules))


def _reference(folder, pooling_mode: str):
    tr = Transformer(str(folder))
    pool = Pooling(tr.get_embedding_dimension(), pooling_mode=pooling_mode)
    return SentenceTransformer(modules=[tr, pool, Normalize()], device="cpu")


def _texts(seed: int) -> list[str]:
    """Long and short inputs together: 3 to 90 words (tokens), chunked at 16."""
    g = np.random.default_rng(seed)
    return [" ".join(f"w{int(t)}" for t in g.integers(4, 500, n))
            for n in (90, 3, 41, 17, 66, 5)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3-embed")
    _save(folder, "lasttoken")
    return folder


ENGINE = dict(device="cpu", kv_cache_memory="32MiB", max_model_len=256, block_size=4,
              max_num_batched_tokens=16)


def test_embed_matches_sentence_transformers(model_dir):
    """Detected from modules.json (last token, normalized); batched, chunked prefill."""
    llm = LLM(str(model_dir), **ENGINE)
    pooler = llm.engine.config.pooler
    assert (pooler.runner, pooler.pooling_type, pooler.normalize) == ("pooling", "last", True)
    texts = _texts(0)
    ref = _reference(model_dir, "lasttoken").encode(texts, convert_to_numpy=True)
    got = np.array([o.data for o in llm.embed(texts)])  # [6, 64]
    cos = np.sum(got * ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.999, cos
    np.testing.assert_allclose(got, ref, atol=2e-4)
    # Again: prefix-cache hits (same prompts) must not change a last-token embedding.
    again = np.array([o.data for o in llm.embed(texts)])
    assert llm.engine.core.scheduler.kv.num_hit_tokens > 0
    np.testing.assert_allclose(again, got, atol=1e-5)
    # Matryoshka: the first 16 values of the unnormalized state, renormalized.
    short = np.array(llm.embed(texts[:2], dimensions=16)[0].data)
    raw = np.array(llm.embed(texts[:1], normalize=False)[0].data)
    np.testing.assert_allclose(short, raw[:16] / np.linalg.norm(raw[:16]), atol=1e-5)
    # Scores of an embedding model: cosine similarities; the query itself ranks first.
    scores = llm.score(texts[2], texts[:4])
    assert int(np.argmax(scores)) == 2 and abs(scores[2] - 1) < 1e-5
    np.testing.assert_allclose(scores, got[:4] @ got[2], atol=1e-5)
    # A pooling model does not generate.
    with pytest.raises(Exception):
        llm.embed(texts[:1], dimensions=65)
    llm.shutdown()


def test_mean_pooling_across_chunks(model_dir):
    """--pooling-type mean: a running sum per request over its prefill chunks; mean
    requests skip prefix-cache hits (every token's state is needed)."""
    llm = LLM(str(model_dir), pooling_type="mean", **ENGINE)
    texts = _texts(1)
    ref = _reference(model_dir, "mean").encode(texts, convert_to_numpy=True)
    for _ in range(2):  # the second round would hit the prefix cache
        got = np.array([o.data for o in llm.embed(texts)])
        np.testing.assert_allclose(got, ref, atol=2e-4)
    llm.shutdown()


def test_reranker_yes_no_scores(tmp_path):
    """--task score: P(yes) at the last token of the reranker prompt, as transformers
    computes it on the same weights, and the documents ordered by it."""
    _save(tmp_path, None)
    llm = LLM(str(tmp_path), task="score", **ENGINE)
    assert llm.engine.config.pooler.is_reranker
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    query, docs = "w10 w11 w12", [" ".join(f"w{i}" for i in range(k, k + 9))
                                  for k in range(20, 200, 30)]
    want = []
    for d in docs:
        ids = tok(reranker_prompt(query, d), return_tensors="pt").input_ids
        with torch.no_grad():
            logits = hf(ids).logits[0, -1]  # [V]
        want.append(torch.sigmoid(logits[2] - logits[3]).item())  # "yes" minus "no"
    got = llm.score(query, docs)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.argsort(got).tolist() == np.argsort(want).tolist()
    assert max(want) - min(want) > 0.05  # the ordering is not a tie
    llm.shutdown()
