"""The one interface every draft proposer implements."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from kvflow.sampling_params import SamplingParams


class Proposer:
    """Proposes up to ``k`` draft tokens to follow each request's known tokens.

    ``propose``: ``token_ids[i]`` holds request i's prompt and output tokens so far (a
    host array); ``max_drafts[i]`` caps its proposal (0: propose nothing); ``req_ids`` and
    ``params`` name the requests and their sampling parameters (for proposers with state
    per request). Returns one list per request, possibly empty.

    Proposers without draft probabilities (``draft_probs`` returns None) are verified
    with the one-hot rule (layers/rejection_sampler.py); those that sample their drafts
    return the distribution each was drawn from. Proposers with a KV cache of their own
    get it in ``init_cache`` and free a request's part in ``release``.
    """

    num_speculative_tokens: int
    # The proposer drafts from the target's hidden state at each request's last token
    # (Medusa): the runner keeps the sample rows' hidden states for it.
    wants_hidden: bool = False
    # A static candidate tree (spec_decode/tree.py): proposals are its nodes in order,
    # verified with tree attention. None: proposals are a chain.
    tree = None

    def propose(self, token_ids: list[np.ndarray], max_drafts: list[int],
                req_ids: list[str] | None = None,
                params: list["SamplingParams"] | None = None) -> list[list[int]]:
        raise NotImplementedError

    def draft_probs(self, req_id: str, drafts: list[int]) -> "torch.Tensor | None":
        """q [len(drafts), V] the request's scheduled drafts were drawn from, or None."""
        return None

    def init_cache(self, num_blocks: int) -> None:
        """The target's KV cache has ``num_blocks`` blocks (allocate one's own now)."""

    def release(self, req_id: str) -> None:
        """The request left the batch (finished or preempted)."""

    def warmup(self, target_step) -> None:
        """The target has warmed up; ``target_step`` is what runs its steps (the model
        runner's ``graphs``: on CPU its C++ or compiled step, None when it decodes
        eagerly). A proposer running a model of its own may build the same for it."""
