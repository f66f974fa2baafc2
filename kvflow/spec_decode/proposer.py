"""The one interface every draft proposer implements."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvflow.config import SpeculativeConfig


class Proposer(Protocol):
    """Proposes up to ``k`` draft tokens to follow each request's known tokens.

    ``token_ids[i]`` holds request i's prompt and output tokens so far (a host array);
    ``max_drafts[i]`` caps its proposal (0: propose nothing). Returns one list per request,
    possibly empty. Proposers without draft probabilities are verified with the one-hot
    rule (layers/rejection_sampler.py).
    """

    num_speculative_tokens: int

    def propose(self, token_ids: list[np.ndarray], max_drafts: list[int]) -> list[list[int]]:
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        from kvflow.spec_decode.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                             config.prompt_lookup_max)
    raise ValueError(f"unknown speculative method {config.method!r}")  # config validated it
