"""The worker's side of speculative decoding: place the scheduled drafts in the step,
verify them with the rejection sampler, and propose the next drafts.

The scheduler counts a request's drafts among its scheduled tokens (they come last), so
the step already computes K/V and hidden states for them like any other tokens; what is
special is only where logits are taken (one row per draft plus one after them) and how
the tokens are chosen from those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.config import SpeculativeConfig
from kvflow.core.sched_output import LogprobsEntry, SchedulerOutput
from kvflow.layers.rejection_sampler import INVALID_TOKEN, RejectionSampler
from kvflow.layers.sampler import SamplingMetadata, gather_logprobs
from kvflow.spec_decode.proposer import make_proposer
from kvflow.worker.transfer import to_device, to_host_async


@dataclass
class DraftPlan:
    """Where one step's drafts sit, for the requests that sample (in sampling order)."""

    num_draft: list[int]  # [S] drafts per sampling request
    draft_token_ids: list[int]  # [D] flat, request-major
    logits_indices: np.ndarray  # [S + D] flat token indices: d_i + 1 rows per request


class SpecDecoder:
    """Owned by the model runner when speculative decoding is on."""

    def __init__(self, config: SpeculativeConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.proposer = make_proposer(config)
        self.rejection_sampler = RejectionSampler()

    # --- before the step --------------------------------------------------------------
    @staticmethod
    def write_drafts(batch, so: SchedulerOutput) -> None:
        """Drafts go right after each request's known tokens (not counted in num_tokens:
        only the accepted ones become known)."""
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            row = batch.index[rid]
            start = int(batch.num_tokens[row])
            batch.token_ids[row, start: start + len(drafts)] = drafts

    @staticmethod
    def plan(so: SchedulerOutput, req_ids: list[str], sample_reqs: np.ndarray,
             qsl: np.ndarray) -> DraftPlan:
        """``sample_reqs`` [S]: indices into ``req_ids`` of requests that sample;
        ``qsl`` [R + 1]: their query start offsets in the flat token list."""
        spec = so.scheduled_spec_decode_tokens
        num_draft, flat, idx = [], [], []
        for i in sample_reqs.tolist():
            drafts = spec.get(req_ids[i], ())
            end = int(qsl[i + 1])
            num_draft.append(len(drafts))
            flat.extend(drafts)
            idx.extend(range(end - 1 - len(drafts), end))
        return DraftPlan(num_draft, flat, np.asarray(idx, dtype=np.int64))

    # --- sampling -------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, meta: SamplingMetadata, plan: DraftPlan,
               min_tokens_left: list[int]) -> dict:
        """logits [S + D, V] -> host copies of the verdict (queued, not waited for)."""
        drafts = to_device(plan.draft_token_ids, self.device, torch.int64)
        out = self.rejection_sampler(logits, drafts, plan.num_draft, meta,
                                     min_tokens_left=min_tokens_left)
        host = {"spec_tokens": to_host_async(out.token_ids),
                "spec_accepted": to_host_async(out.num_accepted)}
        if meta.max_num_logprobs is not None:
            # Logprobs of each emitted token at its own row (raw logits, as Sampler does).
            ids = out.row_token_ids.clamp(min=0)
            host["spec_lp"] = tuple(to_host_async(t) for t in gather_logprobs(
                logits.log_softmax(dim=-1), ids, meta.max_num_logprobs))
        return host

    @staticmethod
    def emitted(host: dict, plan: DraftPlan, j: int, k: int | None
                ) -> tuple[list[int], list[LogprobsEntry] | None]:
        """Sampling request j's emitted tokens (accepted drafts + one) and, when it asked
        for ``k`` logprobs, one entry per emitted token."""
        if "spec_list" not in host:
            host["spec_list"] = host["spec_tokens"].tolist()
            host["spec_acc"] = host["spec_accepted"].tolist()
            host["spec_row0"] = np.concatenate(([0], np.cumsum(np.asarray(plan.num_draft) + 1)))
            if "spec_lp" in host:
                host["spec_lp_list"] = [t.tolist() for t in host["spec_lp"]]
        n = host["spec_acc"][j] + 1
        tokens = host["spec_list"][j][:n]
        assert INVALID_TOKEN not in tokens
        if k is None or "spec_lp_list" not in host:
            return tokens, None
        ids, lps, ranks = host["spec_lp_list"]
        r0 = int(host["spec_row0"][j])
        return tokens, [(ids[r][: k + 1], lps[r][: k + 1], ranks[r]) for r in range(r0, r0 + n)]

    # --- after the step -------------------------------------------------------------
    def propose(self, batch, req_ids: list[str], sampled: list[list[int]]) -> list[list[int]]:
        """Next drafts for every request that got new tokens; none while the batch is
        larger than ``disable_by_batch_size`` (there verification would only add work)."""
        limit = self.config.disable_by_batch_size
        out: list[list[int]] = [[] for _ in req_ids]
        if limit is not None and batch.num_reqs > limit:
            return out
        todo = [(i, batch.index[rid]) for i, rid in enumerate(req_ids)
                if sampled[i] and rid in batch.index]
        if not todo:
            return out
        seqs = [batch.token_ids[row, : int(batch.num_tokens[row])] for _, row in todo]
        k = self.config.num_speculative_tokens
        for (i, _), drafts in zip(todo, self.proposer.propose(seqs, [k] * len(todo))):
            out[i] = drafts
        return out
