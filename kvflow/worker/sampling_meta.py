"""Per-step SamplingMetadata from the persistent batch's sampling parameters."""

from __future__ import annotations

import numpy as np
import torch

from kvflow.layers.sampler import SamplingMetadata
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.step_inputs import PLACEHOLDER, PendingTokens
from kvflow.worker.transfer import to_device


def build_sampling_metadata(batch: InputBatch, rows: np.ndarray, req_ids: list[str],
                            generators: list[torch.Generator | None], pending: PendingTokens,
                            vocab_size: int, device: torch.device) -> SamplingMetadata:
    """Sampling tensors for sample rows ``rows`` (batch rows, one per sampled position;
    ``req_ids`` and ``generators`` align with them).

    Values a client chose are clamped to what a tensor and the vocabulary can hold: a
    ``top_k`` at or above the vocabulary means no limit (as in vLLM), and no int here
    overflows int64.
    """
    b, dev, vocab = batch, device, vocab_size
    params = [b.params[r] for r in rows]
    greedy = [p.greedy for p in params]
    f32 = torch.float32
    meta = SamplingMetadata(
        temperature=to_device([0.0 if g else p.temperature for p, g in zip(params, greedy)],
                              dev, f32),
        all_greedy=all(greedy), all_random=not any(greedy), top_k=None, top_p=None, min_p=None,
        generators={j: gen for j, gen in enumerate(generators) if gen is not None})
    if any(0 < p.top_k < vocab for p in params):
        meta.top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                               dev, torch.int64)
    if any(p.top_p < 1.0 for p in params):
        meta.top_p = to_device([p.top_p for p in params], dev, f32)
    if any(p.min_p > 0.0 for p in params):
        meta.min_p = to_device([p.min_p for p in params], dev, f32)
    use_freq = any(p.presence_penalty or p.frequency_penalty for p in params)
    use_rep = any(p.repetition_penalty != 1.0 for p in params)
    if use_freq or use_rep:
        meta.output_counts = _output_counts(b, rows, req_ids, pending, vocab, dev)
    if use_freq:
        meta.presence_penalty = to_device([p.presence_penalty for p in params], dev, f32)
        meta.frequency_penalty = to_device([p.frequency_penalty for p in params], dev, f32)
    if use_rep:
        meta.repetition_penalty = to_device([p.repetition_penalty for p in params], dev, f32)
        meta.prompt_mask = token_counts([b.prompt_token_ids(r) for r in rows], vocab, dev) > 0
    banned_rows, banned_ids = [], []
    for j, (p, r) in enumerate(zip(params, rows)):
        # Under min_tokens: the token sampled now may not end the request.
        if b.num_tokens[r] - b.num_prompt_tokens[r] < p.min_tokens:
            stop = {t for t in p.all_stop_token_ids if 0 <= t < vocab}
            if not p.ignore_eos:  # the same EOS ids the scheduler stops on
                stop.update(t for t in b.eos_token_ids[r] if 0 <= t < vocab)
            banned_rows += [j] * len(stop)
            banned_ids += sorted(stop)
    if banned_rows:
        meta.banned = (to_device(banned_rows, dev, torch.int64),
                       to_device(banned_ids, dev, torch.int64))
    asked = [p.logprobs for p in params if p.logprobs is not None]
    meta.max_num_logprobs = min(max(asked), vocab) if asked else None
    return meta


def _output_counts(b: InputBatch, rows: np.ndarray, req_ids: list[str],
                   pending: PendingTokens, vocab: int, dev: torch.device) -> torch.Tensor:
    """Generated-token counts per row, including tokens still on the device."""
    outs = [b.output_token_ids(r) for r in rows]
    counts = token_counts([o[o != PLACEHOLDER] for o in outs], vocab, dev)
    pending_rows, src = [], []
    for j, (o, rid) in enumerate(zip(outs, req_ids)):
        for pos in np.nonzero(o == PLACEHOLDER)[0]:
            pending_rows.append(j)
            src.append(pending.source(rid, int(b.num_prompt_tokens[rows[j]] + pos)))
    if pending_rows:
        idx = (to_device(pending_rows, dev, torch.int64),
               pending.token_ids[to_device(src, dev, torch.int64)])
        counts.index_put_(idx, torch.ones(len(src), dtype=counts.dtype, device=dev),
                          accumulate=True)
    return counts


def token_counts(seqs: list[np.ndarray], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] int32 counts of each token id in each sequence."""
    counts = torch.zeros(len(seqs), vocab, dtype=torch.int32, device=device)
    lens = [len(s) for s in seqs]
    if sum(lens):
        row_idx = np.repeat(np.arange(len(seqs)), lens)
        flat = np.concatenate(seqs).astype(np.int64)
        counts.index_put_((to_device(row_idx, device, torch.int64),
                           to_device(flat, device, torch.int64)),
                          torch.ones(len(flat), dtype=torch.int32, device=device),
                          accumulate=True)
    return counts
