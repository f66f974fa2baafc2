"""Token sampling for a batch of requests, with per-request parameters (pure torch).

Order: logit_bias, min_tokens masking, penalties, greedy argmax for temperature-0 rows, then for the
rest temperature, min-p, top-k and top-p filtering and an exact draw: on a GPU a
Gumbel-style one (argmax(p / q), q ~ Exp(1)), on the CPU one uniform per row through the
row's cumulative distribution (a vocabulary of exponential draws cost a millisecond a row
there). Rows with a seed draw from their own generator, so their result does not depend
on what else shares the batch. Nothing here reads back to the host on a GPU: the caller
fetches the sampled ids once.
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


# CPU top-k/top-p: the candidates torch.topk takes, tried in turn (0.12, 0.44 and
# 0.66 ms for a 49k vocabulary on the dev machine) before a full sort (3.9 ms).
PARTIAL_CANDIDATES = (128, 1024, 4096)


def apply_top_k_top_p_min_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Set filtered-out logits to -inf (logits are already divided by temperature)."""
    if meta.min_p is not None:
        probs = logits.softmax(dim=-1)
        top = probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < meta.min_p[:, None] * top, float("-inf"))
    if meta.top_k is None and meta.top_p is None:
        return logits
    if not logits.is_cuda:
        for k in PARTIAL_CANDIDATES:
            partial = _top_k_top_p_partial(logits, meta, k)
            if partial is not None:
                return partial
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


def _top_k_top_p_partial(logits: torch.Tensor, meta: SamplingMetadata, k: int
                         ) -> torch.Tensor | None:
    """The sort path's filter from each row's best ``k`` candidates (``torch.topk``) on
    the CPU, where sorting a 49k-token vocabulary costs ~4 ms a row and topk a tenth of
    that. The kept tokens are the sort path's whenever they lie among the candidates:
    a top-k of at most that many, and a top-p whose mass the candidates reach (the
    normalizer is the whole row's, or the top-k set's, as the sort path's softmax).
    None where a row may keep more (a flat distribution, a large top-k, a tie at the
    candidates' edge): the caller sorts. Reads back to the host (free on the CPU)."""
    v = logits.shape[-1]
    rows = logits.shape[0]
    top_k = meta.top_k if meta.top_k is not None else torch.full((rows,), v)
    top_p = meta.top_p if meta.top_p is not None else torch.ones(rows)
    limited = top_k < v  # rows with a top-k
    if bool(limited.any()):
        k = max(k, int(top_k[limited].max()) + 1)
    if k >= v:
        return None
    vals, idx = logits.topk(k, dim=-1)  # [B, k], best first
    neg = torch.tensor(float("-inf"))
    kth = vals.gather(1, (top_k.clamp(max=k) - 1).clamp(min=0)[:, None])  # [B, 1]
    keep = torch.where(limited[:, None], vals >= kth, True)
    if bool((limited & (vals[:, -1] >= kth[:, 0]) & kth[:, 0].isfinite()).any()):
        return None  # ties with the k-th value may reach past the candidates
    filtered = top_p < 1.0
    if bool(filtered.any()):
        # Normalizer: the top-k set's where a top-k applies (all among the candidates),
        # else the whole row's.
        lse = torch.where(limited, vals.masked_fill(~keep, neg).logsumexp(dim=-1),
                          logits.logsumexp(dim=-1))
        probs = (vals - lse[:, None]).exp().masked_fill(~keep, 0.0)
        mass = probs.cumsum(dim=-1)
        before = mass - probs  # mass of strictly better tokens
        if bool((filtered & ~limited & (mass[:, -1] < top_p)).any()):
            return None  # the kept set may reach past the candidates
        drop = (before >= top_p[:, None]) & filtered[:, None]
        drop[:, 0] = False  # always keep the most likely token
        keep &= ~drop
    # Rows with neither filter keep everything; the others keep only kept candidates.
    everything = ~limited & ~filtered
    out = torch.where(everything[:, None], logits, neg)
    return out.scatter_(1, idx, torch.where(keep | everything[:, None], vals, neg))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """An exact draw from each row of ``probs`` [B, V] (weights: rows need not sum to 1),
    without a host sync. GPU: argmax(p / q) with q ~ Exp(1). CPU: one uniform per row
    through the row's cumulative weights in float64 (a row of exponential draws costs
    ~1 ms there, the cumulative sum a few dozen microseconds). ``generators``: row ->
    the generator that row draws from (several rows may share one: they draw in
    ascending row order)."""
    if probs.is_cuda:
        q = torch.empty_like(probs).exponential_()
        for row, gen in generators.items():
            q[row].exponential_(generator=gen)
        return probs.div(q).argmax(dim=-1)
    u = torch.rand(probs.shape[0], dtype=torch.float64)
    for row in sorted(generators):
        u[row] = torch.rand((), dtype=torch.float64, generator=generators[row])
    cdf = probs.double().cumsum(dim=-1)
    # The first token whose cumulative weight passes u * total: zero-weight tokens never.
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    return pick.clamp_(max=probs.shape[-1] - 1)


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
