"""The worker's side of speculative decoding, used by the step builder and the runner:
place the scheduled drafts in the step, verify them with the rejection sampler, and
propose the next drafts.

The scheduler counts a request's drafts among its scheduled tokens (they come last), so
the step computes K/V and hidden states for them like for any other tokens; what is
special is only where logits are taken (one sample row per draft plus one after them,
``SamplePlan`` with ``d + 1`` rows for the request) and how tokens are chosen from them.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvflow.config import EngineConfig
from kvflow.core.sched_output import SchedulerOutput
from kvflow.layers.rejection_sampler import RejectionSampler
from kvflow.layers.sampler import SamplingMetadata, gather_logprobs
from kvflow.spec_decode.registry import make_proposer
from kvflow.worker.step_inputs import PLACEHOLDER
from kvflow.worker.transfer import to_device


class SpecDecoder:
    """Owned by the model runner (and handed to its step builder) when speculative
    decoding is on."""

    def __init__(self, config: EngineConfig, device: torch.device, backend,
                 kernels: bool = False, target: torch.nn.Module | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.config = config.speculative
        self.device = device
        self.proposer = make_proposer(config.speculative, config, device, backend, kernels,
                                      target, dtype)
        # Keep each step's sample-row hidden states for the proposer (Medusa heads).
        self.wants_hidden = self.proposer.wants_hidden
        self.rejection_sampler = RejectionSampler()
        # BENCH ONLY (kvflow/bench/spec_oracle.py): keep every draft whatever the target
        # says, to measure what all-accepted verification steps cost. Nothing else sets it.
        self.accept_all = False
        # A candidate tree (Medusa): drafts are its nodes, verified with tree attention.
        self.tree = None
        self.tree_verifier = None
        if self.proposer.tree is not None:
            self.set_tree(self.proposer.tree)

    def set_tree(self, tree) -> None:
        """Verify drafts as nodes of ``tree`` (a DraftTree; None: as a chain)."""
        from kvflow.spec_decode.tree_verify import TreeVerifier

        self.tree = tree
        self.tree_verifier = None if tree is None else TreeVerifier(
            tree, self.config.posterior_threshold, self.config.posterior_alpha,
            self.config.tree_acceptance)
        if self.tree_verifier is not None:
            self.tree_verifier.accept_all = self.accept_all

    def init_cache(self, num_blocks: int) -> None:
        self.proposer.init_cache(num_blocks)

    def warmup(self, target_step) -> None:
        """The target's step is built (``graphs``, or None): the proposer's turn."""
        self.proposer.warmup(target_step)

    def release(self, req_id: str) -> None:
        """A request left the batch: the proposer's state for it (a draft model's blocks)
        goes."""
        self.proposer.release(req_id)

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
    def num_drafts(so: SchedulerOutput, req_ids: list[str]) -> np.ndarray:
        """[R] drafts of each request of the step (0 for most)."""
        spec = so.scheduled_spec_decode_tokens
        return np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int64,
                           count=len(req_ids))

    @staticmethod
    def sample_rows(qsl: np.ndarray, sample_reqs: np.ndarray, nd: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Sample rows of drafting requests: the last d + 1 tokens of each one's chunk.
        Returns offsets [S + 1] and flat token indices [N]."""
        counts = nd[sample_reqs] + 1  # [S]
        offsets = np.zeros(len(sample_reqs) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        ends = qsl[1:][sample_reqs]  # [S] one past each request's last token
        row_req = np.repeat(np.arange(len(sample_reqs)), counts)  # [N]
        within = np.arange(int(offsets[-1])) - offsets[:-1][row_req]
        return offsets, ends[row_req] - counts[row_req] + within

    # --- sampling -------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, meta: SamplingMetadata, num_draft: list[int],
               draft_token_ids: list[int], min_tokens_left: list[int],
               req_ids: list[str] | None = None):
        """logits [N, V] (N = sum(d_i + 1)), ``meta`` with one row per request (named
        ``req_ids``) -> (token emitted at each sample row [N], INVALID_TOKEN past a
        request's last; logprobs of those tokens (ids, logprobs, ranks) or None)."""
        drafts = to_device(draft_token_ids, self.device, torch.int64)
        draft_probs = None if req_ids is None else self._draft_probs(
            req_ids, num_draft, draft_token_ids, drafts, logits.shape[-1])
        out = self.rejection_sampler(logits, drafts, num_draft, meta, draft_probs=draft_probs,
                                     min_tokens_left=min_tokens_left,
                                     accept_all=self.accept_all)
        logprobs = None
        if meta.max_num_logprobs is not None:
            # Logprobs of each emitted token at its own row (raw logits, as Sampler does).
            logprobs = gather_logprobs(logits.log_softmax(dim=-1),
                                       out.row_token_ids.clamp(min=0), meta.max_num_logprobs)
        return out.row_token_ids, logprobs

    def verify_tree(self, logits: torch.Tensor, meta: SamplingMetadata, num_draft: list[int],
                    draft_token_ids: list[int], min_tokens_left: list[int]):
        """Tree verification (tree_verify.py): (emitted token per sample row [N],
        logprobs or None, the TreeVerifyOutput). Logprobs are read at the row that
        scored each emitted token."""
        drafts = to_device(draft_token_ids, self.device, torch.int64)
        out = self.tree_verifier(logits, drafts, num_draft, meta, min_tokens_left)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = gather_logprobs(logits[out.perm].log_softmax(dim=-1),
                                       out.row_token_ids.clamp(min=0), meta.max_num_logprobs)
        return out.row_token_ids, logprobs, out

    def tree_positions(self, positions: np.ndarray, qsl: np.ndarray, nd: np.ndarray
                       ) -> np.ndarray:
        """Rotary positions of a step whose drafts are tree nodes: node n sits at its
        root's position + its depth (its slot stays in node order). [T] -> [T]."""
        out = positions.copy()
        for i in np.nonzero(nd)[0].tolist():
            d, end = int(nd[i]), int(qsl[i + 1])
            out[end - d: end] = positions[end - d - 1] + self.tree.depth[:d]
        return out

    def tree_attention(self, qsl: np.ndarray, seq_lens: np.ndarray, nd: np.ndarray):
        """The step's TreeAttention: request i's last nd[i] + 1 tokens are its tree."""
        from kvflow.layers.attention.metadata import TreeAttention

        vis = self.tree.visible
        visible = [vis[: d + 1, : d + 1] if d else None for d in nd.tolist()]
        return TreeAttention.build(visible, qsl.tolist(), seq_lens.tolist(), self.device)

    def _draft_probs(self, req_ids: list[str], num_draft: list[int], draft_ids: list[int],
                     drafts: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """[D, V] distributions the drafts were drawn from (one-hot rows for requests whose
        drafts are deterministic), or None when no request's drafts were sampled."""
        qs, start = [], 0
        for rid, d in zip(req_ids, num_draft):
            qs.append((start, d, self.proposer.draft_probs(rid, draft_ids[start: start + d])
                       if d else None))
            start += d
        if all(q is None for _, _, q in qs):
            return None  # deterministic drafts only: the one-hot rule needs no q
        return torch.cat([torch.nn.functional.one_hot(drafts[s: s + d], vocab).float()
                          if q is None else q for s, d, q in qs])

    # --- after the step -------------------------------------------------------------
    def propose(self, batch, req_ids: list[str], sampled: list[list[int]],
                hidden: torch.Tensor | None = None,
                hidden_rows: dict[int, int] | None = None
                ) -> tuple[list[list[int]], float | None]:
        """Next drafts for every request that got new tokens; none while the batch is
        larger than ``disable_by_batch_size`` (there verification would only add work).
        ``hidden`` [N, H]: the step's sample-row hidden states, ``hidden_rows[i]`` the row
        that gave request i's last token (proposers that want them). Returns the drafts
        and the seconds the proposer ran (the drafts are host lists, so that includes its
        device work), or None when it did not run."""
        limit = self.config.disable_by_batch_size
        out: list[list[int]] = [[] for _ in req_ids]
        if limit is not None and batch.num_reqs > limit:
            return out, None
        # A request whose last token is still in flight (the next step was launched
        # before this one was collected: overlapped steps) cannot be drafted for: its
        # drafts would sit at the wrong positions, and that step verifies none.
        todo = [(i, row) for i, rid in enumerate(req_ids)
                if sampled[i] and (row := batch.index.get(rid)) is not None
                and batch.token_ids[row, int(batch.num_tokens[row]) - 1] != PLACEHOLDER]
        if not todo:
            return out, None
        start = time.perf_counter()
        seqs = [batch.token_ids[row, : int(batch.num_tokens[row])] for _, row in todo]
        k = self.config.num_speculative_tokens
        extra = {}
        if self.wants_hidden:
            todo = [(i, row) for i, row in todo if hidden_rows and i in hidden_rows]
            if not todo or hidden is None:
                return out, None
            seqs = [batch.token_ids[row, : int(batch.num_tokens[row])] for _, row in todo]
            extra["hidden"] = hidden[to_device([hidden_rows[i] for i, _ in todo],
                                               self.device, torch.int64)]
        with torch.inference_mode():
            proposed = self.proposer.propose(seqs, [k] * len(todo),
                                             [req_ids[i] for i, _ in todo],
                                             [batch.params[row] for _, row in todo], **extra)
        for (i, _), drafts in zip(todo, proposed):
            out[i] = drafts
        return out, time.perf_counter() - start
