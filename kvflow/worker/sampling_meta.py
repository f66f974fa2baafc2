"""Per-step SamplingMetadata from the persistent batch's sampling parameters, the
prompt-logprobs tensors of a step's prompt rows and a grammar mask applied to the sample
rows' logits (the runner's and a pipeline stage's)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvflow.layers.sampler import SamplingMetadata, gather_logprobs
from kvflow.layers.token_bitmask import apply_token_bitmask
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.step_inputs import PLACEHOLDER, PendingTokens, PromptLogprobsPlan
from kvflow.worker.transfer import to_device


class SamplingMetadataCache:
    """The part of a step's SamplingMetadata that depends only on which requests sample,
    in which order (temperatures, filters, penalty weights, prompt masks, generators).

    A steady decode batch then pays a tuple comparison per step instead of a pass over
    its rows; the step builder invalidates it whenever requests join or leave (a request
    id may come back with other parameters).
    """

    def __init__(self) -> None:
        self.key: tuple[str, ...] | None = None
        self.static: dict | None = None

    def invalidate(self) -> None:
        self.key = self.static = None


def build_sampling_metadata(batch: InputBatch, rows: np.ndarray, req_ids: list[str],
                            generators: list[torch.Generator | None], pending: PendingTokens,
                            vocab_size: int, device: torch.device,
                            cache: SamplingMetadataCache | None = None) -> SamplingMetadata:
    """Sampling tensors for sample rows ``rows`` (batch rows, one per sampled position;
    ``req_ids`` and ``generators`` align with them).

    Values a client chose are clamped to what a tensor and the vocabulary can hold: a
    ``top_k`` at or above the vocabulary means no limit (as in vLLM), and no int here
    overflows int64. Only min_tokens bans and output-token counts change from step to
    step; the rest comes from ``cache`` while the same requests sample.
    """
    key = tuple(req_ids)
    if cache is not None and cache.key == key:
        static = cache.static
    else:
        static = _static_part(batch, rows, generators, vocab_size, device)
        if cache is not None:
            cache.key, cache.static = key, static
    meta = SamplingMetadata(**static["fields"])
    if static["counts"]:
        meta.output_counts = _output_counts(batch, rows, req_ids, pending, vocab_size, device)
    if static["min_tokens"]:
        meta.banned = _banned(batch, rows, static["params"], vocab_size, device)
    return meta


def _static_part(b: InputBatch, rows: np.ndarray, generators: list[torch.Generator | None],
                 vocab: int, dev: torch.device) -> dict:
    params = [b.params[r] for r in rows]
    greedy = [p.greedy for p in params]
    f32 = torch.float32
    fields: dict = dict(
        temperature=to_device([0.0 if g else p.temperature for p, g in zip(params, greedy)],
                              dev, f32),
        all_greedy=all(greedy), all_random=not any(greedy), top_k=None, top_p=None, min_p=None,
        generators={j: gen for j, gen in enumerate(generators) if gen is not None})
    if any(0 < p.top_k < vocab for p in params):
        fields["top_k"] = to_device([p.top_k if 0 < p.top_k < vocab else vocab
                                     for p in params], dev, torch.int64)
    if any(p.top_p < 1.0 for p in params):
        fields["top_p"] = to_device([p.top_p for p in params], dev, f32)
    if any(p.min_p > 0.0 for p in params):
        fields["min_p"] = to_device([p.min_p for p in params], dev, f32)
    use_freq = any(p.presence_penalty or p.frequency_penalty for p in params)
    use_rep = any(p.repetition_penalty != 1.0 for p in params)
    if use_freq:
        fields["presence_penalty"] = to_device([p.presence_penalty for p in params], dev, f32)
        fields["frequency_penalty"] = to_device([p.frequency_penalty for p in params], dev,
                                                f32)
    if use_rep:
        fields["repetition_penalty"] = to_device([p.repetition_penalty for p in params], dev,
                                                 f32)
        fields["prompt_mask"] = token_counts([b.prompt_token_ids(r) for r in rows], vocab,
                                             dev) > 0
    if any(p.logit_bias for p in params):
        rows_, ids_, vals_ = [], [], []
        for j, p in enumerate(params):
            for t, v in (p.logit_bias or {}).items():
                if 0 <= t < vocab:
                    rows_.append(j)
                    ids_.append(t)
                    vals_.append(float(v))
        if rows_:
            fields["logit_bias"] = (to_device(rows_, dev, torch.int64),
                                    to_device(ids_, dev, torch.int64),
                                    to_device(vals_, dev, f32))
    asked = [p.logprobs for p in params if p.logprobs is not None]
    fields["max_num_logprobs"] = min(max(asked), vocab) if asked else None
    return {"fields": fields, "params": params, "counts": use_freq or use_rep,
            "min_tokens": any(p.min_tokens > 0 for p in params)}


def _banned(b: InputBatch, rows: np.ndarray, params, vocab: int,
            dev: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) to forbid: a row under min_tokens may not sample a stop token."""
    banned_rows, banned_ids = [], []
    for j, (p, r) in enumerate(zip(params, rows)):
        if b.num_tokens[r] - b.num_prompt_tokens[r] < p.min_tokens:
            stop = {t for t in p.all_stop_token_ids if 0 <= t < vocab}
            if not p.ignore_eos:  # the same EOS ids the scheduler stops on
                stop.update(t for t in b.eos_token_ids[r] if 0 <= t < vocab)
            banned_rows += [j] * len(stop)
            banned_ids += sorted(stop)
    if not banned_rows:
        return None
    return (to_device(banned_rows, dev, torch.int64), to_device(banned_ids, dev, torch.int64))


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


def prompt_logprobs_tensors(plan: PromptLogprobsPlan, hidden: torch.Tensor,
                            compute_logits: Callable[[torch.Tensor], torch.Tensor]):
    """(ids [P, 1 + k], logprobs [P, 1 + k], ranks [P]) of the plan's prompt rows, from
    the step's final hidden states [T, hidden] through the model's ``compute_logits``."""
    dev = hidden.device
    logits = compute_logits(hidden[to_device(plan.indices, dev, torch.int64)])
    k_max = max(span.num_logprobs for span in plan.spans)
    return gather_logprobs(logits.log_softmax(dim=-1),
                           to_device(plan.targets, dev, torch.int64), k_max)


def apply_grammar_mask(logits: torch.Tensor, mask) -> torch.Tensor:
    """Forbid what the step's grammars forbid in its constrained rows of ``logits`` [N, V]
    (in place); ``mask``: the future of the StepMask the structured-output manager fills
    (``start``), or None where no row is constrained."""
    if mask is None:
        return logits
    m = mask.result()
    dev = logits.device
    return apply_token_bitmask(logits, m.rows.to(dev, non_blocking=True),
                               m.bitmask.to(dev, non_blocking=True))
