"""Pooling: embeddings, rerank and score on the same engine (see docs/embeddings.md).

``params`` and ``config`` are pure Python (the scheduler and the API read them);
``pooler`` is the worker's torch side; ``scoring`` turns pooled outputs into scores.
"""

from kvflow.pooling.params import PoolingParams

__all__ = ["PoolingParams"]
