"""Verification of draft tokens by rejection sampling (pure torch, no host sync).

A request with ``d`` draft tokens x_0..x_{d-1} gets d + 1 rows of target logits: row j
scores the position right after x_{j-1} (row 0: after the last known token). Each row
goes through the request's own sampling processing (min_tokens ban, penalties with the
earlier drafts counted as output, temperature, min-p, top-k, top-p; the same functions as
``Sampler``), giving the target distribution p_j. Then, in order, draft x_j is kept

- greedy rows: while it equals argmax p_j;
- random rows: with probability min(1, p_j(x_j) / q_j(x_j)), q_j the draft's distribution
  (Leviathan et al. 2023, Chen et al. 2023). Proposers without probabilities (n-gram
  lookup) are deterministic: q_j is one-hot on x_j, so x_j is kept with probability
  p_j(x_j).

At the first rejection the request emits a token drawn from the residual
norm(max(0, p_j - q_j)) (for one-hot q: p_j without x_j) and stops; when every draft is
kept it emits a bonus token drawn from p_d. Either way each emitted token is an exact
draw from the target distribution, and a step yields between 1 and d + 1 tokens.

Random numbers: a seeded request draws its d uniforms and then its d + 1 rows of
exponential noise from its own generator, in that order, so its tokens do not depend on
what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.layers.sampler import (SamplingMetadata, apply_top_k_top_p_min_p, greedy_argmax,
                                   process_logits, random_sample)

# Padding of output rows past each request's emitted tokens.
INVALID_TOKEN = -1


@dataclass
class RejectionOutput:
    # [B, max_d + 1] int64: accepted drafts, then the recovered or bonus token, then
    # INVALID_TOKEN. Request i emits num_emitted[i] = num_accepted[i] + 1 tokens.
    token_ids: torch.Tensor
    num_accepted: torch.Tensor  # [B] int64, 0..d_i
    # Per target row [T] int64: the token emitted at that row (INVALID_TOKEN where none);
    # the caller gathers logprobs of emitted tokens with it.
    row_token_ids: torch.Tensor


def _on(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 list on ``device`` without blocking the host: a plain torch.tensor(...,
    device="cuda") copies from pageable memory and waits for all queued GPU work (the
    verification forward), then again for each small kernel before the next such copy."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _offsets(num_draft: list[int]) -> tuple[list[int], list[int]]:
    """Start of each request's target rows and of its draft tokens."""
    row_start, draft_start, r, d = [], [], 0, 0
    for n in num_draft:
        row_start.append(r)
        draft_start.append(d)
        r += n + 1
        d += n
    return row_start, draft_start


def expand_metadata(meta: SamplingMetadata, num_draft: list[int],
                    draft_token_ids: torch.Tensor,
                    min_tokens_left: list[int] | None = None,
                    row_drafts: list[list[tuple[int, ...]]] | None = None) -> SamplingMetadata:
    """Per-request metadata (B rows) -> per-target-row metadata (T = sum(d_i + 1) rows).

    Row j of a request counts drafts x_0..x_{j-1} as generated output for penalties (they
    precede it if accepted, and row j is only used when they are). ``min_tokens_left[i]``:
    how many more tokens request i must generate before it may stop; its banned stop
    tokens apply to its rows j < that (None: to every row of a banned request).
    ``row_drafts[i][j]``: the drafts of request i that precede its row j (a candidate
    tree: the row's ancestors; default: drafts 0..j-1 of a chain); they count as output
    for penalties, and their number is how many tokens precede the row for min_tokens.
    """
    dev = meta.temperature.device
    reps = _on([n + 1 for n in num_draft], dev)
    total = sum(num_draft) + len(num_draft)  # given, so repeat_interleave needs no sync

    def rep(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat_interleave(reps, dim=0, output_size=total)

    out = SamplingMetadata(
        temperature=rep(meta.temperature), all_greedy=meta.all_greedy,
        all_random=meta.all_random, top_k=rep(meta.top_k), top_p=rep(meta.top_p),
        min_p=rep(meta.min_p), generators={},
        presence_penalty=rep(meta.presence_penalty),
        frequency_penalty=rep(meta.frequency_penalty),
        repetition_penalty=rep(meta.repetition_penalty),
        output_counts=rep(meta.output_counts), prompt_mask=rep(meta.prompt_mask),
        max_num_logprobs=meta.max_num_logprobs)
    row_start, draft_start = _offsets(num_draft)
    if meta.logit_bias is not None:  # every target row of a request gets its bias
        rows, ids, values = meta.logit_bias
        first = _on(row_start, dev)[rows]  # [E]
        span = reps[rows]  # [E] rows per request
        base = torch.repeat_interleave(first, span)  # [sum(span)] the entry's first row
        starts = torch.repeat_interleave(torch.cumsum(span, 0) - span, span)
        offset = torch.arange(len(base), device=dev) - starts  # 0..span-1 per entry
        out.logit_bias = (base + offset, ids.repeat_interleave(span),
                          values.repeat_interleave(span))
    if out.output_counts is not None and sum(num_draft):
        rows, toks = [], []
        for i, n in enumerate(num_draft):
            for j in range(1, n + 1):  # row j sees drafts 0..j-1 (a tree: its ancestors)
                for k in (range(j) if row_drafts is None else row_drafts[i][j]):
                    rows.append(row_start[i] + j)
                    toks.append(draft_start[i] + k)
        if rows:
            r = _on(rows, dev)
            t = draft_token_ids[_on(toks, dev)]
            out.output_counts = out.output_counts.clone()
            out.output_counts.index_put_((r, t), torch.ones_like(r, dtype=out.output_counts.dtype),
                                         accumulate=True)
    if meta.banned is not None:
        b_rows, b_ids = meta.banned[0].tolist(), meta.banned[1].tolist()
        rows, ids = [], []
        for req, tok in zip(b_rows, b_ids):
            limit = num_draft[req] + 1 if min_tokens_left is None else min_tokens_left[req]
            for j in range(num_draft[req] + 1):
                before = j if row_drafts is None else len(row_drafts[req][j])
                if before < limit:
                    rows.append(row_start[req] + j)
                    ids.append(tok)
        if rows:
            out.banned = (_on(rows, dev), _on(ids, dev))
    return out


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[T, V] logits -> [T, V] probabilities after the request's sampling processing
    (temperature-0 rows are scaled by 1; callers use the argmax for them)."""
    logits = process_logits(logits, meta)
    temp = torch.where(meta.temperature > 0, meta.temperature,
                       torch.ones_like(meta.temperature))
    return apply_top_k_top_p_min_p(logits / temp[:, None], meta).softmax(dim=-1)


def processed_argmax(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Greedy choice per row after bias, bans and penalties (what ``Sampler`` picks at
    T=0)."""
    return greedy_argmax(process_logits(logits, meta))


class RejectionSampler(torch.nn.Module):
    def forward(self, target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                num_draft: list[int], meta: SamplingMetadata,
                draft_probs: torch.Tensor | None = None,
                generators: dict[int, torch.Generator] | None = None,
                min_tokens_left: list[int] | None = None,
                accept_all: bool = False) -> RejectionOutput:
        """Verify the drafts of B requests.

        target_logits [T, V] float32 (T = sum(d_i + 1), request-major), draft_token_ids
        [D] int64 (D = sum(d_i)), num_draft [B] (host list), meta: per-request metadata
        (B rows), draft_probs [D, V] or None for proposers without probabilities,
        generators: request index -> its generator (default: meta.generators).
        ``accept_all``: BENCH ONLY (``kvflow bench spec-verify``'s cost measurement):
        keep every draft whatever the target says, so a step of d drafts emits d + 1
        tokens. The whole verification still runs; only its verdict is overridden.
        """
        dev = target_logits.device
        b = len(num_draft)
        max_d = max(num_draft, default=0)
        gens = meta.generators if generators is None else generators
        row_start, draft_start = _offsets(num_draft)
        rmeta = expand_metadata(meta, num_draft, draft_token_ids, min_tokens_left)
        num_rows = target_logits.shape[0]
        # Index maps: draft k -> its target row; request i -> its bonus row.
        draft_row = _on([row_start[i] + j for i, n in enumerate(num_draft)
                         for j in range(n)], dev)  # [D]
        bonus_row = _on([row_start[i] + n for i, n in enumerate(num_draft)], dev)  # [B]
        draft_req = _on([i for i, n in enumerate(num_draft) for _ in range(n)], dev)  # [D]

        greedy_tok = processed_argmax(target_logits, rmeta)  # [T]
        accept = greedy_tok[draft_row] == draft_token_ids  # [D]
        row_tok = greedy_tok  # [T]: token emitted if the request stops at this row
        if not meta.all_greedy:
            p = target_probs(target_logits, rmeta)  # [T, V]
            u = torch.rand(len(draft_row), device=dev)  # [D]
            draft_gens, bonus_gens = {}, {}  # a seeded request's draws: its own stream
            for i, g in gens.items():
                d = draft_start[i]
                if num_draft[i]:
                    u[d: d + num_draft[i]].uniform_(generator=g)
                draft_gens.update((j, g) for j in range(d, d + num_draft[i]))
                bonus_gens[i] = g
            p_x = p[draft_row, draft_token_ids]  # [D]
            if draft_probs is None:  # one-hot draft distribution
                q_x = torch.ones_like(p_x)
                residual = p[draft_row].scatter(1, draft_token_ids[:, None], 0.0)
            else:
                q_x = draft_probs.gather(1, draft_token_ids[:, None]).squeeze(1)
                residual = (p[draft_row] - draft_probs).clamp_(min=0.0)
            # p == q leaves no residual; that row is then never rejected, but keep it finite.
            empty = residual.sum(dim=-1, keepdim=True) <= 0
            residual = torch.where(empty, p[draft_row], residual)
            random_accept = u * q_x < p_x
            recovered = random_sample(residual, draft_gens)  # [D]
            bonus = random_sample(p[bonus_row], bonus_gens)  # [B]
            random_tok = torch.empty(num_rows, dtype=torch.int64, device=dev)
            random_tok[draft_row] = recovered
            random_tok[bonus_row] = bonus
            is_random = rmeta.temperature > 0  # [T]
            row_tok = torch.where(is_random, random_tok, greedy_tok)
            accept = torch.where(is_random[draft_row], random_accept, accept)
        if accept_all:
            accept = torch.ones_like(accept)

        # Leading run of accepted drafts per request.
        acc = torch.zeros(b, max_d + 1, dtype=torch.bool, device=dev)  # [B, max_d + 1]
        tok = torch.full((b, max_d + 1), INVALID_TOKEN, dtype=torch.int64, device=dev)
        col = _on([j for n in num_draft for j in range(n)], dev)  # [D]
        acc[draft_req, col] = accept
        tok[draft_req, col] = draft_token_ids
        num_accepted = acc.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
        cols = torch.arange(max_d + 1, device=dev)[None, :]
        stop_row = _on(row_start, dev) + num_accepted
        last = row_tok[stop_row]  # [B]: recovered at the first rejection, else the bonus
        tok = torch.where(cols < num_accepted[:, None], tok, INVALID_TOKEN)
        tok = tok.scatter(1, num_accepted[:, None], last[:, None])
        # Emitted token per target row, for logprobs.
        # Scattered through a spare last row instead of boolean-mask indexing, whose
        # nonzero() would stop the host until the GPU has caught up.
        row_emitted = torch.full((num_rows + 1,), INVALID_TOKEN, dtype=torch.int64,
                                 device=dev)
        rows_of = _on(row_start, dev)[:, None] + cols
        valid = cols <= num_accepted[:, None]
        row_emitted[torch.where(valid, rows_of, num_rows).reshape(-1)] = \
            torch.where(valid, tok, INVALID_TOKEN).reshape(-1)
        row_emitted = row_emitted[:num_rows]
        return RejectionOutput(token_ids=tok, num_accepted=num_accepted,
                               row_token_ids=row_emitted)
