"""Top-k routing of tokens to experts: scores, the k best, optional renormalization."""

from __future__ import annotations

import torch

SCORING_FUNCS = ("softmax", "sigmoid")


def route(router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]).

    softmax: probabilities over all experts, the k largest (Mixtral, Qwen-MoE);
    sigmoid: an independent score per expert (DeepSeek-V3 style). ``renormalize``
    rescales the k chosen weights to sum to 1 (Mixtral always; Qwen ``norm_topk_prob``).
    Scores are float32 whatever the model dtype, as transformers computes them."""
    if scoring == "softmax":
        scores = torch.softmax(router_logits.float(), dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(router_logits.float())
    else:  # ModelArchConfig refuses this at load; a direct caller gets the same words
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring!r}")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
