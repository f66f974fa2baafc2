"""What a pooling request asks of the engine (pure Python: the scheduler reads it).

A pooling request is prefilled like any prompt (same scheduler, token budget, chunked
prefill) and stops before sampling: the worker reduces the final hidden states of its
prompt (after the model's final norm) to one vector, or, for a cross-encoder reranker, to
the logits of a few tokens at its last position.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.errors import InvalidParameterError, PromptTooLongError
from kvflow.utils import cdiv

# last: the last prompt token's state (decoder models: it has seen every token);
# mean: the average over all prompt tokens; cls: the first token's state.
POOLING_TYPES = ("last", "mean", "cls")
# The most token logits a score request may read at its last position.
MAX_SCORE_TOKENS = 16


@dataclass
class PoolingParams:
    """How to pool one prompt. Field names follow vLLM's where it has them."""

    pooling_type: str = "last"
    """last, mean or cls (first token)."""
    normalize: bool = True
    """Scale the vector to unit L2 norm (after truncation to ``dimensions``)."""
    dimensions: int | None = None
    """Matryoshka truncation: keep the first ``dimensions`` values (then normalize)."""
    score_token_ids: list[int] | None = None
    """Cross-encoder scoring: instead of a hidden state, return the logits of these token
    ids at the last prompt position (e.g. a reranker's "no" and "yes"); the pooling type,
    normalization and dimensions do not apply."""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidParameterError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                f"{self.pooling_type!r}", param="pooling_type")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or
                                            not isinstance(self.dimensions, int) or
                                            self.dimensions < 1):
            raise InvalidParameterError(f"dimensions must be a positive integer, got "
                                        f"{self.dimensions!r}", param="dimensions")
        if self.score_token_ids is not None:
            ids = self.score_token_ids
            if not ids or len(ids) > MAX_SCORE_TOKENS:
                raise InvalidParameterError(
                    f"score_token_ids must hold 1 to {MAX_SCORE_TOKENS} token ids",
                    param="score_token_ids")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise InvalidParameterError("score_token_ids must be token ids",
                                            param="score_token_ids")

    @property
    def needs_all_tokens(self) -> bool:
        """Whether every prompt token's hidden state is needed, so a prefix-cache hit
        (tokens whose K/V is reused, their hidden states never computed) cannot be used.
        Last-token pooling and scoring read only the last position, which is always
        computed."""
        return self.score_token_ids is None and self.pooling_type != "last"

    def check_for_model(self, hidden_size: int, vocab_size: int) -> None:
        """Checks that need the model (both in the API process and in the engine core)."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise InvalidParameterError(
                f"dimensions must be at most the model's embedding size ({hidden_size}), "
                f"got {self.dimensions}", param="dimensions")
        for t in self.score_token_ids or ():
            if t >= vocab_size:
                raise InvalidParameterError(
                    f"score_token_ids must be in [0, {vocab_size}), got {t}",
                    param="score_token_ids")


def check_pooling_fits(num_prompt_tokens: int, max_model_len: int, block_size: int,
                       num_blocks: int) -> None:
    """Refuse a pooling prompt that can never run. Unlike generation it may fill the whole
    context (nothing is generated after it)."""
    if num_prompt_tokens == 0:
        raise InvalidParameterError("the input is empty; give at least one token",
                                    param="input")
    if num_prompt_tokens > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens, but the input "
            f"has {num_prompt_tokens} tokens; shorten it", param="input")
    if cdiv(num_prompt_tokens, block_size) > num_blocks:
        raise PromptTooLongError(
            f"the input has {num_prompt_tokens} tokens but the whole KV cache holds "
            f"{num_blocks * block_size}; shorten it or give the cache more memory",
            param="input")
