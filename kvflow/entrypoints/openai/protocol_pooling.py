"""Schemas of /v1/embeddings (OpenAI), /v1/rerank (Cohere/Jina, as vLLM serves it) and
/score (vLLM). The request models are built per set of limits, like protocol.py's."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from kvflow.entrypoints.openai.protocol import (INT32_MAX, ShortStr, TokenId, _Request,
                                                _Response)
from kvflow.entrypoints.openai.server_args import RequestLimits


def pooling_request_models(limits: RequestLimits = RequestLimits()) -> SimpleNamespace:
    """``.embedding``, ``.rerank`` and ``.score`` request models; at most
    ``limits.max_prompts`` inputs, documents or texts per request."""
    n = limits.max_prompts
    TokenPrompt = Annotated[list[TokenId], Field(min_length=1)]
    Texts = Annotated[list[StrictStr], Field(min_length=1, max_length=n)]

    class EmbeddingRequest(_Request):
        model: ShortStr | None = None
        input: (StrictStr | Texts | TokenPrompt
                | Annotated[list[TokenPrompt], Field(min_length=1, max_length=n)]) = Field(
            description="a string, a list of strings, a list of token ids, or a list of "
            "token id lists; each at most the model's context length in tokens")
        encoding_format: Literal["float", "base64"] = Field(
            "float", description="float: lists of numbers; base64: little-endian float32 "
            "bytes, base64-encoded")
        dimensions: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = Field(
            None, description="keep the first N values (Matryoshka) and renormalize; at "
            "most the model's hidden size")
        user: ShortStr | None = None
        normalize: StrictBool | None = Field(
            None, description="kvflow/vLLM extension: L2-normalize (default: the model's "
            "pooling config, on unless a sentence-transformers config says otherwise)")
        priority: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] = 0

    class TextDocument(_Request):
        text: StrictStr

    class RerankRequest(_Request):
        model: ShortStr | None = None
        query: StrictStr
        documents: Annotated[list[StrictStr | TextDocument], Field(min_length=1,
                                                                    max_length=n)]
        top_n: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = Field(
            None, description="return only the N most relevant (0 or absent: all)")
        return_documents: StrictBool = True
        instruction: Annotated[StrictStr, Field(max_length=4096)] | None = Field(
            None, description="kvflow extension, cross-encoder rerankers only: the "
            "instruction line of the reranker prompt")
        priority: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] = 0

    class ScoreRequest(_Request):
        model: ShortStr | None = None
        text_1: StrictStr | Texts
        text_2: StrictStr | Texts
        instruction: Annotated[StrictStr, Field(max_length=4096)] | None = None
        priority: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] = 0

    return SimpleNamespace(embedding=EmbeddingRequest, rerank=RerankRequest,
                           score=ScoreRequest)


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(_Response):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class RerankDocument(_Response):
    text: str


class RerankResult(_Response):
    _omit_if_none = ("document",)
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(_Response):
    total_tokens: int


class RerankResponse(_Response):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ScoreData(_Response):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage
