"""One pipeline stage's part of a forward pass (pipeline parallelism).

The first stage embeds the tokens, every stage runs its contiguous range of decoder
layers, and each stage but the last sends its hidden states and residual to the same
tensor-parallel rank of the next stage (point-to-point over the pipeline group); the last
stage applies the final norm and returns the hidden states for the logits. The model
file stays free of pipeline branches: this module drives its parts
(``embed_tokens``, ``layers[start_layer:end_layer]``, ``norm``), which every Llama-family
model in kvflow has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvflow.distributed.parallel_state import GroupCoordinator, ParallelState
from kvflow.layers.attention import AttentionMetadata
from kvflow.worker.sampling_meta import apply_grammar_mask, prompt_logprobs_tensors
from kvflow.worker.step_inputs import StepHostOutputs, StepInputs
from kvflow.worker.transfer import to_host_async

if TYPE_CHECKING:
    from kvflow.layers.sampler import Sampler
    from kvflow.worker.step_builder import StepBuilder


class PipelineStage:
    def __init__(self, model: nn.Module, pp: GroupCoordinator) -> None:
        self.model = model
        self.pp = pp
        self.hidden_size = model.config.hidden_size
        self.dtype = model.model.norm.weight.dtype

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor | None:
        """input_ids, positions [T] -> final hidden states [T, hidden] on the last stage,
        None on the others."""
        m, pp = self.model.model, self.pp
        t = input_ids.shape[0]
        if pp.is_first:
            hidden, residual = m.embed_tokens(input_ids), None  # [T, hidden]
        else:
            both = pp.recv((2, t, self.hidden_size), self.dtype, src=pp.rank_in_group - 1)
            hidden, residual = both[0], both[1]
        for layer in m.layers[m.start_layer:m.end_layer]:
            hidden, residual = layer(positions, hidden, residual, meta)
        if pp.is_last:
            hidden, _ = m.norm(hidden, residual)
            return hidden
        pp.send(torch.stack([hidden, residual]), dst=pp.rank_in_group + 1)  # [2, T, hidden]
        return None


# Point-to-point tags of what the sampling rank sends rank 0 (gloo matches on them; NCCL
# keeps the order, which both sides share).
_LOGPROBS_TAG, _PROMPT_LOGPROBS_TAG = 1, 2


class PipelineResults:
    """How a pipeline-parallel step's results leave the rank that computed them.

    The first TP rank of the last stage samples (after masking the constrained rows'
    logits: it keeps the grammar matchers, as rank 0 does without pipeline parallelism).
    It broadcasts the sampled ids to every rank (each writes them into its persistent
    batch) and sends logprobs and prompt logprobs, which only rank 0 returns, to rank 0
    alone, point to point. The other ranks post their receives when they launch the step
    and wait for them only when the step is collected (``StepHandle.result``), so rank 0
    can launch the next batch (its own stage of it) while the later stages still run
    this one: that is what keeps several batches in flight. With ``defer`` off (one batch at a time) they wait at
    once, as overlapped steps need the tokens before the next step is built.

    Built from what it reads, as the CUDA graph runner is: the rank's process groups,
    the step builder (sampling metadata, the persistent batch, placeholders), the model
    (its logits) and the sampler.
    """

    def __init__(self, parallel: ParallelState, defer: bool, builder: StepBuilder,
                 model: nn.Module, sampler: Sampler) -> None:
        self.parallel = parallel
        self.defer = defer
        self.builder = builder
        self.model = model
        self.sampler = sampler
        # The first rank of the last stage (global rank; the world group's rank too).
        self.sampler_rank = parallel.world.world_size - parallel.tp.world_size

    def launch(self, inputs: StepInputs, hidden: torch.Tensor | None,
               host: StepHostOutputs, mask=None) -> Callable[[], None] | None:
        """Sample (on the sampling rank) or post the receives (elsewhere); fills ``host``
        now, or returns what fills it when the step is collected. ``mask``: the grammar
        mask of the step's constrained rows (only the sampling rank keeps matchers)."""
        p, builder = self.parallel, self.builder
        sample, plan = inputs.sample, inputs.prompt_logprobs
        logits = prompt = None
        if hidden is not None:  # the last stage: every TP rank joins the logits gather
            if sample.num_reqs:
                logits = self.model.compute_logits(hidden[sample.logits_indices])  # [N, V]
            if plan.indices:
                prompt = prompt_logprobs_tensors(plan, hidden, self.model.compute_logits)
        if p.rank == self.sampler_rank:
            if sample.num_reqs:
                logits = apply_grammar_mask(logits, mask)
                out = self.sampler(logits, builder.sampling_metadata(inputs))
                p.world.broadcast(out.sampled, src=self.sampler_rank)
                host.sampled = to_host_async(out.sampled)
                if out.logprobs is not None:
                    lp = (out.logprob_token_ids, out.logprobs, out.sampled_ranks)
                    host.logprobs = tuple(to_host_async(t) for t in lp)
                    self._send(lp, _LOGPROBS_TAG)
                host.slots = builder.record_sampled(inputs, out.sampled)
            if prompt is not None:
                host.prompt_logprobs = plan.spans, tuple(to_host_async(t) for t in prompt)
                self._send(prompt, _PROMPT_LOGPROBS_TAG)
            return None
        works, sampled, lp_bufs, plp_bufs = [], None, None, None
        if sample.num_reqs:
            sampled = torch.empty(sample.num_reqs, dtype=torch.int64, device=builder.device)
            works.append(p.world.broadcast_async(sampled, src=self.sampler_rank))
            if p.is_driver:
                k = _num_logprobs(builder, inputs)
                if k is not None:
                    lp_bufs = self._recv(sample.num_reqs, k, _LOGPROBS_TAG, works)
            # Placeholders now (their values arrive with the broadcast), as on the sampler.
            host.slots = builder.record_sampled(inputs, sampled)
        if plan.indices and p.is_driver:
            plp_bufs = self._recv(len(plan.indices),
                                  max(s.num_logprobs for s in plan.spans),
                                  _PROMPT_LOGPROBS_TAG, works)

        def collect() -> None:
            for w in works:
                w.wait()
            if sampled is not None:
                host.sampled = sampled.cpu()
            if lp_bufs is not None:
                host.logprobs = _unpack(lp_bufs)
            if plp_bufs is not None:
                host.prompt_logprobs = plan.spans, _unpack(plp_bufs)

        if not self.defer:
            collect()
            return None
        return collect

    def _send(self, tensors, tag: int) -> None:
        """(ids [N, 1 + k], logprobs [N, 1 + k], ranks [N]) to rank 0, as two messages."""
        ids, lps, ranks = tensors
        ints = torch.cat((ids.to(torch.int64), ranks.to(torch.int64)[:, None]), dim=1)
        self.parallel.world.send(ints, dst=0, tag=tag)  # [N, 2 + k]
        self.parallel.world.send(lps.to(torch.float32).contiguous(), dst=0, tag=tag)

    def _recv(self, n: int, k: int, tag: int, works: list):
        dev = self.parallel.world.device
        ints = torch.empty(n, k + 2, dtype=torch.int64, device=dev)
        lps = torch.empty(n, k + 1, dtype=torch.float32, device=dev)
        works.append(self.parallel.world.recv_async(ints, self.sampler_rank, tag))
        works.append(self.parallel.world.recv_async(lps, self.sampler_rank, tag))
        return ints, lps


def _num_logprobs(builder, inputs: StepInputs) -> int | None:
    """The top-N the sampler returns for this step's sample rows (its SamplingMetadata
    rule), computed from the batch without building the sampling tensors."""
    b = builder.batch
    rows = inputs.rows[inputs.sample.req_indices]
    asked = [b.params[int(r)].logprobs for r in rows if b.params[int(r)].logprobs is not None]
    return min(max(asked), builder.vocab_size) if asked else None


def _unpack(bufs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ints, lps = (t.cpu() for t in bufs)
    return ints[:, :-1], lps, ints[:, -1]
