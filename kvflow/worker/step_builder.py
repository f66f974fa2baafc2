"""The step builder: the one owner of the worker's per-request state between steps.

It keeps the persistent batch, per-request extras (seeded generators, prompt-logprob
progress) and the tokens still in flight from the last launched step. Each step it
applies the SchedulerOutput, builds the step's inputs (vectorized numpy gathers, then a
handful of host-to-device copies), the attention metadata (the backend's builder runs
here, before the layers) and the sampling metadata; after sampling it records the
sampled tokens as placeholders, and when the host copies arrive it fills them in.

Overlapped steps: step N+1 is built before step N's tokens reach the host. Its input ids
at those positions are PLACEHOLDER in the batch and are taken on the device from
``pending.token_ids``; nothing else in the worker knows about placeholders.

Ranks: the builder reads only the SchedulerOutput and its own state, so every rank of a
parallel group builds the same inputs; ``record_sampled`` takes the step's sampled ids
(sampled once, the same on every rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvflow.core.sched_output import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from kvflow.layers.attention import AttentionMetadata, AttentionMetadataBuilder
from kvflow.layers.rejection_sampler import INVALID_TOKEN
from kvflow.layers.sampler import SamplingMetadata
from kvflow.pooling.pooler import PoolingTracker
from kvflow.utils import cdiv
from kvflow.worker.block_table import DeviceBlockTable
from kvflow.worker.input_batch import InputBatch, RequestExtras
from kvflow.worker.sampling_meta import SamplingMetadataCache, build_sampling_metadata
from kvflow.worker.step_inputs import (PLACEHOLDER, PendingTokens, PromptLogprobsPlan,
                                       PromptLogprobsSpan, SamplePlan, SampleSlot,
                                       StepHostOutputs, StepInputs)
from kvflow.worker.transfer import to_device

if TYPE_CHECKING:
    from kvflow.spec_decode.verify import SpecDecoder


class StepBuilder:
    def __init__(self, batch: InputBatch, block_size: int, device: torch.device,
                 attn_builder: AttentionMetadataBuilder, vocab_size: int,
                 device_block_table: DeviceBlockTable | None = None,
                 spec: "SpecDecoder | None" = None, deterministic: bool = False) -> None:
        self.batch = batch
        # --deterministic: a one-token prompt chunk (a prefix-cache hit up to the last
        # token, a chunk cut at one token) counts as a prefill, so every prompt row takes
        # the prefill attention launch however the prompt was cut (docs/determinism.md)
        self.deterministic = deterministic
        self.block_size = block_size
        self.device = device
        self.attn_builder = attn_builder
        self.vocab_size = vocab_size
        # A device mirror of the block table (GPU): the batch logs its edits for it.
        self.device_block_table = device_block_table
        batch.record_ops = device_block_table is not None
        self.extras: dict[str, RequestExtras] = {}
        self.pending = PendingTokens()
        self.spec = spec  # speculative decoding: drafts in, verdicts out, next drafts
        self.sampling_cache = SamplingMetadataCache()
        self.pooling = PoolingTracker()  # pooling requests' running sums and rows

    # --- state ------------------------------------------------------------------
    def update(self, so: SchedulerOutput) -> None:
        """Apply a SchedulerOutput's request changes to the persistent batch."""
        b = self.batch
        if so.finished_req_ids or so.preempted_req_ids or so.new_reqs:
            self.sampling_cache.invalidate()
        for rid in so.finished_req_ids:
            b.remove(rid)
            self.extras.pop(rid, None)
            self.pooling.drop(rid)
            self.pending.drop(rid)
            if self.spec is not None:
                self.spec.release(rid)
        for rid in so.preempted_req_ids:
            b.remove(rid)  # extras (seeded generator) survive the preemption
            self.pending.drop(rid)
            if self.spec is not None:
                self.spec.release(rid)  # a draft model catches up when it resumes
        for new in so.new_reqs:
            b.add(new)
            if new.req_id not in self.extras:
                extras = RequestExtras()
                seed = new.sampling_params.seed
                if seed is not None:
                    # torch seeds are 64-bit; wrap larger ints instead of overflowing.
                    extras.generator = torch.Generator(self.device).manual_seed(
                        seed % (1 << 64))
                self.extras[new.req_id] = extras
            if new.pooling is not None:
                self.pooling.add(new.req_id, new.pooling, new.num_prompt_tokens,
                                 new.num_computed_tokens)
        for cached in so.cached_reqs:
            if cached.num_kept_blocks is not None:  # rejected drafts' blocks were freed
                b.truncate_blocks(cached.req_id, cached.num_kept_blocks)
            b.append_blocks(cached.req_id, cached.new_block_ids)
            b.num_computed[b.index[cached.req_id]] = cached.num_computed_tokens
        if so.scheduled_spec_decode_tokens:
            self.spec.write_drafts(b, so)

    # --- inputs -----------------------------------------------------------------
    def build(self, so: SchedulerOutput) -> StepInputs:
        """The step's tensors, decodes first, with the attention metadata built."""
        b, bs, dev = self.batch, self.block_size, self.device
        ids = list(so.num_scheduled_tokens)
        n = np.fromiter((so.num_scheduled_tokens[r] for r in ids), dtype=np.int64,
                        count=len(ids))
        prefill = n > 1
        if self.deterministic:
            r0 = np.fromiter((b.index[r] for r in ids), dtype=np.int64, count=len(ids))
            prefill |= b.num_computed[r0] < b.num_prompt_tokens[r0]
        order = np.argsort(prefill, kind="stable")  # decodes first
        num_decodes = len(ids) - int(prefill.sum())
        n = n[order]
        req_ids = [ids[i] for i in order]
        rows = np.fromiter((b.index[r] for r in req_ids), dtype=np.int64, count=len(ids))
        num_reqs = len(req_ids)
        nc = b.num_computed[rows]  # [R]
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)  # [R + 1]
        np.cumsum(n, out=qsl[1:])
        total = int(qsl[-1])
        tok_req = np.repeat(np.arange(num_reqs), n)  # [T] request of each token
        positions = nc[tok_req] + (np.arange(total) - qsl[:-1][tok_req])  # [T]
        tok_rows = rows[tok_req]
        input_ids = b.token_ids[tok_rows, positions]  # [T]
        slots = b.block_table[tok_rows, positions // bs].astype(np.int64) * bs \
            + positions % bs  # [T]
        seq_lens = nc + n  # [R]
        max_seq = int(seq_lens.max())
        rope_positions, tree = positions, None
        if so.scheduled_spec_decode_tokens:
            # Drafts are a request's last scheduled tokens, past its known ones; it
            # samples at each of them and at its last known token.
            nd = self.spec.num_drafts(so, req_ids)  # [R]
            sample_reqs = np.nonzero(seq_lens - nd == b.num_tokens[rows])[0]  # [S]
            offsets, logits_indices = self.spec.sample_rows(qsl, sample_reqs, nd)
            sample = SamplePlan(
                req_indices=sample_reqs, offsets=offsets,
                logits_indices=to_device(logits_indices, dev, torch.int64),
                num_draft=nd[sample_reqs].tolist(),
                draft_token_ids=[t for i in sample_reqs.tolist()
                                 for t in so.scheduled_spec_decode_tokens.get(req_ids[i], ())])
            if self.spec.tree is not None:  # drafts are candidate-tree nodes
                rope_positions = self.spec.tree_positions(positions, qsl, nd)
                tree = self.spec.tree_attention(qsl, seq_lens, nd)
        else:
            # A request samples when this step reaches its last known token.
            done = seq_lens == b.num_tokens[rows]
            if self.pooling.reqs:  # pooling requests are pooled, never sampled
                done &= ~self.pooling.is_pooling(req_ids)
            sample_reqs = np.nonzero(done)[0]  # [S]
            sample = SamplePlan(
                req_indices=sample_reqs,
                offsets=np.arange(len(sample_reqs) + 1, dtype=np.int64),
                logits_indices=to_device(qsl[1:][sample_reqs] - 1, dev, torch.int64))
        plp = self._plan_prompt_logprobs(req_ids, rows, nc, n, qsl)
        pool = self.pooling.plan(req_ids, nc, n, qsl) if self.pooling.reqs else None

        width = cdiv(max_seq, bs)
        if self.device_block_table is not None:
            self.device_block_table.apply(b.take_block_table_ops())
            block_tables = self.device_block_table.gather(to_device(rows, dev, torch.int64),
                                                          width)
        else:
            block_tables = torch.from_numpy(b.block_table[rows, :width])
        positions_dev = to_device(rope_positions, dev, torch.int64)
        meta = AttentionMetadata(
            num_actual_tokens=total, num_reqs=num_reqs, num_decodes=num_decodes,
            max_query_len=int(n.max()), max_seq_len=max_seq,
            slot_mapping=to_device(slots, dev, torch.int64),
            query_start_loc=to_device(qsl, dev, torch.int32),
            seq_lens=to_device(seq_lens, dev, torch.int32), block_tables=block_tables,
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(), tree=tree)
        self.attn_builder.build(meta, positions_dev)
        input_ids_dev = to_device(input_ids, dev, torch.int64)
        unknown = np.nonzero(input_ids == PLACEHOLDER)[0]
        if len(unknown):  # tokens sampled by the step still in flight: take them on device
            src = [self.pending.source(req_ids[tok_req[i]], int(positions[i]))
                   for i in unknown]
            input_ids_dev[to_device(unknown, dev, torch.int64)] = \
                self.pending.token_ids[to_device(src, dev, torch.int64)]
        prompt_rows = None
        if dev.type == "cpu":  # the C++ step keeps prompt tokens off int8 activations
            idx = np.flatnonzero(positions < b.num_prompt_tokens[tok_rows])
            if len(idx):
                prompt_rows = torch.from_numpy(idx.astype(np.int64))
        return StepInputs(req_ids=req_ids, rows=rows, input_ids=input_ids_dev,
                          positions=positions_dev, meta=meta, sample=sample,
                          prompt_logprobs=plp, prompt_rows=prompt_rows, pooling=pool)

    def _plan_prompt_logprobs(self, req_ids: list[str], rows: np.ndarray, nc: np.ndarray,
                              n: np.ndarray, qsl: np.ndarray) -> PromptLogprobsPlan:
        """Which positions of this step's prompt chunks still owe prompt logprobs.

        The hidden state at position p scores prompt token p + 1.
        """
        b = self.batch
        plan = PromptLogprobsPlan()
        for i, rid in enumerate(req_ids):
            k = b.params[rows[i]].prompt_logprobs
            if k is None:
                continue
            extras = self.extras[rid]
            num_prompt = int(b.num_prompt_tokens[rows[i]])
            first = max(int(nc[i]), extras.prompt_logprobs_done)
            last = min(int(nc[i] + n[i]), num_prompt - 1)  # exclusive bound on p
            if first >= last:
                continue
            start = len(plan.indices)
            base = int(qsl[i]) - int(nc[i])
            plan.indices.extend(range(base + first, base + last))
            plan.targets.extend(b.token_ids[rows[i], first + 1: last + 1].tolist())
            plan.spans.append(PromptLogprobsSpan(rid, start, len(plan.indices),
                                                 min(k, self.vocab_size)))
            extras.prompt_logprobs_done = last
        return plan

    def sampling_metadata(self, inputs: StepInputs) -> SamplingMetadata:
        """Sampling tensors for the step's sample rows (one per sampled position); with
        drafts, one row per sampling request (the rejection sampler expands it over the
        request's rows, counting earlier drafts for penalties and min_tokens)."""
        sample = inputs.sample
        counts = sample.counts() if sample.num_draft is None else np.ones(sample.num_reqs,
                                                                          dtype=np.int64)
        req_idx = np.repeat(sample.req_indices, counts)  # [N] request of each sample row
        rows = inputs.rows[req_idx]
        req_ids = [inputs.req_ids[i] for i in req_idx]
        generators = [self.extras[rid].generator for rid in req_ids]
        return build_sampling_metadata(self.batch, rows, req_ids, generators, self.pending,
                                       self.vocab_size, self.device, self.sampling_cache)

    # --- outputs ----------------------------------------------------------------
    def record_sampled(self, inputs: StepInputs, sampled: torch.Tensor) -> list[SampleSlot]:
        """The step sampled ``sampled`` [N] (on the device): those tokens join their
        sequences now as placeholders, so the next step can be built before the host
        learns their values (``finish`` fills them in)."""
        b, sample = self.batch, inputs.sample
        self.pending = PendingTokens(token_ids=sampled)
        slots = []
        for j, (i, count) in enumerate(zip(sample.req_indices, sample.counts())):
            i, count = int(i), int(count)
            rid = inputs.req_ids[i]
            row = int(inputs.rows[i])
            pos = int(b.num_tokens[row])
            first = int(sample.offsets[j])
            self.pending.spans[rid] = (pos, first, count)
            slots.append(SampleSlot(i, rid, pos, first, count, b.params[row].logprobs))
            for _ in range(count):
                b.append_token(row, PLACEHOLDER)
        return slots

    def min_tokens_left(self, inputs: StepInputs) -> list[int]:
        """[S] tokens each sampling request must still generate before it may stop."""
        b = self.batch
        rows = inputs.rows[inputs.sample.req_indices]
        return [b.params[r].min_tokens - int(b.num_tokens[r] - b.num_prompt_tokens[r])
                for r in rows]

    def record_verified(self, inputs: StepInputs) -> list[SampleSlot]:
        """A verification step was launched: its tokens join their sequences when the
        host has them (how many a request keeps is only known then). The engine collects
        a verification step before it schedules the next one (engine/spec_overlap.py), so
        nothing is left in flight."""
        b, sample = self.batch, inputs.sample
        self.pending = PendingTokens()
        slots = []
        for j, (i, count) in enumerate(zip(sample.req_indices, sample.counts())):
            i, row = int(i), int(inputs.rows[int(i)])
            slots.append(SampleSlot(i, inputs.req_ids[i], int(b.num_tokens[row]),
                                    int(sample.offsets[j]), int(count),
                                    b.params[row].logprobs, verified=True))
        return slots

    def finish(self, inputs: StepInputs | None, host: StepHostOutputs,
               verify_time_s: float | None = None) -> ModelRunnerOutput:
        """A completed step's outputs as plain lists; placeholders get their values.
        ``verify_time_s``: how long the step took, passed on when it verified drafts."""
        if inputs is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        b = self.batch
        num_reqs = len(inputs.req_ids)
        sampled_lists: list[list[int]] = [[] for _ in range(num_reqs)]
        logprob_lists: list[list[LogprobsEntry] | None] = [None] * num_reqs
        last_rows: dict[int, int] = {}  # request index -> sample row of its last token
        if host.sampled is not None:
            sampled = host.sampled.tolist()
            lp = [t.tolist() for t in host.logprobs] if host.logprobs is not None else None
            for s in host.slots:
                tokens = sampled[s.first_row: s.first_row + s.count]
                row = b.index.get(s.req_id)
                if s.verified:  # the emitted prefix (accepted drafts + one token)
                    tokens = tokens[: tokens.index(INVALID_TOKEN)] if INVALID_TOKEN in \
                        tokens else tokens
                    if row is not None:
                        for token in tokens:
                            b.append_token(row, token)
                sampled_lists[s.req_index] = tokens
                if tokens:
                    last_rows[s.req_index] = s.first_row + len(tokens) - 1
                if row is not None and not s.verified:  # fill in its placeholders
                    for pos, token in enumerate(tokens, start=s.position):
                        if b.token_ids[row, pos] == PLACEHOLDER:
                            b.token_ids[row, pos] = token
                k = s.num_logprobs
                if lp is not None and k is not None:
                    logprob_lists[s.req_index] = [
                        (lp[0][r][: k + 1], lp[1][r][: k + 1], lp[2][r])
                        for r in range(s.first_row, s.first_row + len(tokens))]
        spec_tokens = draft_s = None
        if self.spec is not None:
            spec_tokens, draft_s = self.spec.propose(b, inputs.req_ids, sampled_lists,
                                                     host.sample_hidden, last_rows)
        return ModelRunnerOutput(req_ids=inputs.req_ids, sampled_token_ids=sampled_lists,
                                 logprobs=logprob_lists,
                                 prompt_logprobs=_prompt_logprobs_lists(host.prompt_logprobs),
                                 pooled=self.pooling.collect(host.pooled),
                                 spec_token_ids=spec_tokens, spec_draft_time_s=draft_s,
                                 spec_verify_time_s=verify_time_s
                                 if inputs.sample.num_draft is not None else None)


def _prompt_logprobs_lists(plp) -> dict[str, list[LogprobsEntry]]:
    if plp is None:
        return {}
    spans, tensors = plp
    ids, lps, ranks = (t.tolist() for t in tensors)
    return {s.req_id: [(ids[j][: s.num_logprobs + 1], lps[j][: s.num_logprobs + 1],
                        ranks[j]) for j in range(s.start, s.end)] for s in spans}
