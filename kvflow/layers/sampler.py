"""Token sampling for a batch of requests, with per-request parameters (pure torch).

Order: logit_bias, min_tokens masking, penalties, greedy argmax for temperature-0 rows, then for the
rest temperature, min-p, top-k and top-p filtering and a Gumbel-style draw
(argmax(p / q), q ~ Exp(1)). Rows with a seed draw q from their own generator, so their
result does not depend on what else shares the batch. Nothing here reads back to the
host: the caller fetches the sampled ids once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters as tensors on the logits' device. Optional parts are
    None when no row in the batch uses them, so the common case skips their work."""

    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size = off
    top_p: torch.Tensor | None  # [B] float32, 1 = off
    min_p: torch.Tensor | None  # [B] float32, 0 = off
    generators: dict[int, torch.Generator]  # row -> its request's generator (seeded rows)
    # Penalties (None when no row has any).
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None  # [B]
    repetition_penalty: torch.Tensor | None = None  # [B]
    output_counts: torch.Tensor | None = None  # [B, V] int: times each token was generated
    prompt_mask: torch.Tensor | None = None  # [B, V] bool: token occurs in the prompt
    # Rows still under min_tokens: (row indices [M], token ids [M]) to forbid.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # Requests' logit_bias entries: (row indices [E], token ids [E], float32 values [E]).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    max_num_logprobs: int | None = None  # top-N logprobs to return (None: none)


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None = None  # [B, 1 + N]: sampled, then top-N
    logprobs: torch.Tensor | None = None  # [B, 1 + N] float32
    sampled_ranks: torch.Tensor | None = None  # [B] int64, 1 = most likely


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """What every sampling path does before temperature: logit_bias, min_tokens bans,
    then penalties (the plain sampler, and the target side of speculative verification,
    so both pick from the same distribution). Returns ``logits`` itself when no row uses
    any of them."""
    if meta.logit_bias is not None:
        rows, ids, values = meta.logit_bias
        logits = logits.index_put((rows, ids), values.to(logits.dtype), accumulate=True)
    if meta.banned is not None:
        logits = logits.index_put(meta.banned, torch.tensor(float("-inf"),
                                                            device=logits.device))
    if meta.repetition_penalty is not None or meta.frequency_penalty is not None:
        logits = apply_penalties(logits, meta)
    return logits


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.repetition_penalty is not None:
        seen = meta.prompt_mask | (meta.output_counts > 0)
        rp = meta.repetition_penalty[:, None]
        scaled = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, scaled, logits)
    if meta.frequency_penalty is not None:
        counts = meta.output_counts.to(logits.dtype)
        logits = logits - meta.frequency_penalty[:, None] * counts
        logits = logits - meta.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Set filtered-out logits to -inf (logits are already divided by temperature)."""
    if meta.min_p is not None:
        probs = logits.softmax(dim=-1)
        top = probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < meta.min_p[:, None] * top, float("-inf"))
    if meta.top_k is None and meta.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if meta.top_k is not None:
        kth = sorted_logits.gather(1, (meta.top_k - 1).clamp(min=0)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if meta.top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop = before >= meta.top_p[:, None]
        drop[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(p / q) with q ~ Exp(1): an exact draw from p without a host sync."""
    q = torch.empty_like(probs).exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return probs.div(q).argmax(dim=-1)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [B, V] logits: torch on the CPU; on CUDA
    ``kvflow.kernels.argmax.greedy_argmax`` (the row split over many programs where the
    vocabulary is large; torch reduces a row with one block). The kernel module is imported
    only there, so this module stays pure torch off the GPU (architecture rule 7)."""
    if not logits.is_cuda:
        return logits.argmax(dim=-1)
    from kvflow.kernels.argmax import greedy_argmax as kernel_argmax

    return kernel_argmax(logits)


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits [B, V] float32 -> sampled ids [B] (and logprobs when asked)."""
        raw = logits
        logits = process_logits(logits, meta)
        greedy = greedy_argmax(logits)
        if meta.all_greedy:
            sampled = greedy
        else:
            temp = torch.where(meta.temperature > 0, meta.temperature,
                               torch.ones_like(meta.temperature))
            scaled = apply_top_k_top_p_min_p(logits / temp[:, None], meta)
            drawn = random_sample(scaled.softmax(dim=-1), meta.generators)
            sampled = drawn if meta.all_random else torch.where(meta.temperature > 0,
                                                                drawn, greedy)
        out = SamplerOutput(sampled=sampled)
        if meta.max_num_logprobs is not None:
            out.logprob_token_ids, out.logprobs, out.sampled_ranks = gather_logprobs(
                raw.log_softmax(dim=-1), sampled, meta.max_num_logprobs)
        return out


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, n: int):
    """Logprobs of ``token_ids`` [B] and the top-n of each row, plus each token's rank.

    Returns ids [B, 1 + n], logprobs [B, 1 + n], ranks [B].
    """
    chosen = logprobs.gather(1, token_ids[:, None])  # [B, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if n > 0:
        top_lp, top_ids = logprobs.topk(n, dim=-1)
        ids = torch.cat((token_ids[:, None], top_ids), dim=1)
        lps = torch.cat((chosen, top_lp), dim=1)
    else:
        ids, lps = token_ids[:, None], chosen
    return ids, lps, ranks
