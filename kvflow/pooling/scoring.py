"""Scores from pooled outputs (pure Python): which prompts a score or rerank request
becomes, and how their pooled outputs turn into one relevance score per pair.

Two scorers:

- a cross-encoder reranker of the Qwen3-Reranker kind (``--task score``): query and
  document go into one prompt, the model's reranker template; the score is the
  probability of "yes" against "no" at its last position,
  ``sigmoid(logit_yes - logit_no)``;
- any other model: the cosine similarity of the query's and the document's pooled,
  normalized embeddings (bi-encoder). For a chat model this is a rough relevance signal,
  not a trained one (docs/embeddings.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvflow.errors import InvalidParameterError
from kvflow.pooling.config import PoolerConfig
from kvflow.pooling.params import PoolingParams

# Qwen3-Reranker's prompt (its model card): a system line that asks for "yes" or "no",
# the instruction, query and document, and an empty thinking block before the answer.
RERANK_INSTRUCTION = ("Given a web search query, retrieve relevant passages that answer "
                      "the query")
_RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements "
                  "based on the Query and the Instruct provided. Note that the answer can "
                  "only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def reranker_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """The cross-encoder prompt of one (query, document) pair."""
    return (f"{_RERANK_PREFIX}<Instruct>: {instruction or RERANK_INSTRUCTION}\n"
            f"<Query>: {query}\n<Document>: {document}{_RERANK_SUFFIX}")


def yes_no_token_ids(tokenizer) -> list[int]:
    """[id of "no", id of "yes"]: the two logits a reranker is read from."""
    if tokenizer is None:
        raise InvalidParameterError("a reranker needs its tokenizer (for the yes/no "
                                    "tokens)", param="model")
    ids = [tokenizer.token_to_id(t) for t in ("no", "yes")]
    if None in ids:
        raise InvalidParameterError("this model's tokenizer has no single 'yes' and 'no' "
                                    "tokens, so it cannot score as a reranker; run it with "
                                    "--task embed (cosine scores)", param="model")
    return ids


def yes_probability(logits: Sequence[float]) -> float:
    """P(yes) from [logit_no, logit_yes] (softmax over the two)."""
    no, yes = logits
    d = yes - no
    if d >= 0:  # the two branches never overflow exp
        return 1.0 / (1.0 + math.exp(-d))
    e = math.exp(d)
    return e / (1.0 + e)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


def pair_up(text_1: str | list[str], text_2: str | list[str], param: str = "text_1"
            ) -> list[tuple[str, str]]:
    """vLLM's /score pairing: one against one, one against many, or many against as
    many (pairwise)."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if not left or not right:
        raise InvalidParameterError(f"{param} and text_2 must not be empty", param=param)
    if len(left) == 1:
        return [(left[0], r) for r in right]
    if len(left) != len(right):
        raise InvalidParameterError(
            f"{param} has {len(left)} texts and text_2 has {len(right)}: give one "
            "text_1, or as many as text_2", param=param)
    return list(zip(left, right))


def embed_params(pooler: PoolerConfig, dimensions: int | None = None,
                 normalize: bool | None = None) -> PoolingParams:
    """The PoolingParams of an embedding request on this model."""
    return PoolingParams(pooling_type=pooler.pooling_type,
                         normalize=pooler.normalize if normalize is None else normalize,
                         dimensions=dimensions)


def score_params(tokenizer) -> PoolingParams:
    """The PoolingParams of a cross-encoder pair prompt."""
    return PoolingParams(score_token_ids=yes_no_token_ids(tokenizer))
