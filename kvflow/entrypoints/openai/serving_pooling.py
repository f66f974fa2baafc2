"""POST /v1/embeddings, /v1/rerank (also /rerank, /v2/rerank) and /score: pooling
requests on the same engine as generation (see docs/embeddings.md).

Each input becomes one pooling request (prefilled through the scheduler beside
generation, pooled by the worker). Scores come from the model's reranker template and
its yes/no logits when it runs as a cross-encoder (``--task score``), otherwise from the
cosine similarity of normalized embeddings.
"""

# No "from __future__ import annotations": FastAPI must see the route body types (built
# per app) as objects.

import base64
import time

import numpy as np
from fastapi import FastAPI, Request, Response

from kvflow.entrypoints.openai.protocol_pooling import (
    EmbeddingData, EmbeddingResponse, EmbeddingUsage, RerankDocument, RerankResponse,
    RerankResult, RerankUsage, ScoreData, ScoreResponse, pooling_request_models)
from kvflow.entrypoints.openai.serving import (ClientDisconnected, OpenAIServing,
                                               close_all, gather_or_cancel, json_response,
                                               last_output, random_id, run_until_disconnect)
from kvflow.errors import InvalidParameterError
from kvflow.logger import init_logger
from kvflow.outputs import RequestOutput
from kvflow.pooling.params import PoolingParams
from kvflow.pooling.scoring import (cosine, embed_params, pair_up, reranker_prompt,
                                    score_params, yes_probability)

logger = init_logger(__name__)
CLIENT_CLOSED = 499


class PoolingServing(OpenAIServing):
    """Embeddings, rerank and score over one AsyncEngine."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        logger.info("%s", self.pooler.describe())

    @property
    def pooler(self):
        return self.engine.config.pooler

    def check_generates(self) -> None:
        """Chat and completions on a pooling-only model are refused."""
        if self.pooler.runner == "pooling":
            raise InvalidParameterError(
                "this server runs a pooling model (--runner pooling): it answers "
                "/v1/embeddings, /v1/rerank and /score, not text generation",
                param="model")

    async def _pool(self, raw: Request, prompts: list, params: PoolingParams,
                    prefix: str, priority: int) -> list[RequestOutput]:
        request_id = random_id(prefix)
        arrival = time.monotonic()
        gens = [self.engine.generate(f"{request_id}-{i}", p, None, arrival_time=arrival,
                                     priority=priority, pooling=params)
                for i, p in enumerate(prompts)]
        try:
            return await run_until_disconnect(
                raw, gather_or_cancel([last_output(g) for g in gens]), self.deadline())
        finally:
            await close_all(gens)

    # --- /v1/embeddings ------------------------------------------------------------
    async def embeddings(self, req, raw: Request) -> Response:
        self.engine.check_ready()
        self.check_model(req.model)
        if self.pooler.is_reranker:
            raise InvalidParameterError("this model runs as a cross-encoder reranker "
                                        "(--task score); it answers /v1/rerank and /score",
                                        param="model")
        inp = req.input
        if isinstance(inp, str) or (inp and isinstance(inp[0], int)):
            inputs = [inp]
        else:
            inputs = list(inp)
        params = embed_params(self.pooler, req.dimensions, req.normalize)
        outs = await self._pool(raw, inputs, params, "embd", req.priority)
        data = []
        for i, out in enumerate(outs):
            vec = out.pooled or []
            if req.encoding_format == "base64":
                vec = base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()
            data.append(EmbeddingData(index=i, embedding=vec))
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return json_response(EmbeddingResponse(
            data=data, model=self.model_name,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)))

    # --- scores ----------------------------------------------------------------------
    async def _scores(self, raw: Request, pairs: list[tuple[str, str]],
                      instruction: str | None, priority: int) -> tuple[list[float], int]:
        """One score per (query, document) pair, and the prompt tokens it took."""
        if self.pooler.is_reranker:
            params = score_params(self.engine.tokenizer)
            prompts = [reranker_prompt(q, d, instruction) for q, d in pairs]
            outs = await self._pool(raw, prompts, params, "score", priority)
            return ([yes_probability(o.pooled) for o in outs],
                    sum(len(o.prompt_token_ids) for o in outs))
        if instruction is not None:
            raise InvalidParameterError("instruction applies to cross-encoder rerankers "
                                        "only (--task score)", param="instruction")
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        outs = await self._pool(raw, texts, embed_params(self.pooler, normalize=True),
                                "score", priority)
        vecs = {t: o.pooled for t, o in zip(texts, outs)}
        return ([cosine(vecs[q], vecs[d]) for q, d in pairs],
                sum(len(o.prompt_token_ids) for o in outs))

    async def rerank(self, req, raw: Request) -> Response:
        self.engine.check_ready()
        self.check_model(req.model)
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        scores, tokens = await self._scores(raw, [(req.query, d) for d in docs],
                                            req.instruction, req.priority)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=docs[i])
                                if req.return_documents else None) for i in order]
        return json_response(RerankResponse(id=random_id("rerank"), model=self.model_name,
                                            results=results,
                                            usage=RerankUsage(total_tokens=tokens)))

    async def score(self, req, raw: Request) -> Response:
        self.engine.check_ready()
        self.check_model(req.model)
        pairs = pair_up(req.text_1, req.text_2)
        scores, tokens = await self._scores(raw, pairs, req.instruction, req.priority)
        return json_response(ScoreResponse(
            id=random_id("score"), model=self.model_name,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)))


def add_pooling_routes(app: FastAPI, serving: PoolingServing, limits, responses: dict
                       ) -> None:
    """The pooling routes, with ``responses`` (the error statuses) in their OpenAPI."""
    models = pooling_request_models(limits)
    EmbeddingRequest, RerankRequest, ScoreRequest = models.embedding, models.rerank, \
        models.score

    async def guarded(call, body, raw):
        try:
            return await call(body, raw)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=responses)
    async def embeddings(body: EmbeddingRequest, raw: Request):
        return await guarded(serving.embeddings, body, raw)

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        @app.post(path, response_model=RerankResponse, responses=responses)
        async def rerank(body: RerankRequest, raw: Request):
            return await guarded(serving.rerank, body, raw)

    for path in ("/score", "/v1/score"):
        @app.post(path, response_model=ScoreResponse, responses=responses)
        async def score(body: ScoreRequest, raw: Request):
            return await guarded(serving.score, body, raw)
